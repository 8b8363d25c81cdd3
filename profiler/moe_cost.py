"""FLOPs, activation values and GEMM time of a mixture-of-experts feed-forward (ModelSpec.moe), shared by
the closed forms (profiler/analytic.py), the GPU per-operation model (profiler/roofline.py) and the
planner's EP terms (planner/cost_ep.py).

The profile answers per layer kind, and every block is kind "block": for a model that mixes dense and
sparse blocks (first_dense_layers, sparse_step) the block's feed-forward is the mean over its blocks,
weighted by the sparse fraction. Only active work counts (MFU is active FLOPs): a token goes through the
router (h x E), its top_k experts and the shared experts. As for the dense MLP, the closed forms divide the
feed-forward by tp: the experts sharded over tensor parallelism (expert_tp = tp), or Megatron-Core's and
torchtitan's folding for expert_tp = 1 (each TP rank routes its own sequence shard). planner/cost_ep.py
corrects the executor's expert_tp = 1, which runs the MoE replicated over the TP ranks.
"""

from __future__ import annotations

from meshplan.planner.model_spec import ModelSpec, sparse_blocks


def sparse_fraction(spec: ModelSpec) -> float:
    """Share of the blocks that are MoE blocks (0 for a dense model)."""
    if spec.moe is None or not spec.num_layers:
        return 0.0
    return len(sparse_blocks(spec)) / spec.num_layers


def _mlp_mats(spec: ModelSpec, ffn: int) -> float:
    return (3 if spec.gated_mlp else 2) * spec.hidden_size * ffn


def routed_mats(spec: ModelSpec) -> float:
    """Weights one token multiplies in its top_k routed experts."""
    moe = spec.moe
    assert moe is not None
    return moe.top_k * _mlp_mats(spec, moe.expert_ffn_hidden_size)


def moe_ffn_mats(spec: ModelSpec) -> float:
    """Weights one token multiplies in a MoE block's feed-forward: router, top_k experts, shared experts
    and their gate."""
    moe = spec.moe
    assert moe is not None
    h = spec.hidden_size
    shared = _mlp_mats(spec, moe.shared_expert_ffn_hidden_size) if moe.num_shared_experts else 0
    return h * moe.num_experts + routed_mats(spec) + shared + (h if moe.shared_expert_gate else 0)


def block_ffn_mats(spec: ModelSpec) -> float:
    """Feed-forward weights per token of the mean block (dense MLP for a dense model)."""
    dense = _mlp_mats(spec, spec.ffn_hidden_size)
    phi = sparse_fraction(spec)
    return dense if phi == 0 else (1 - phi) * dense + phi * moe_ffn_mats(spec)


def block_ffn_activation_values(spec: ModelSpec, dtype_bytes: int) -> float:
    """Values (of dtype_bytes each) the mean block's feed-forward keeps for backward per token, before ÷tp.
    Dense: GELU 2f (its input and output), ReLU f (its output, which w2 keeps too: torch's relu backward
    reads its result), SwiGLU 4f (analytic.layer_activation_bytes). MoE (executor/moe.py): per routed copy the
    gathered input row and the expert's output (2h) and the expert MLP's intermediates; the router's fp32
    logits and scores (2·E·4 bytes); the shared experts' intermediates and, with a gate, its input."""
    per_f = 4 if spec.gated_mlp else 1 if spec.mlp == "relu" else 2
    dense = per_f * spec.ffn_hidden_size
    phi = sparse_fraction(spec)
    if phi == 0:
        return dense
    moe = spec.moe
    assert moe is not None
    sparse = moe.top_k * (2 * spec.hidden_size + per_f * moe.expert_ffn_hidden_size)
    sparse += 2 * moe.num_experts * 4 / dtype_bytes
    if moe.num_shared_experts:
        sparse += per_f * moe.shared_expert_ffn_hidden_size + (1 if moe.shared_expert_gate else 0)
    return (1 - phi) * dense + phi * sparse


