"""Where a ModelSpec comes from: a built-in name, a Hugging Face config.json, or `module:factory`."""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any

from meshplan.planner.errors import InputError
from meshplan.planner.jsonio import read_json
from meshplan.planner.model_spec import LayerSpec, ModelSpec, MoESpec

_GPT2 = dict(arch="gpt2", norm="layernorm", mlp="gelu", position="learned", linear_bias=True,
             tied_embeddings=True, vocab_size=50257, norm_eps=1e-5)
_LLAMA = dict(arch="llama", norm="rmsnorm", mlp="swiglu", position="rope")

# Sources: GPT-2 (Radford et al. 2019, HF `gpt2*` configs), GPT-3 (Brown et al. 2020, Table 2.1),
# Llama 2 (Touvron et al. 2023, HF `meta-llama/Llama-2-*-hf` configs), Llama 3 (HF `Meta-Llama-3-*`).
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "gpt2": dict(_GPT2, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                 ffn_hidden_size=3072, max_seq_len=1024),
    "gpt2-medium": dict(_GPT2, hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=16,
                        ffn_hidden_size=4096, max_seq_len=1024),
    "gpt2-large": dict(_GPT2, hidden_size=1280, num_layers=36, num_heads=20, num_kv_heads=20,
                       ffn_hidden_size=5120, max_seq_len=1024),
    "gpt2-xl": dict(_GPT2, hidden_size=1600, num_layers=48, num_heads=25, num_kv_heads=25,
                    ffn_hidden_size=6400, max_seq_len=1024),
    "gpt3-175b": dict(_GPT2, hidden_size=12288, num_layers=96, num_heads=96, num_kv_heads=96,
                      ffn_hidden_size=49152, max_seq_len=2048),
    "llama2-7b": dict(_LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=32, ffn_hidden_size=11008, max_seq_len=4096, norm_eps=1e-5),
    "llama2-13b": dict(_LLAMA, vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40,
                       num_kv_heads=40, ffn_hidden_size=13824, max_seq_len=4096, norm_eps=1e-5),
    "llama2-70b": dict(_LLAMA, vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, ffn_hidden_size=28672, max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": dict(_LLAMA, vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(_LLAMA, vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, ffn_hidden_size=28672, max_seq_len=8192, rope_theta=500000.0),
    # meta-llama/Llama-3.1-405B config.json: 405,853,388,800 parameters (its safetensors index: 811,706,777,600
    # bytes in bf16); 126 layers, 8 key/value heads, 128K positions (pre-trained at 8K: pass --seq-len)
    "llama3.1-405b": dict(_LLAMA, vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128,
                          num_kv_heads=8, ffn_hidden_size=53248, max_seq_len=131072, rope_theta=500000.0),
    # meta-llama/Llama-3.2-1B config.json: 1,235,814,400 parameters, tied embeddings (the GPU check's model)
    "llama3.2-1b": dict(_LLAMA, vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                        num_kv_heads=8, ffn_hidden_size=8192, max_seq_len=131072, rope_theta=500000.0,
                        tied_embeddings=True),
    # Mixture of experts, from the HF config.json of mistralai/Mixtral-8x7B-v0.1 (46,702,792,704
    # parameters), mistralai/Mixtral-8x22B-Instruct-v0.1 (vocabulary 32768, 64K positions, rope 1e6; the base
    # v0.1 has 32000: mistral-inference's README calls v0.3 "the same as Mixtral-8x22B-v0.1, but has an
    # extended vocabulary of 32768 tokens"; 141B, 39B active: mistral.ai/news/mixtral-8x22b) and Qwen/Qwen3-30B-A3B
    # (30,532,122,624; q/k RMSNorm per head, 128 experts of 768, top 8, renormalised).
    "mixtral-8x7b": dict(_LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         ffn_hidden_size=14336, max_seq_len=32768, rope_theta=1e6,
                         moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=14336, aux_loss_coef=0.02)),
    "mixtral-8x22b": dict(_LLAMA, vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48, num_kv_heads=8,
                          ffn_hidden_size=16384, max_seq_len=65536, rope_theta=1e6,
                          moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=16384, aux_loss_coef=0.001)),
    "qwen3-30b-a3b": dict(_LLAMA, vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                          head_dim=128, ffn_hidden_size=6144, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                          qk_norm=True,
                          moe=MoESpec(num_experts=128, top_k=8, expert_ffn_hidden_size=768, aux_loss_coef=0.001)),
    # Test models, small enough to train on a few CPU processes.
    "tiny": dict(_LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, max_seq_len=64),
    # tiny with 8 experts of 32, top 2, its first block dense (so dense and sparse blocks both run).
    "tiny-moe": dict(_LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                     ffn_hidden_size=128, max_seq_len=64,
                     moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=32, first_dense_layers=1)),
    "gpt-20m": dict(_GPT2, vocab_size=16384, hidden_size=384, num_layers=8, num_heads=6,
                    num_kv_heads=6, ffn_hidden_size=1536, max_seq_len=256),
}


