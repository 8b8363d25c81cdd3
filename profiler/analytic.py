"""Closed-form FLOPs and activation bytes per layer: the preset numbers when hardware is absent, and
the shape that measured samples are fitted to when the planner asks for sizes that were not measured."""

from __future__ import annotations

from planner.model_spec import ModelSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def layer_forward_flops(spec: ModelSpec, kind: str, b: int, s: int, tp: int = 1) -> float:
    """Forward FLOPs of one layer on one tensor-parallel rank.

    Block: 2 FLOPs per multiply-add over the matmul weights (24·b·s·h² for GPT, Narayanan et al. SC'21)
    plus attention scores and values, 4·b·s²·(heads·head_dim). Head: the logits matmul 2·b·s·h·V.
    Embedding: a gather; counted as 2·b·s·h so that its time is small but not zero. Backward ≈ 2×.
    """
    h, tokens = spec.hidden_size, b * s
    if kind == "block":
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        mats = h * (q_dim + 2 * kv_dim) + q_dim * h + (3 if spec.mlp == "swiglu" else 2) * h * spec.ffn_hidden_size
        return (2.0 * tokens * mats + 4.0 * b * s * s * q_dim) / tp
    if kind == "head":
        return 2.0 * tokens * h * spec.vocab_size / tp
    if kind == "embedding":
        return 2.0 * tokens * h
    raise ValueError(f"unknown layer kind {kind!r}")


def layer_activation_bytes(spec: ModelSpec, kind: str, b: int, s: int, tp: int = 1, dtype: str = "bf16",
                           recompute: str = "none", sequence_parallel: bool = False) -> float:
    """Bytes saved for backward by one layer for one micro-batch on one tensor-parallel rank.

    Block (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Eq. 2-6): s·b·h·(34 + 5·a·s/h) bytes in 16-bit with dropout; with tensor parallelism
    s·b·h·(10 + 24/t + 5·a·s/(h·t)), and with sequence parallelism everything divided by t. Selective
    recompute drops the 5·a·s/h term (attention scores); full recompute keeps only the input 2·s·b·h.
    Values scale with the dtype's width (the 34 counts 2-byte values and 1-byte dropout masks).
    Head: its input plus the logits and their fp32 softmax, s·b·h·B + s·b·(V/t)·(B + 4).
    Embedding: the token ids (int64).
    """
    B = DTYPE_BYTES[dtype]
    h, a = spec.hidden_size, spec.num_heads
    sbh = s * b * h
    if kind == "block":
        if recompute == "full":
            return sbh * B / (tp if sequence_parallel else 1)
        attn_scores = 5.0 * a * s / h / tp
        if recompute == "selective":
            attn_scores = 0.0
        linear = (34.0 / tp) if sequence_parallel else (10.0 + 24.0 / tp)
        return sbh * (linear + attn_scores) * B / 2
    if kind == "head":
        return sbh * B / (tp if sequence_parallel else 1) + s * b * (spec.vocab_size / tp) * (B + 4)
    if kind == "embedding":
        return 8.0 * s * b
    raise ValueError(f"unknown layer kind {kind!r}")