def moe_ffn_time(roofline, spec: ModelSpec, tokens: float, tp: int, ep: int = 1, expert_shard: int | None = None,
                 imbalance: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE feed-forward on one rank by GEMM shape (roofline.gemm):
    the router [T, E] x [E, h]; the rank's E/ep experts as one grouped GEMM (Megatron-Core's
    --moe-grouped-gemm: all local experts in one kernel, modelled as a batch of E/ep GEMMs of M rows each,
    so its tile and wave quantisation is the grouped GEMM's efficiency); M = imbalance · T·top_k·ep/E
    rows per local expert (T·top_k routed rows per rank on average, the busiest rank `imbalance` times
    that); the expert width ÷ `expert_shard` (expert_tp); the shared experts as dense GEMMs ÷tp. The
    permutation before and after the experts (gather and scatter-add of T·top_k rows; with EP and several
    local experts the received rows are regrouped by local expert and back as well) and the experts'
    activation (on every routed row, and the shared experts') are bytes over HBM, backward twice forward's as
    for a dense block's memory-bound ops (roofline.elementwise).
    Under an FP8 recipe (profiler/roofline.FP8) the experts' and shared experts' GEMMs run at the FP8 rates
    (Transformer Engine's grouped Linear), with their casts as a dense block's (`roofline.fp8_casts`): forward
    the last GEMM's input, backward every GEMM's output gradient; the router stays 16-bit.
    `tokens` = T, the rank's b·s (÷tp where the feed-forward's tokens are sharded)."""
    moe = spec.moe
    assert moe is not None
    h, k, e = spec.hidden_size, moe.top_k, moe.num_experts
    shard = tp if expert_shard is None else expert_shard
    local = max(1, e // ep)
    rows = imbalance * tokens * k * ep / e
    f_e = moe.expert_ffn_hidden_size / shard
    fwd, bwd = roofline.gemm_fwd_bwd(tokens, e, h)
    lin = roofline.linear
    n_up = 2 if spec.gated_mlp else 1
    for m, n, kk in [(rows, f_e, h)] * n_up + [(rows, h, f_e)]:
        fwd += lin.gemm(m, n, kk, local)
        bwd += lin.gemm(m, kk, n, local) + lin.gemm(kk, n, m, local)
    f_s = moe.shared_expert_ffn_hidden_size / tp if moe.num_shared_experts else 0.0
    if f_s:
        for m, n, kk in [(tokens, f_s, h)] * n_up + [(tokens, h, f_s)]:
            a, g = lin.gemm_fwd_bwd(m, n, kk)
            fwd, bwd = fwd + a, bwd + g
    cast = roofline.fp8_cast_bytes
    if cast:
        routed, shared = rows * local, tokens if f_s else 0.0
        fwd += roofline.bytes_time(cast * (routed * f_e + shared * f_s))
        bwd += roofline.bytes_time(cast * (routed * (n_up * f_e + h) + shared * (n_up * f_s + h)))
    # gather + scatter-add; with EP and several local experts also the received rows' regrouping by local
    # expert and back (Megatron-Core's sort_chunks_by_idxs, executor/expert_parallel.AllToAllDispatch)
    passes = 4 if ep > 1 and local > 1 else 2
    permute = roofline.bytes_time(passes * 2 * imbalance * tokens * k * h * roofline.dtype_bytes)
    act = roofline.bytes_time(roofline.mlp_activation_bytes(spec.gated_mlp)
                              * (rows * local * f_e + tokens * f_s))
    return fwd + permute + act, bwd + 2 * permute + 2 * act


def dense_ffn_time(roofline, spec: ModelSpec, tokens: float, tp: int) -> tuple[float, float]:
    """(forward, backward) of the dense MLP's GEMMs (roofline.layer's shapes)."""
    f, h = spec.ffn_hidden_size / tp, spec.hidden_size
    fwd = bwd = 0.0
    for m, n, k in [(tokens, f, h)] * (2 if spec.gated_mlp else 1) + [(tokens, h, f)]:
        a, g = roofline.gemm_fwd_bwd(m, n, k)
        fwd, bwd = fwd + a, bwd + g
    return fwd, bwd


def block_ffn_time_correction(roofline, spec: ModelSpec, tokens: float, tp: int,
                              sequence_parallel: bool = False) -> tuple[float, float]:
    """What to add to a block timed with the dense MLP's GEMMs to time the mean block of a MoE model at
    ep = 1: phi · (MoE feed-forward − dense MLP). 0 for a dense model. Both at the Linear GEMMs' rates (FP8's
    under an FP8 recipe), each with its casts (the dense MLP's as `roofline.fp8_casts` charged them: the
    last GEMM's output gradient on the sequence shard under sequence parallelism)."""
    phi = sparse_fraction(spec)
    if phi == 0:
        return 0.0, 0.0
    mf, mb = moe_ffn_time(roofline, spec, tokens, tp)
    df, db = dense_ffn_time(roofline.linear, spec, tokens, tp)
    cast = roofline.fp8_cast_bytes
    act = roofline.bytes_time(roofline.mlp_activation_bytes(spec.gated_mlp) * tokens
                              * spec.ffn_hidden_size / tp)  # the dense MLP's, in the block's elementwise
    df, db = df + act, db + 2 * act
    if cast:  # the dense MLP's casts, charged in the block's fp8_casts
        f, n_up = spec.ffn_hidden_size / tp, 2 if spec.gated_mlp else 1
        df += roofline.bytes_time(cast * tokens * f)
        sp = tp if sequence_parallel else 1
        db += roofline.bytes_time(cast * tokens * (n_up * f + spec.hidden_size / sp))
    return phi * (mf - df), phi * (mb - db)