def builtin_model(name: str) -> ModelSpec:
    if name not in BUILTIN_MODELS:
        close = difflib.get_close_matches(name, BUILTIN_MODELS, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(BUILTIN_MODELS)}"
        raise InputError(f"MODEL: unknown model '{name}'{hint}")
    return ModelSpec(name=name, **BUILTIN_MODELS[name])


def _cfg_int(cfg: dict, path: str, *keys: str, default: Any = None) -> int:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InputError(f"{path}: field '{key}': expected a positive integer, got {value!r}")
            return value
    if default is None:
        raise InputError(f"{path}: missing field '{keys[0]}'")
    return default


def hf_model_name(path: str) -> str:
    """A Hugging Face snapshot keeps config.json in a folder named after the model; any other file name is
    the model's own (mixtral-8x7b.json)."""
    path = os.path.abspath(path)
    base, stem = os.path.basename(path), os.path.splitext(os.path.basename(path))[0]
    if base == "config.json":
        return os.path.basename(os.path.dirname(path)) or "hf-model"
    return stem or "hf-model"


def from_hf_config(path: str) -> ModelSpec:
    """Read a Hugging Face config.json (gpt2, llama, mistral, qwen2, qwen3, gpt_neox, opt, falcon, starcoder2, phi3,
    gemma, bloom; MoE: mixtral, qwen2_moe, qwen3_moe) as plain JSON: no download."""
    cfg = read_json(path, "MODEL")
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object")
    model_type = cfg.get("model_type")
    name = hf_model_name(path)
    if model_type == "gpt2":
        h = _cfg_int(cfg, path, "n_embd")
        return ModelSpec(
            name=name, arch="gpt2", norm="layernorm", mlp="gelu", position="learned", linear_bias=True,
            vocab_size=_cfg_int(cfg, path, "vocab_size"), hidden_size=h,
            num_layers=_cfg_int(cfg, path, "n_layer"), num_heads=_cfg_int(cfg, path, "n_head"),
            num_kv_heads=_cfg_int(cfg, path, "n_head"), ffn_hidden_size=_cfg_int(cfg, path, "n_inner", default=4 * h),
            max_seq_len=_cfg_int(cfg, path, "n_positions", "n_ctx"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        )
    if model_type in ("llama", "mistral", "qwen2"):
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise InputError(f"{path}: field 'use_sliding_window': expected false (Qwen2's window on the layers "
                             f"from max_window_layers on is not modelled), got true")
        window = _window(cfg, path) if model_type == "mistral" else 0
        return _llama_spec(cfg, path, name, max_seq_len=2048, qkv_bias=model_type == "qwen2", norm_eps=1e-5,
                           rope_theta=10000.0, sliding_window=window)
    if model_type == "qwen3":  # Qwen2's block without the q/k/v bias, with an RMSNorm over each head of q and k
        if cfg.get("use_sliding_window"):
            raise InputError(f"{path}: field 'use_sliding_window': expected false (Qwen3's window on the layers "
                             f"from max_window_layers on is not modelled), got true")
        if cfg.get("hidden_act", "silu") != "silu":
            raise InputError(f"{path}: field 'hidden_act': expected 'silu' (SwiGLU), got {cfg['hidden_act']!r}")
        return _llama_spec(cfg, path, name, max_seq_len=32768, qkv_bias=False, norm_eps=1e-6, rope_theta=10000.0,
                           qk_norm=True)
    if model_type in DENSE_READERS:
        return DENSE_READERS[model_type](cfg, path, name)
    if model_type in UNREADABLE_DENSE_TYPES:
        raise InputError(f"{path}: model_type {model_type!r} is not supported yet: "
                         f"{UNREADABLE_DENSE_TYPES[model_type]}")
    if model_type in MOE_MODEL_TYPES:
        return _moe_from_hf(cfg, path, name, model_type)
    if model_type in UNREADABLE_MOE_TYPES:
        raise InputError(f"{path}: model_type {model_type!r} is not supported yet: "
                         f"{UNREADABLE_MOE_TYPES[model_type]}")
    known = ["gpt2", "llama", "mistral", "qwen2", "qwen3", *DENSE_READERS, *MOE_MODEL_TYPES]
    raise InputError(f"{path}: field 'model_type': expected one of {', '.join(known)}, got {model_type!r}")


# Field names and defaults below are transformers' (configuration_<type>.py, v4.57 and v5); where v5 moved
# rope settings into `rope_parameters`, both spellings are read.
def _rope(cfg: dict, theta_keys: tuple[str, ...], factor_keys: tuple[str, ...], factor: float) -> tuple[float, float]:
    """(rope theta, share of each head rotated), from the flat v4 fields or v5's rope_parameters."""
    nested = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = next((cfg[k] for k in theta_keys if cfg.get(k) is not None), nested.get("rope_theta", 10000.0))
    share = next((cfg[k] for k in factor_keys if cfg.get(k) is not None), nested.get("partial_rotary_factor", factor))
    return float(theta), float(share)


def _window(cfg: dict, path: str) -> int:
    """ModelSpec.sliding_window from the config's `sliding_window` (null or absent: none)."""
    return _cfg_int(cfg, path, "sliding_window", default=0) if cfg.get("sliding_window") is not None else 0


def _rotary_dim(path: str, head_dim: int, share: float) -> int:
    """ModelSpec.rotary_dim: 0 for the whole head."""
    dim = int(head_dim * share)  # transformers: int(head_size * rotary_pct)
    if dim <= 0 or dim % 2:
        raise InputError(f"{path}: the rotary share {share} of head_dim {head_dim} gives {dim} dimensions; "
                         f"expected a positive even number")
    return 0 if dim == head_dim else dim


def _sizes(cfg: dict, path: str, name: str, h: int, heads: int, layers: tuple[str, ...] = ("num_hidden_layers",)
           ) -> dict[str, Any]:
    """The ModelSpec fields every reader takes the same way, with the LayerNorm/biases block of GPT-2's line
    (the readers below change what differs); `layers`: the config keys of the layer count, first found."""
    return dict(name=name, arch="gpt2", norm="layernorm", mlp="gelu", position="rope", vocab_size=_cfg_int(
        cfg, path, "vocab_size"), hidden_size=h, num_layers=_cfg_int(cfg, path, *layers), num_heads=heads)


def _expect(cfg: dict, path: str, key: str, want: Any, default: Any, why: str) -> None:
    if cfg.get(key, default) != want:
        raise InputError(f"{path}: field '{key}': expected {want!r} ({why}), got {cfg.get(key, default)!r}")


def _gpt_neox(cfg: dict, path: str, name: str) -> ModelSpec:
    """GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorm, GELU MLP of intermediate_size, biases, untied head, a
    parallel residual by default (use_parallel_residual), rotary over rotary_pct (0.25) of each head."""
    h, heads = _cfg_int(cfg, path, "hidden_size"), _cfg_int(cfg, path, "num_attention_heads")
    theta, share = _rope(cfg, ("rotary_emb_base", "rope_theta"), ("rotary_pct", "partial_rotary_factor"), 0.25)
    bias = bool(cfg.get("attention_bias", True))
    return ModelSpec(
        **_sizes(cfg, path, name, h, heads), linear_bias=bias, num_kv_heads=heads,
        ffn_hidden_size=_cfg_int(cfg, path, "intermediate_size"),
        max_seq_len=_cfg_int(cfg, path, "max_position_embeddings", default=2048),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        rope_theta=theta, rotary_dim=_rotary_dim(path, h // heads, share),
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
    )


def _opt(cfg: dict, path: str, name: str) -> ModelSpec:
    """OPT: pre-norm LayerNorm blocks, ReLU MLP of ffn_dim, biases, learned positions, tied head. Its position
    table has 2 spare rows (offset 2), 2·h parameters not counted here."""
    _expect(cfg, path, "do_layer_norm_before", True, True, "post-norm OPT-350m is not modelled")
    h = _cfg_int(cfg, path, "hidden_size")
    if cfg.get("word_embed_proj_dim") not in (None, h):
        raise InputError(f"{path}: field 'word_embed_proj_dim': expected hidden_size {h} (the projections of "
                         f"OPT-350m are not modelled), got {cfg['word_embed_proj_dim']!r}")
    _expect(cfg, path, "activation_function", "relu", "relu", "a ReLU MLP")
    heads = _cfg_int(cfg, path, "num_attention_heads")
    return ModelSpec(
        **{**_sizes(cfg, path, name, h, heads), "mlp": "relu", "position": "learned"},
        linear_bias=bool(cfg.get("enable_bias", True)), num_kv_heads=heads,
        ffn_hidden_size=_cfg_int(cfg, path, "ffn_dim"),
        max_seq_len=_cfg_int(cfg, path, "max_position_embeddings", default=2048),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _falcon(cfg: dict, path: str, name: str) -> ModelSpec:
    """Falcon with new_decoder_architecture (40B, 180B): attention and MLP in parallel, each behind its own
    LayerNorm (ln_attn, ln_mlp), num_kv_heads grouped k/v heads, rotary, GELU MLP of ffn_hidden_size (4h),
    no biases by default, tied head."""
    _expect(cfg, path, "alibi", False, False, "ALiBi is not modelled")
    new = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    norms = cfg.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if parallel and norms != 2:
        raise InputError(f"{path}: field 'new_decoder_architecture': a parallel block with one LayerNorm shared by "
                         f"attention and MLP (Falcon-7B) is not modelled; expected true")
    h, heads = _cfg_int(cfg, path, "hidden_size", "n_embed"), _cfg_int(cfg, path, "num_attention_heads")
    kv = _cfg_int(cfg, path, "num_kv_heads", default=heads) if new or not cfg.get("multi_query", True) else 1
    theta, _ = _rope(cfg, ("rope_theta",), (), 1.0)
    return ModelSpec(
        **_sizes(cfg, path, name, h, heads), linear_bias=bool(cfg.get("bias", False)), num_kv_heads=kv,
        ffn_hidden_size=_cfg_int(cfg, path, "ffn_hidden_size", default=4 * h),
        max_seq_len=_cfg_int(cfg, path, "max_position_embeddings", default=2048),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), rope_theta=theta, parallel_residual=parallel,
    )


def _starcoder2(cfg: dict, path: str, name: str) -> ModelSpec:
    """StarCoder2: LayerNorm, GELU (tanh) MLP of intermediate_size, grouped k/v heads, rotary, biases
    (use_bias), tied head, the config's sliding window if any."""
    h, heads = _cfg_int(cfg, path, "hidden_size"), _cfg_int(cfg, path, "num_attention_heads")
    theta, _ = _rope(cfg, ("rope_theta",), (), 1.0)
    return ModelSpec(
        **_sizes(cfg, path, name, h, heads), linear_bias=bool(cfg.get("use_bias", True)),
        num_kv_heads=_cfg_int(cfg, path, "num_key_value_heads", default=2),
        head_dim=_cfg_int(cfg, path, "head_dim", default=h // heads),
        ffn_hidden_size=_cfg_int(cfg, path, "intermediate_size"),
        max_seq_len=_cfg_int(cfg, path, "max_position_embeddings", default=4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), norm_eps=float(cfg.get("norm_epsilon", 1e-5)),
        rope_theta=theta, sliding_window=_window(cfg, path),
    )


def _phi3(cfg: dict, path: str, name: str) -> ModelSpec:
    """Phi-3: the llama block with fused q/k/v and gate/up projections (the same weights), rotary over
    partial_rotary_factor (1.0) of each head, the config's sliding window (Phi-3-mini-4k: 2047) if any."""
    h, heads = _cfg_int(cfg, path, "hidden_size"), _cfg_int(cfg, path, "num_attention_heads")
    theta, share = _rope(cfg, ("rope_theta",), ("partial_rotary_factor",), 1.0)
    head_dim = _cfg_int(cfg, path, "head_dim", default=h // heads)
    return _llama_spec(cfg, path, name, max_seq_len=4096, qkv_bias=False, norm_eps=1e-5, rope_theta=theta,
                       rotary_dim=_rotary_dim(path, head_dim, share), sliding_window=_window(cfg, path))


def _gemma(cfg: dict, path: str, name: str) -> ModelSpec:
    """Gemma (1): the llama block with a GeGLU MLP (tanh-approximate GELU gate, hidden_activation), head_dim
    256 beside the hidden size, the embedding scaled by sqrt(hidden_size), tied head. Its RMSNorm multiplies
    by (1 + w) with w from 0: with no weight decay on norms (the executor's AdamW), the same as w from 1."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise InputError(f"{path}: field 'hidden_activation': expected 'gelu_pytorch_tanh' (GeGLU), got {act!r}")
    theta, _ = _rope(cfg, ("rope_theta",), (), 1.0)
    return _llama_spec(dict(cfg, tie_word_embeddings=cfg.get("tie_word_embeddings", True)), path, name,
                       max_seq_len=8192, qkv_bias=False, norm_eps=1e-6, rope_theta=theta, mlp="geglu",
                       embedding_scale=True)


def _bloom(cfg: dict, path: str, name: str) -> ModelSpec:
    """BLOOM: LayerNorm blocks (pre-norm: apply_residual_connection_post_layernorm false), a LayerNorm right after
    the embedding, ALiBi attention, GELU (tanh) MLP of 4h, biases, tied head. ALiBi has no position limit:
    max_seq_len is the config's seq_length (2048 if absent), which nothing enforces."""
    _expect(cfg, path, "apply_residual_connection_post_layernorm", False, False, "post-norm residuals not modelled")
    h = _cfg_int(cfg, path, "hidden_size", "n_embed")
    heads = _cfg_int(cfg, path, "num_attention_heads", "n_head")
    return ModelSpec(
        **(_sizes(cfg, path, name, h, heads, ("num_hidden_layers", "n_layer")) | dict(position="alibi")),
        linear_bias=True, embedding_norm=True, num_kv_heads=heads,
        ffn_hidden_size=4 * h, max_seq_len=_cfg_int(cfg, path, "seq_length", default=2048),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
    )


DENSE_READERS = {"gpt_neox": _gpt_neox, "opt": _opt, "falcon": _falcon, "starcoder2": _starcoder2, "phi3": _phi3,
                 "gemma": _gemma, "bloom": _bloom}
# Dense configs with parts this ModelSpec cannot describe, refused by name.
UNREADABLE_DENSE_TYPES = {
    "gemma2": "logit soft-capping, alternating sliding windows and post-norms are not modelled",
    "gemma3": "alternating sliding windows and post-norms are not modelled",
    "olmo2": "post-norm blocks and q/k norms over the whole projection are not modelled",
}


MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# MoE configs with parts this ModelSpec cannot describe: refused by name rather than read as a wrong model.
UNREADABLE_MOE_TYPES = {
    "deepseek_v2": "multi-head latent attention (MLA) and grouped routing are not modelled",
    "deepseek_v3": "multi-head latent attention (MLA), grouped routing and multi-token prediction are not modelled",
    "dbrx": "its fused attention and clipped QKV are not modelled",
    "jamba": "its Mamba layers are not modelled",
    "granitemoe": "its scaled embeddings and residuals are not modelled",
    "olmoe": "its per-layer q/k norm over the whole projection is not modelled",
    "phimoe": "its sparse-mixer routing is not modelled",
    "gpt_oss": "its alternating sliding-window layers, attention sinks and clamped SwiGLU experts with biases are "
               "not modelled",
}


def _moe_from_hf(cfg: dict, path: str, name: str, model_type: str) -> ModelSpec:
    """Mixtral (num_local_experts, every block sparse), Qwen2-MoE (a shared expert behind a sigmoid gate,
    decoder_sparse_step, no top-k renormalisation by default, q/k/v bias), Qwen3-MoE (q/k RMSNorm per head).
    Field names and defaults as in transformers' configuration_{mixtral,qwen2_moe,qwen3_moe}.py."""
    qwen = model_type != "mixtral"
    if cfg.get("hidden_act", "silu") != "silu":
        raise InputError(f"{path}: field 'hidden_act': expected 'silu' (SwiGLU experts), got {cfg['hidden_act']!r}")
    experts = _cfg_int(cfg, path, "num_experts" if qwen else "num_local_experts")
    first_dense, step = 0, 1
    if qwen:
        step = _cfg_int(cfg, path, "decoder_sparse_step", default=1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or sorted(only) != list(range(len(only))):
            raise InputError(f"{path}: field 'mlp_only_layers': expected the first k layers (0..k-1), got {only!r}")
        first_dense = len(only)
    shared_ffn = _cfg_int(cfg, path, "shared_expert_intermediate_size", default=0) \
        if model_type == "qwen2_moe" else 0
    moe = MoESpec(
        num_experts=experts, top_k=_cfg_int(cfg, path, "num_experts_per_tok"),
        expert_ffn_hidden_size=_cfg_int(cfg, path, "moe_intermediate_size" if qwen else "intermediate_size"),
        num_shared_experts=1 if shared_ffn else 0, shared_expert_ffn_hidden_size=shared_ffn,
        shared_expert_gate=bool(shared_ffn), first_dense_layers=first_dense, sparse_step=step,
        router="softmax", norm_topk_prob=bool(cfg.get("norm_topk_prob", not qwen)),
        aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001 if qwen else 0.02)),
    )
    if qwen and cfg.get("use_sliding_window"):
        raise InputError(f"{path}: field 'use_sliding_window': expected false (Qwen's per-layer window is not "
                         f"modelled), got true")
    return _llama_spec(cfg, path, name, max_seq_len=4096, qkv_bias=model_type == "qwen2_moe",
                       norm_eps=1e-6 if qwen else 1e-5, rope_theta=1e6 if model_type == "mixtral" else 10000.0,
                       qk_norm=model_type == "qwen3_moe", moe=moe, sliding_window=0 if qwen else _window(cfg, path))


def _llama_spec(cfg: dict, path: str, name: str, *, max_seq_len: int, qkv_bias: bool, norm_eps: float,
                rope_theta: float, **extra) -> ModelSpec:
    """A llama-architecture ModelSpec from an HF config's common fields; the keyword arguments are the
    model type's defaults for fields the config may leave out (and, in `extra`, what only it has)."""
    heads = _cfg_int(cfg, path, "num_attention_heads")
    h = _cfg_int(cfg, path, "hidden_size")
    return ModelSpec(
        name=name, arch="llama", vocab_size=_cfg_int(cfg, path, "vocab_size"), hidden_size=h,
        num_layers=_cfg_int(cfg, path, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_cfg_int(cfg, path, "num_key_value_heads", default=heads),
        head_dim=_cfg_int(cfg, path, "head_dim", default=h // heads),
        ffn_hidden_size=_cfg_int(cfg, path, "intermediate_size"),
        max_seq_len=_cfg_int(cfg, path, "max_position_embeddings", default=max_seq_len),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
        norm_eps=float(cfg.get("rms_norm_eps", norm_eps)),
        rope_theta=float(cfg.get("rope_theta", rope_theta)),
        **extra,
    )


def load_factory(ref: str):
    """Import `package.module:factory` and return the callable."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise InputError(f"MODEL: expected 'package.module:factory', got '{ref}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"MODEL: cannot import module '{module_name}': {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError(f"MODEL: '{module_name}' has no callable '{attr}'")
    return factory


def _find_blocks(module) -> tuple[str, list]:
    """The longest list of same-class child modules holding parameters: the repeated blocks."""
    from torch import nn

    best: tuple[int, str, list] = (0, "", [])
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        items = list(child)
        if len({type(m) for m in items}) != 1 or not any(True for _ in items[0].parameters()):
            continue
        size = sum(p.numel() for m in items for p in m.parameters())
        if size > best[0]:
            best = (size, name, items)
    if not best[2]:
        raise InputError(
            "MODEL: found no list of repeated blocks (an nn.ModuleList or nn.Sequential of two or more "
            "modules of one class) in the factory's module"
        )
    return best[1], best[2]


def _first_attr(modules, names: tuple[str, ...]) -> int | None:
    for m in modules:
        for n in names:
            value = getattr(m, n, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def from_factory(ref: str) -> ModelSpec:
    """Inspect the nn.Module a factory returns (built on the meta device: no memory is used)."""
    import torch
    from torch import nn

    factory = load_factory(ref)
    try:
        with torch.device("meta"):
            module = factory()
    except Exception as exc:  # the user's code: report, do not trace back
        raise InputError(f"MODEL: factory '{ref}' failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        raise InputError(f"MODEL: factory '{ref}' returned {type(module).__name__}, expected an nn.Module")
    block_path, blocks = _find_blocks(module)
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    before, after, seen_block = 0, 0, False
    for _, p in module.named_parameters():
        if id(p) in block_ids:
            seen_block = True
        elif seen_block:
            after += p.numel()
        else:
            before += p.numel()
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    tied = 0
    emb_weights = {id(e.weight) for e in embeddings}
    for m in module.modules():
        if isinstance(m, nn.Linear) and id(m.weight) in emb_weights:
            tied = m.weight.numel()
    hidden = embeddings[0].embedding_dim if embeddings else _first_attr(blocks, ("hidden_size", "n_embd", "dim"))
    if hidden is None:
        linears = [m for m in blocks[0].modules() if isinstance(m, nn.Linear)]
        hidden = linears[0].in_features if linears else 1
    block_modules = list(blocks[0].modules())
    heads = _first_attr(block_modules, ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead")) or 1
    kv_heads = _first_attr(block_modules, ("num_kv_heads", "n_kv_heads", "num_key_value_heads")) or heads
    max_seq = _first_attr([module], ("max_seq_len", "block_size", "n_positions", "max_position_embeddings"))
    ffn = max((m.out_features for m in blocks[0].modules() if isinstance(m, nn.Linear)), default=4 * hidden)
    layers = [LayerSpec("embedding", "embedding", before)]
    layers += [LayerSpec("block", f"{block_path}.{i}", sum(p.numel() for p in b.parameters()))
               for i, b in enumerate(blocks)]
    layers.append(LayerSpec("head", "head", after, tied_params=tied))
    return ModelSpec(
        name=ref, arch="custom", factory=ref,
        vocab_size=embeddings[0].num_embeddings if embeddings else 1, hidden_size=hidden,
        num_layers=len(blocks), num_heads=heads, num_kv_heads=kv_heads, ffn_hidden_size=ffn,
        max_seq_len=max_seq or 2048,
        head_dim=max(hidden // heads, 1), tied_embeddings=tied > 0, layers=tuple(layers),
    )


def resolve_model(text: str) -> ModelSpec:
    """MODEL as given on the command line (DESIGN.md §2)."""
    if not text:
        raise InputError("MODEL: expected a built-in name, a config.json path or package.module:factory")
    if text.endswith(".json") or os.path.sep in text or os.path.isfile(text):
        if not os.path.exists(text):
            raise InputError(f"MODEL: no such file '{text}'")
        return from_hf_config(text)
    if ":" in text:
        return from_factory(text)
    return builtin_model(text)
