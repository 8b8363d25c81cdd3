"""ModelSpec: a model as an ordered list of layers (embedding, N blocks, final norm + head).

The planner cuts pipeline stages between these layers; the cost model reads the dimensions; the executor
and the profiler build the real `nn.Module` from the same spec (`executor/model.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from meshplan.planner.errors import InputError
from meshplan.planner.fields import Fields

LAYER_KINDS = ("embedding", "block", "head")
ARCHS = ("gpt2", "llama", "custom")


@dataclass(frozen=True)
class LayerSpec:
    """One cuttable layer. `tied_params` are parameters owned by another layer but also used here
    (a tied LM head): a stage holding this layer without its owner keeps a copy, as Megatron-LM does."""

    kind: str
    name: str
    params: int
    tied_params: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, path: str) -> LayerSpec:
        f = Fields(data, path)
        return cls(
            kind=f.str("kind", choices=LAYER_KINDS),
            name=f.str("name"),
            params=f.int("params", min=0),
            tied_params=f.int("tied_params", min=0, default=0),
        )


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer plus its layer list.

    arch "gpt2": LayerNorm, GELU MLP, learned positions, biases everywhere.
    arch "llama": RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases
    (qwen2 adds a q/k/v bias). arch "custom": a user `module:factory`; dimensions are best-effort.
    """

    name: str
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    max_seq_len: int
    head_dim: int = 0  # 0 means hidden_size // num_heads
    tied_embeddings: bool = False
    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    position: str = "rope"
    linear_bias: bool = False
    qkv_bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    factory: str | None = None
    layers: tuple[LayerSpec, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not self.layers:
            object.__setattr__(self, "layers", tuple(standard_layers(self)))

    @property
    def num_parameters(self) -> int:
        """Unique parameters (a tied head weight counts once)."""
        return sum(layer.params for layer in self.layers)

    @property
    def block_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "block"]

    def with_name(self, name: str) -> ModelSpec:
        return replace(self, name=name)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = [layer.to_dict() for layer in self.layers]
        data["num_parameters"] = self.num_parameters
        return data

    @classmethod
    def from_dict(cls, data: dict, path: str = "model") -> ModelSpec:
        f = Fields(data, path)
        layers = tuple(LayerSpec.from_dict(d, f"{path}.layers[{i}]") for i, d in enumerate(f.list("layers")))
        if not layers:
            raise InputError(f"{path}.layers: expected a non-empty list of layers")
        spec = cls(
            name=f.str("name"),
            arch=f.str("arch", choices=ARCHS),
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=f.int("hidden_size", min=1),
            num_layers=f.int("num_layers", min=1),
            num_heads=f.int("num_heads", min=1),
            num_kv_heads=f.int("num_kv_heads", min=1),
            ffn_hidden_size=f.int("ffn_hidden_size", min=1),
            max_seq_len=f.int("max_seq_len", min=1),
            head_dim=f.int("head_dim", min=0, default=0),
            tied_embeddings=f.bool("tied_embeddings", default=False),
            norm=f.str("norm", choices=("layernorm", "rmsnorm"), default="rmsnorm"),
            mlp=f.str("mlp", choices=("gelu", "swiglu"), default="swiglu"),
            position=f.str("position", choices=("learned", "rope"), default="rope"),
            linear_bias=f.bool("linear_bias", default=False),
            qkv_bias=f.bool("qkv_bias", default=False),
            norm_eps=f.float("norm_eps", min=0.0, default=1e-5),
            rope_theta=f.float("rope_theta", min=0.0, default=10000.0),
            factory=f.str("factory", default=None),
            layers=layers,
        )
        if "num_parameters" in data and f.int("num_parameters", min=0) != spec.num_parameters:
            raise InputError(
                f"{path}.num_parameters: expected {spec.num_parameters} (the sum of the layers' params), "
                f"got {data['num_parameters']}"
            )
        if sum(1 for layer in layers if layer.kind == "block") != spec.num_layers:
            raise InputError(f"{path}.layers: expected {spec.num_layers} layers of kind 'block'")
        return spec


def wrapped_unit_params(spec: ModelSpec, blocks: int) -> list[int]:
    """Parameters of each unit the executor's data-parallel engine wraps in a model cut to its embedding,
    first `blocks` blocks and head: every block, then the root (embedding and head; a tied head's weight
    is the embedding's, which the head's LayerSpec.params already leaves out)."""
    by_kind = {layer.kind: layer.params for layer in spec.layers}
    return [by_kind["block"]] * blocks + [by_kind["embedding"] + by_kind["head"]]


def splits_vocab(spec: ModelSpec, tp: int) -> bool:
    """Whether tensor parallelism of degree `tp` shards the embedding and LM head over the vocabulary:
    when it divides V evenly, else both stay replicated (executor.parallelize.apply_tp)."""
    return spec.vocab_size % tp == 0


def vocab_shard(spec: ModelSpec, tp: int) -> int:
    """Vocabulary entries of the embedding and LM head on one TP rank (`splits_vocab`)."""
    return spec.vocab_size // tp if splits_vocab(spec, tp) else spec.vocab_size


def block_params(spec: ModelSpec) -> int:
    """Parameters of one transformer block from its dimensions."""
    h, ffn = spec.hidden_size, spec.ffn_hidden_size
    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    norm = 2 * h if spec.norm == "layernorm" else h
    attn = h * (q_dim + 2 * kv_dim) + q_dim * h
    mlp = (3 if spec.mlp == "swiglu" else 2) * h * ffn
    bias = 0
    if spec.linear_bias:
        bias += q_dim + 2 * kv_dim + h + (2 * ffn if spec.mlp == "swiglu" else ffn) + h
    elif spec.qkv_bias:
        bias += q_dim + 2 * kv_dim
    return 2 * norm + attn + mlp + bias


def standard_layers(spec: ModelSpec) -> list[LayerSpec]:
    """Layer list of a gpt2/llama-style model: embedding, blocks, final norm + LM head."""
    h, v = spec.hidden_size, spec.vocab_size
    embed = v * h + (spec.max_seq_len * h if spec.position == "learned" else 0)
    final_norm = 2 * h if spec.norm == "layernorm" else h
    head_weight = v * h
    layers = [LayerSpec("embedding", "embedding", embed)]
    layers += [LayerSpec("block", f"block.{i}", block_params(spec)) for i in range(spec.num_layers)]
    if spec.tied_embeddings:
        layers.append(LayerSpec("head", "head", final_norm, tied_params=head_weight))
    else:
        layers.append(LayerSpec("head", "head", final_norm + head_weight))
    return layers
