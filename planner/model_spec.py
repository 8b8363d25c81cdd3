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
# The MLP: "gelu" and "relu" are two matmuls around the activation; "swiglu" and "geglu" (Gemma) are gated,
# act(w1 x) * w3 x, three matmuls.
MLPS = ("gelu", "relu", "swiglu", "geglu")
GATED_MLPS = ("swiglu", "geglu")
# Positions: a learned table added to the embedding (GPT-2), rotary (llama), or ALiBi's per-head linear bias on
# the attention scores (BLOOM; Press et al. 2022), no parameters.
POSITIONS = ("learned", "rope", "alibi")


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


ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a model (Mixtral, Qwen2-MoE, Qwen3-MoE).

    Sparse blocks replace the dense MLP by `num_experts` experts of `expert_ffn_hidden_size` (same MLP
    kind as the model's) behind a linear router without bias; each token goes to `top_k` of them.
    `router`: the score function over the router's logits ("softmax" over all experts, as Mixtral and
    Qwen, or "sigmoid" per expert); `norm_topk_prob`: the k chosen scores renormalised to sum to 1.
    Optional always-on shared experts (Qwen2-MoE: one MLP of `shared_expert_ffn_hidden_size` in all,
    scaled by sigmoid(a Linear(h, 1)) when `shared_expert_gate`). Block i (0-based) is sparse when
    i >= first_dense_layers and (i + 1) % sparse_step == 0 (HF `decoder_sparse_step`).
    `capacity_factor` None: dropless (every routed token is computed). `aux_loss_coef`: weight of the
    load-balancing loss (Switch Transformer, Fedus et al. 2022, eq. 4: E · sum_i f_i P_i; their
    alpha = 1e-2 is the default, HF configs give their own `router_aux_loss_coef`)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: int = 0  # all shared experts together
    shared_expert_gate: bool = False
    first_dense_layers: int = 0
    sparse_step: int = 1
    router: str = "softmax"
    norm_topk_prob: bool = True
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise InputError(f"model.moe.top_k: expected 1..num_experts = {self.num_experts}, got {self.top_k}")
        if self.router not in ROUTERS:
            raise InputError(f"model.moe.router: expected one of {', '.join(ROUTERS)}, got {self.router!r}")

    def is_sparse(self, block: int) -> bool:
        """Whether block `block` (0-based) is a MoE block."""
        return block >= self.first_dense_layers and (block + 1) % self.sparse_step == 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, path: str = "model.moe") -> MoESpec:
        f = Fields(data, path)
        capacity = data.get("capacity_factor")
        return cls(
            num_experts=f.int("num_experts", min=1), top_k=f.int("top_k", min=1),
            expert_ffn_hidden_size=f.int("expert_ffn_hidden_size", min=1),
            num_shared_experts=f.int("num_shared_experts", min=0, default=0),
            shared_expert_ffn_hidden_size=f.int("shared_expert_ffn_hidden_size", min=0, default=0),
            shared_expert_gate=f.bool("shared_expert_gate", default=False),
            first_dense_layers=f.int("first_dense_layers", min=0, default=0),
            sparse_step=f.int("sparse_step", min=1, default=1),
            router=f.str("router", choices=ROUTERS, default="softmax"),
            norm_topk_prob=f.bool("norm_topk_prob", default=True),
            capacity_factor=None if capacity is None else f.float("capacity_factor", min=0.0),
            aux_loss_coef=f.float("aux_loss_coef", min=0.0, default=0.01),
        )


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer plus its layer list.

    arch "gpt2": LayerNorm, GELU MLP, learned positions, biases everywhere.
    arch "llama": RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases
    (qwen2 adds a q/k/v bias). arch "custom": a user `module:factory`; dimensions are best-effort.
    The other fields vary the parts: `mlp` "relu" (OPT) or "geglu" (Gemma), `parallel_residual` (GPT-NeoX,
    Falcon: attention and MLP both read the block input, each through its own norm, and add to it),
    `rotary_dim` (GPT-NeoX rotates the first 25 % of each head's dimensions; 0: all of them),
    `embedding_scale` (Gemma multiplies the embedding by sqrt(hidden_size)), `sliding_window` (Mistral v0.1,
    StarCoder2, Phi-3: every layer attends to a window of the last w tokens), `position` "alibi" and
    `embedding_norm` (BLOOM).
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
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    moe: MoESpec | None = None  # None: dense
    parallel_residual: bool = False
    rotary_dim: int = 0  # 0: the whole head (`rotated_dims`)
    embedding_scale: bool = False  # the embedding output times sqrt(hidden_size) (Gemma)
    sliding_window: int = 0  # each token attends to the last `sliding_window` tokens, itself included; 0: all
    embedding_norm: bool = False  # a norm right after the embedding (BLOOM's word_embeddings_layernorm)

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.rotary_dim and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise InputError(f"model.rotary_dim: expected an even number of dimensions up to head_dim = "
                             f"{self.head_dim}, got {self.rotary_dim}")
        if not self.layers:
            object.__setattr__(self, "layers", tuple(standard_layers(self)))

    @property
    def gated_mlp(self) -> bool:
        """A gated MLP (SwiGLU, GeGLU): three matmuls, act(w1 x) * w3 x."""
        return self.mlp in GATED_MLPS

    def windowed(self, s: int) -> bool:
        """Whether a sequence of s tokens is longer than the sliding window (so the window binds)."""
        return 0 < self.sliding_window < s

    def cp_obstacle(self, s: int) -> str:
        """Why context parallelism cannot split this model's attention over s tokens ("" when it can): the CP
        attention wrappers (executor/context_parallel.py) attend causally over whole chunks, with no window
        and no bias."""
        if self.position == "alibi":
            return "runs ALiBi attention"
        if self.windowed(s):
            return f"attends over a sliding window of {self.sliding_window} tokens"
        return ""

    def attention_pairs(self, s: int) -> float:
        """Query-key pairs one head's causal attention over s tokens computes, counted as flash-attention's
        benchmark counts causal work (s²/2); with a binding sliding window w, the band: s·w − w²/2."""
        if not self.windowed(s):
            return s * s / 2
        w = self.sliding_window
        return s * w - w * w / 2

    @property
    def rotated_dims(self) -> int:
        """Dimensions of each head that rotary positions rotate."""
        return self.rotary_dim or self.head_dim

    @property
    def num_parameters(self) -> int:
        """Unique parameters (a tied head weight counts once)."""
        return sum(layer.params for layer in self.layers)

    @property
    def active_parameters(self) -> int:
        """Parameters one token goes through: the total less the experts it is not routed to
        (top_k of num_experts in each sparse block). Equals num_parameters for a dense model."""
        if self.moe is None:
            return self.num_parameters
        unused = self.moe.num_experts - self.moe.top_k
        return self.num_parameters - unused * expert_params(self) * len(sparse_blocks(self))

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def block_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "block"]

    def with_name(self, name: str) -> ModelSpec:
        return replace(self, name=name)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = [layer.to_dict() for layer in self.layers]
        data["num_parameters"] = self.num_parameters
        data["active_parameters"] = self.active_parameters
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
            mlp=f.str("mlp", choices=MLPS, default="swiglu"),
            position=f.str("position", choices=POSITIONS, default="rope"),
            linear_bias=f.bool("linear_bias", default=False),
            qkv_bias=f.bool("qkv_bias", default=False),
            norm_eps=f.float("norm_eps", min=0.0, default=1e-5),
            rope_theta=f.float("rope_theta", min=0.0, default=10000.0),
            factory=f.str("factory", default=None),
            layers=layers,
            qk_norm=f.bool("qk_norm", default=False),
            moe=None if data.get("moe") is None else MoESpec.from_dict(f.obj("moe").data, f"{path}.moe"),
            parallel_residual=f.bool("parallel_residual", default=False),
            rotary_dim=f.int("rotary_dim", min=0, default=0),
            embedding_scale=f.bool("embedding_scale", default=False),
            sliding_window=f.int("sliding_window", min=0, default=0),
            embedding_norm=f.bool("embedding_norm", default=False),
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
    block_sizes = [layer.params for layer in spec.layers if layer.kind == "block"][:blocks]
    block_sizes += [block_sizes[-1] if block_sizes else 0] * (blocks - len(block_sizes))
    return block_sizes + [by_kind["embedding"] + by_kind["head"]]


