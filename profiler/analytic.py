"""Closed-form FLOPs and activation bytes per layer: the preset numbers when hardware is absent, and
the shape that measured samples are fitted to when the planner asks for sizes that were not measured."""

from __future__ import annotations

from meshplan.planner.model_spec import ModelSpec, vocab_shard
from meshplan.profiler.moe_cost import block_ffn_activation_values, block_ffn_mats

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def layer_forward_flops(spec: ModelSpec, kind: str, b: int, s: int, tp: int = 1) -> float:
    """Forward FLOPs of one layer on one tensor-parallel rank.

    Block: 2 FLOPs per multiply-add over the matmul weights (24·b·s·h² for GPT, Narayanan et al. SC'21)
    plus attention scores and values, 4·b·s²·(heads·head_dim) (with a binding sliding window, the band's pairs
    in place of s²/2: ModelSpec.attention_pairs). Head: the logits matmul 2·b·s·h·V.
    Embedding: a gather; counted as 2·b·s·h so that its time is small but not zero. Backward ≈ 2×.
    """
    h, tokens = spec.hidden_size, b * s
    if kind == "block":
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        mats = h * (q_dim + 2 * kv_dim) + q_dim * h + block_ffn_mats(spec)  # MoE: active, mean block
        return (2.0 * tokens * mats + 4.0 * b * 2 * spec.attention_pairs(s) * q_dim) / tp
    if kind == "head":
        return 2.0 * tokens * h * spec.vocab_size / tp
    if kind == "embedding":
        return 2.0 * tokens * h
    raise ValueError(f"unknown layer kind {kind!r}")