def splits_vocab(spec: ModelSpec, tp: int) -> bool:
    """Whether tensor parallelism of degree `tp` shards the embedding and LM head over the vocabulary:
    when it divides V evenly, else both stay replicated (executor.parallelize.apply_tp)."""
    return spec.vocab_size % tp == 0


def vocab_shard(spec: ModelSpec, tp: int) -> int:
    """Vocabulary entries of the embedding and LM head on one TP rank (`splits_vocab`)."""
    return spec.vocab_size // tp if splits_vocab(spec, tp) else spec.vocab_size


def mlp_params(spec: ModelSpec, ffn: int) -> int:
    """Weights of one MLP (or one expert) of hidden size `ffn`, biases included for gpt2."""
    h = spec.hidden_size
    swiglu = spec.gated_mlp
    weights = (3 if swiglu else 2) * h * ffn
    return weights + ((2 * ffn if swiglu else ffn) + h if spec.linear_bias else 0)


def expert_params(spec: ModelSpec) -> int:
    """Parameters of one routed expert."""
    assert spec.moe is not None
    return mlp_params(spec, spec.moe.expert_ffn_hidden_size)


def sparse_blocks(spec: ModelSpec) -> list[int]:
    """0-based indices of the MoE blocks (none for a dense model)."""
    if spec.moe is None:
        return []
    return [i for i in range(spec.num_layers) if spec.moe.is_sparse(i)]


def is_sparse_block(spec: ModelSpec, block: int) -> bool:
    return spec.moe is not None and spec.moe.is_sparse(block)


def moe_ffn_params(spec: ModelSpec) -> dict[str, int]:
    """The feed-forward of a MoE block by part: router, routed experts (all), shared experts and gate."""
    moe = spec.moe
    assert moe is not None
    h = spec.hidden_size
    shared = mlp_params(spec, moe.shared_expert_ffn_hidden_size) if moe.num_shared_experts else 0
    return {"router": h * moe.num_experts, "experts": moe.num_experts * expert_params(spec),
            "shared_experts": shared, "shared_gate": h if moe.shared_expert_gate else 0}


def block_params(spec: ModelSpec, block: int = 0) -> int:
    """Parameters of transformer block `block` (0-based; MoE models mix dense and sparse blocks)."""
    h, ffn = spec.hidden_size, spec.ffn_hidden_size
    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    norm = 2 * h if spec.norm == "layernorm" else h
    attn = h * (q_dim + 2 * kv_dim) + q_dim * h
    if is_sparse_block(spec, block):
        mlp = sum(moe_ffn_params(spec).values())
    else:
        mlp = mlp_params(spec, ffn)
    bias = 0
    if spec.linear_bias:
        bias += q_dim + 2 * kv_dim + h
    elif spec.qkv_bias:
        bias += q_dim + 2 * kv_dim
    qk_norm = 2 * spec.head_dim if spec.qk_norm else 0
    return 2 * norm + attn + mlp + bias + qk_norm


def standard_layers(spec: ModelSpec) -> list[LayerSpec]:
    """Layer list of a gpt2/llama-style model: embedding, blocks, final norm + LM head."""
    h, v = spec.hidden_size, spec.vocab_size
    embed = v * h + (spec.max_seq_len * h if spec.position == "learned" else 0)
    embed += (2 * h if spec.norm == "layernorm" else h) if spec.embedding_norm else 0
    final_norm = 2 * h if spec.norm == "layernorm" else h
    head_weight = v * h
    layers = [LayerSpec("embedding", "embedding", embed)]
    layers += [LayerSpec("block", f"block.{i}", block_params(spec, i)) for i in range(spec.num_layers)]
    if spec.tied_embeddings:
        layers.append(LayerSpec("head", "head", final_norm, tied_params=head_weight))
    else:
        layers.append(LayerSpec("head", "head", final_norm + head_weight))
    return layers