def layer_activation_bytes(spec: ModelSpec, kind: str, b: int, s: int, tp: int = 1, dtype: str = "bf16",
                           recompute: str = "none", sequence_parallel: bool = False,
                           unfused_attention: bool = False, sharded_inputs: bool = False,
                           selective: str = "attention", fused_loss: bool = False, fp8: bool = False) -> float:
    """Bytes saved for backward by one layer for one micro-batch on one tensor-parallel rank, counted
    tensor by tensor as the executor's layers (executor/model.py) and PyTorch's CUDA kernels save them.
    tests/test_profiler_memory.py checks the count against the profiler's saved-tensor count on CPU.

    Block, per token, in values of B bytes (t = TP degree; "÷t (SP)" = divided by t with sequence
    parallelism):
    - each of the two norms keeps its input, h ÷t (SP), and fp32 statistics (LayerNorm: mean and rstd;
      RMSNorm: rstd); with a parallel residual both inputs are the block input, kept once;
    - each norm's output, the input of q/k/v and of w1 (and w3): h, also with sequence parallelism.
      PyTorch's SequenceParallel all-gathers before the column-parallel Linears and they save the
      gathered input. Megatron-LM keeps the shard and gathers again in backward (Korthikanti Eq. 5);
    - fused attention (flash / memory-efficient SDPA): q, k, v, the output (also wo's input), and an fp32
      log-sum-exp per head; (2·q_dim + 2·kv_dim)/t with grouped-query k and v. No s² tensor:
      Korthikanti's 5·a·s/h term counts the softmax and dropout of unfused attention;
    - MLP per f/t: GELU keeps w1's output and the GELU output (2f); ReLU its output only (f); SwiGLU keeps
      w1's and w3's outputs, the SiLU output and their product (4f). No dropout: the executor has none;
    - rotary: its cos and sin tables, per rotated tensor, s × rotary_dim/2 in fp32 (not per token);
    - `fp8` (Transformer Engine's FP8 Linears, profiler/roofline.FP8): the Linears keep their inputs in FP8,
      1 byte: the norm outputs (written in FP8 by LayerNormLinear) and the last MLP GEMM's input; the
      output projection keeps an FP8 copy of the attention output, which the attention core keeps too.
    Selective recompute checkpoints the attention core. Its output is still wo's input, so only the
    log-sum-exp goes: under fused attention selective saves almost nothing. Full recompute keeps the
    block input, h ÷t (SP).
    CPU's RMSNorm is not fused and keeps fp32 copies as well; a measured profile's ratio corrects for it.
    Head: the norm's input and statistics (÷t with SP), its output h (gathered), and the fp32 log-softmax
    of the loss over the rank's vocabulary shard, V/t (the executor's loss is vocabulary-parallel; V when
    t does not divide V and the head is replicated); a fused cross-entropy (`fused_loss`,
    profiler/roofline.LOSS) keeps the 16-bit logits and an fp32 log-sum-exp per token instead.
    Embedding: the token ids (int64).
    Unfused attention (Megatron-LM before flash attention; GPU presets can model it): the softmax output,
    the dropout mask (one byte) and the dropout output, each heads/t x s x s per sample: 5·a·s²·b/t bytes
    in B = 2 (Korthikanti Eq. 1, the 5as/h term), and hidden dropout masks, 2 x h bytes per token
    (÷t with SP); selective recompute drops the s x s tensors.
    `sharded_inputs`: what Megatron-LM keeps: the norms' outputs as sequence shards, h ÷t (SP), and for
    SwiGLU its fused activation's input (w1 and w3 outputs) and w2's input, 3f
    (megatron/core/fusions/fused_bias_swiglu.py saves the input only).
    `selective` (profiler/roofline.SELECTIVE): what the software's selective recompute keeps. torchtitan's
    "every-second-mm" keeps the block input, the outputs of the odd matmuls in call order (wq: q_dim, wv:
    kv_dim, w1: f, each ÷t; SwiGLU's w2: h, its partial sums before the reduction), SDPA's output and
    log-sum-exp, and with sequence parallelism the two reduce-scatters' outputs (h ÷t each);
    "every-second-block": half the blocks keep everything and half their input.
    """
    B = DTYPE_BYTES[dtype]
    h, tokens = spec.hidden_size, s * b
    sp = tp if sequence_parallel else 1
    stats = 8 if spec.norm == "layernorm" else 4
    norm_kept = (h * B + stats) / sp
    if kind == "block":
        if recompute == "full":
            return tokens * h * B / sp
        if recompute == "selective" and selective == "every-second-block":
            return 0.5 * sum(layer_activation_bytes(spec, kind, b, s, tp, dtype, r, sequence_parallel,
                                                    unfused_attention, sharded_inputs) for r in ("none", "full"))
        if recompute == "selective" and selective == "every-second-mm":
            q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            w2 = h if spec.gated_mlp else 0.0  # w2 is the 7th matmul after w1, w3 (GELU: the 6th)
            kept = h / sp + (2 * q_dim + kv_dim + spec.ffn_hidden_size) / tp + w2 + (2 * h / sp if sp > 1 else 0)
            return tokens * (kept * B + 4.0 * spec.num_heads / tp)
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        lse = 0.0 if recompute == "selective" else 4.0 * spec.num_heads / tp
        mlp = block_ffn_activation_values(spec, B)  # dense: 4f SwiGLU, 2f GELU; MoE: profiler/moe_cost.py
        if sharded_inputs and spec.gated_mlp and spec.moe is None:
            mlp -= spec.ffn_hidden_size  # Megatron-LM's fused SwiGLU keeps its input only: 3f
        norm_out = h * (1 if fp8 else B) / (sp if sharded_inputs else 1)
        norm_inputs = 1 if spec.parallel_residual else 2  # parallel residual: both norms read the block input
        per_token = (norm_inputs * h * B + 2 * stats) / sp + 2 * norm_out \
            + (2 * q_dim + 2 * kv_dim + mlp) * B / tp + lse
        if fp8:  # the output projection keeps an FP8 copy of its input; the last MLP GEMM's input is FP8
            per_token += (q_dim - (B - 1) * (spec.ffn_hidden_size if spec.moe is None else 0)) / tp
        rope = 2 * 2 * s * (spec.rotated_dims // 2) * 4 if spec.position == "rope" else 0
        if unfused_attention:
            per_token += 2 * h / sp + (0 if recompute == "selective" else (2 * B + 1) * spec.num_heads * s / tp)
        return tokens * per_token + rope
    if kind == "head":
        V = vocab_shard(spec, tp)
        loss = V * B + 4.0 if fused_loss else 4.0 * V  # fused: the 16-bit logits and a log-sum-exp
        return tokens * (norm_kept + h * B / (sp if sharded_inputs else 1) + loss)
    if kind == "embedding":  # the token ids; an embedding norm (BLOOM) keeps its input and statistics
        return 8.0 * tokens + (tokens * (h * B + stats) if spec.embedding_norm else 0.0)
    raise ValueError(f"unknown layer kind {kind!r}")
