"""Cost terms of context parallelism (CP, DESIGN.md §5): a layer's compute, communication and memory when
cp ranks each hold s/cp tokens of every sequence.

Compute per CP rank. Everything that works per token (the GEMMs, norms, rotary, the MLP, embedding and
head) runs on s/cp tokens. The attention core of the rank's chunk attends to the chunk's whole causal
past: with the zig-zag (head-tail) split, chunks c and 2·cp − 1 − c of 2·cp on rank c, every rank does
1/cp of the causal core's FLOPs (Megatron-LM CP's load balancing; torch's _HeadTailLoadBalancer), i.e.
(s/cp)·s of the s·s (causal: half) attention matrix. Ring (Liu et al. 2023, Ring Attention): that work
runs as cp blocks of s/cp queries x s/cp keys, each at flash-attention's rate for that length; all-gather
(the same split, its queries against the gathered keys) is timed the same way. All-to-all (Jacobs et al.
2023, DeepSpeed-Ulysses): the core runs whole, on s tokens and heads/(tp·cp) heads.

Communication per block and micro-batch:
- ring: cp − 1 exchanges of the local K and V block (2·b·(s/cp)·kv_dim/tp values) with the ring
  neighbours in forward, each overlapped with one block of attention; backward passes K, V and the
  accumulated dK, dV (twice the bytes), overlapped with one block of the backward attention (Liu et al.
  2023 §3; Megatron-Core's p2p CP). Only what a block's compute cannot hide is exposed:
  (cp − 1)·max(0, t_exchange − t_attention_block).
- all-gather (Llama 3, Dubey et al. 2024 §3.3.2; Megatron-LM's all_gather): K and V of every rank are
  gathered before attention (an all-gather of cp·KV block bytes); backward gathers them again (only the
  local chunk is kept, as Transformer Engine's AttnFuncWithCPAndKVAllGather and the executor do) and
  reduce-scatters dK, dV; all on the critical path: Llama 3 states the all-gather is exposed, small beside
  the attention because grouped-query K and V are much smaller than Q. Selective recompute keeps the
  local chunks as the checkpoint's inputs as well; full recompute gathers in its recompute instead of
  in backward.
- all-to-all: four all-to-alls in forward (q, k, v in; the output back) and four in backward, each of the
  rank's b·(s/cp)·width/tp values, on the critical path (Jacobs et al. 2023 §3.1). An all-to-all of M
  bytes per rank over n ranks moves (n − 1)/n·M per rank in n − 1 steps: nccl-tests' PERFORMANCE.md
  gives alltoall the bus-bandwidth factor (n − 1)/n, the all-gather's, so the link fit's all-gather
  (M = the local tensor) times it.

Memory: activations are counted on s/cp tokens (÷cp, Korthikanti et al. 2022's count applies per token);
ring CP holds the KV blocks in flight as transient buffers (`kv_buffer_bytes`); the logits and the loss
are ÷cp (each rank's loss covers its tokens).
"""

from __future__ import annotations

from meshplan.planner.candidate import Candidate
from meshplan.planner.cost_collectives import tp_comm_time
from meshplan.planner.cost_compute import compute_time, recompute_time
from meshplan.planner.cost_memory import Workspace, activation_bytes
from meshplan.planner.cost_model import Terms
from meshplan.planner.cost_pipeline import pp_comm_time, split_backward_factor
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.plan import CP_MODES
from meshplan.profiler.analytic import DTYPE_BYTES, layer_forward_flops

# flash-attention's backward does 2.5x the forward's FLOPs (Dao 2023, FlashAttention-2 §3.1: 5 GEMMs in
# backward against 2 in forward); profiler/roofline.py times the core with the same ratio.
FLASH_BACKWARD_RATIO = 2.5


def local_seq(s: int, cp: int) -> int:
    return s // cp


def causal_core_flops(model: ModelSpec, b: int, s: int, tp: int) -> float:
    """Forward FLOPs of the causal attention core over the whole sequence on one TP rank: half of
    4·b·s²·heads·head_dim (flash-attention's benchmark count; profiler/roofline.py)."""
    heads = max(1, model.num_heads // tp)
    return 4.0 * b * model.attention_pairs(s) * heads * model.head_dim


def attention_core_time(profile, model: ModelSpec, b: int, s: int, tp: int, cp: int, mode: str
                        ) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one CP rank per micro-batch: 1/cp of the
    causal core. GPU presets (profile.roofline): ring and all-gather = the core's FLOPs ÷ cp at
    flash-attention's rate for s/cp-long blocks; all-to-all = the roofline's core on s tokens and
    heads/(tp·cp). Measured or FLOP profiles: the block's time at s/cp tokens scaled by the extra
    attention FLOPs (`block_compute_time`)."""
    rl = getattr(profile, "roofline", None)
    if rl is None or rl.attention != "flash":
        raise ValueError("attention_core_time needs a GPU preset profile with flash attention")
    if mode == "all-to-all":
        return rl.attention_core(model, b, s, tp * cp)
    flops = causal_core_flops(model, b, s, tp) / cp
    rate = rl.flash_rate(local_seq(s, cp), model.head_dim) * rl.pace
    return max(flops / rate, rl.launch_s), max(FLASH_BACKWARD_RATIO * flops / rate, rl.launch_s)


def block_compute_time(profile, model: ModelSpec, b: int, s: int, tp: int, cp: int, mode: str
                       ) -> tuple[float, float, float, float]:
    """(forward, backward, attention forward, attention backward) seconds of one block on one CP rank per
    micro-batch, corrections applied; the attention pair is the core alone (what hides the ring's
    exchanges). cp = 1: the profile's block and its core (the core's share by FLOPs when not modelled)."""
    sl = local_seq(s, cp)
    fwd, bwd = compute_time(profile, "block", b, sl, tp)
    k = profile.correction("compute")
    rl = getattr(profile, "roofline", None)
    if rl is not None and rl.attention == "flash":
        lf, lb = rl.attention_core(model, b, sl, tp)  # the core at s/cp tokens, inside `fwd`, `bwd`
        af, ab = attention_core_time(profile, model, b, s, tp, cp, mode) if cp > 1 else (lf, lb)
        return fwd + (af - lf) * k, bwd + (ab - lb) * k, af * k, ab * k
    # FLOP-fitted (measured CPU, or presets without an attention model): layer_forward_flops counts the
    # core as 4·b·s²·q_dim/tp; on a CP rank it is 4·b·s·(s/cp)·q_dim/tp (1/cp of it), the rest per token.
    q_dim = model.num_heads * model.head_dim
    local = layer_forward_flops(model, "block", b, sl, tp)
    core_local = 4.0 * b * sl * sl * q_dim / tp
    core = 4.0 * b * s * sl * q_dim / tp
    scale = (local - core_local + core) / local if local > 0 else 1.0
    share = core / (local - core_local + core) if local > 0 else 0.0
    return fwd * scale, bwd * scale, fwd * scale * share, bwd * scale * share


def kv_block_bytes(model: ModelSpec, b: int, s: int, tp: int, cp: int, dtype: str) -> float:
    """Bytes of one rank's K and V block: 2·b·(s/cp)·kv_dim/tp values."""
    kv_dim = model.num_kv_heads * model.head_dim
    return 2.0 * b * local_seq(s, cp) * kv_dim / tp * DTYPE_BYTES[dtype]


def all_to_all_time(profile, nbytes: float, n: int, link: str) -> float:
    """One all-to-all of `nbytes` per rank over n ranks: (n − 1) steps moving (n − 1)/n of the local
    tensor, the all-gather's factors (nccl-tests PERFORMANCE.md, alltoall busbw = algbw·(n − 1)/n).

    `link` "inter_node/g" (g members of the group in each NVLink domain): NCCL runs an all-to-all as one
    send and one receive per peer (nccl-tests src/alltoall.cu; NCCL docs, "Point-to-point communication:
    all-to-all"), each over the path between the two GPUs, so of the nbytes/n chunks a rank sends, the
    g − 1 to its own domain take NVLink and only the n − g others its NIC (with PXN or rail-matched, each
    of the domain's NICs carries its own GPU's share). Both run at once: the slower sets the time."""
    cls, _, local = link.partition("/")
    g = int(local) if local else 1
    if cls == "intra_node" or g <= 1 or n <= g:
        return profile.collective_time("all_gather", nbytes, n, cls)
    # all_gather's factor (n − 1)/n of M: M = nbytes·k/(n − 1) moves the k chunks of nbytes/n
    across = profile.collective_time("all_gather", nbytes * (n - g) / (n - 1), n, cls)
    inside = profile.collective_time("all_gather", nbytes * (g - 1) / (n - 1), n, "intra_node")
    return max(across, inside)


def cp_comm_time(profile, model: ModelSpec, b: int, s: int, tp: int, cp: int, mode: str, dtype: str, link: str,
                 attn_fwd: float, attn_bwd: float) -> tuple[float, float]:
    """(forward, backward) exposed CP communication seconds of one block per micro-batch (module
    docstring); `attn_fwd`, `attn_bwd`: the rank's attention core, which hides the ring's exchanges."""
    if cp <= 1:
        return 0.0, 0.0
    if mode == "ring":
        kv = kv_block_bytes(model, b, s, tp, cp, dtype)
        step_f = profile.collective_time("send_recv", kv, 2, link)
        step_b = profile.collective_time("send_recv", 2.0 * kv, 2, link)  # K, V and dK, dV
        fwd = (cp - 1) * max(0.0, step_f - attn_fwd / cp)
        bwd = (cp - 1) * max(0.0, step_b - attn_bwd / cp)
    elif mode == "all-gather":  # M = the gathered K and V (collective_factors: M is the full tensor)
        gathered = cp * kv_block_bytes(model, b, s, tp, cp, dtype)
        fwd = profile.collective_time("all_gather", gathered, cp, link)
        bwd = fwd + profile.collective_time("reduce_scatter", gathered, cp, link)  # gathered again, dK dV
    else:
        q_dim, kv_dim = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        per = b * local_seq(s, cp) / tp * DTYPE_BYTES[dtype]
        fwd = sum(all_to_all_time(profile, per * width, cp, link) for width in (q_dim, kv_dim, kv_dim, q_dim))
        bwd = fwd
    k = profile.correction("cp_comm")  # 1 unless calibrated
    return fwd * k, bwd * k


def kv_buffer_bytes(model: ModelSpec, b: int, s: int, tp: int, cp: int, mode: str, dtype: str) -> float:
    """Transient bytes of CP at a block's peak. Ring: the KV block being computed on and the one arriving
    (double buffering), and in backward also dK, dV in flight: 2·(KV + dKV) = 4 KV blocks (Megatron-Core's
    p2p CP). All-gather: in a block's backward the gathered K and V (gathered again, or recomputed, in
    sequence order) and their dK, dV in sequence order and again in the gathered order the reduce-scatter
    takes (executor/context_parallel.AllGatherAttention): 3·cp KV blocks. All-to-all: the gathered q, k,
    v and output of one block, as large as the local ones."""
    if cp <= 1:
        return 0.0
    if mode == "ring":
        return 4.0 * kv_block_bytes(model, b, s, tp, cp, dtype)
    if mode == "all-gather":
        return 3.0 * cp * kv_block_bytes(model, b, s, tp, cp, dtype)
    q_dim, kv_dim = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return b * local_seq(s, cp) * (2 * q_dim + 2 * kv_dim) / tp * DTYPE_BYTES[dtype]


class CPTerms(Terms):
    """`Terms` of a candidate with cp > 1: every per-micro-batch term on s/cp tokens, the attention core
    at 1/cp of the causal core, and the exposed CP communication folded into the block's communication
    (the third value of `kind`). The per-parameter terms (state, optimizer, gradient sync) are the base
    class's: the caller passes dp·cp, the ranks that average gradients."""

    def __init__(self, base: Terms, cp: int, mode: str, link: str):
        super().__init__(base.model, base.profile, base.s, base.dtype)
        self.cp, self.mode, self.link = cp, mode, link
        self.root = getattr(base, "root", base)  # the candidate-independent Terms, for per-parameter memos

    def block(self, b: int, tp: int) -> tuple[float, float, float, float]:
        """(forward, backward, attention forward, attention backward) of a block (`block_compute_time`)."""
        return self._get(("cp block", b, tp),
                         lambda: block_compute_time(self.profile, self.model, b, self.s, tp, self.cp, self.mode))

    def cp_comm(self, b: int, tp: int) -> tuple[float, float]:
        """(forward, backward) exposed CP seconds of a block per micro-batch."""
        def make():
            _, _, af, ab = self.block(b, tp)
            return cp_comm_time(self.profile, self.model, b, self.s, tp, self.cp, self.mode, self.dtype, self.link,
                                af, ab)
        return self._get(("cp comm", b, tp), make)

    def kind(self, kind: str, b: int, tp: int, schedule: str = "1f1b") -> tuple[float, float, float, float]:
        def make():
            sl = local_seq(self.s, self.cp)
            h = self.model.hidden_size
            if kind == "block":
                f, g, _, _ = self.block(b, tp)
                c = sum(self.cp_comm(b, tp))
            else:
                f, g = compute_time(self.profile, kind, b, sl, tp)
                c = 0.0
            g *= split_backward_factor(self.profile, schedule, b)
            c += tp_comm_time(self.profile, kind, b, sl, h, tp, self.dtype, "none")
            return f, g, c, activation_bytes(self.profile, kind, b, sl, tp, "none", tp > 1)
        return self._get(("kind", kind, b, tp, schedule == "zero-bubble"), make)

    def regather(self, b: int, tp: int) -> float:
        """Backward's second all-gather of K and V (all-gather mode), which full recompute replaces by the
        gather in its recompute."""
        return self.cp_comm(b, tp)[0] if self.mode == "all-gather" else 0.0

    def recompute(self, b: int, tp: int, mode: str) -> tuple[float, float, float]:
        """Full recompute runs the block's forward again, its CP communication included; selective runs
        the attention core again: under ring CP that is ring attention with its exchanges, under
        all-gather and all-to-all only the local core after the gather or between the all-to-alls
        (executor/context_parallel.py). All-gather under full recompute: backward does not gather K and
        V again (`regather`)."""
        def make():
            if mode == "none" or not self.model.num_layers:
                return 0.0, 0.0, 0.0
            sl = local_seq(self.s, self.cp)
            h = self.model.hidden_size
            a = self.kind("block", b, tp)[3]
            f, _, af, _ = self.block(b, tp)
            cp_f, _ = self.cp_comm(b, tp)
            base_tp = tp_comm_time(self.profile, "block", b, sl, h, tp, self.dtype, "none")
            rec_tp = tp_comm_time(self.profile, "block", b, sl, h, tp, self.dtype, mode) - base_tp
            if mode == "full":  # the profile's recompute of a block at s/cp tokens, scaled to the CP block
                f_local = compute_time(self.profile, "block", b, sl, tp)[0]
                rec = recompute_time(self.profile, "block", b, sl, tp, "full") * f / max(f_local, 1e-30) + cp_f \
                    - self.regather(b, tp)
            else:  # the core at 1/cp of the causal work (at least the profile's selective recompute at s/cp)
                rec = max(recompute_time(self.profile, "block", b, sl, tp, "selective"), af) + \
                    (cp_f if self.mode == "ring" else 0.0)
            saving = a - activation_bytes(self.profile, "block", b, sl, tp, mode, tp > 1)
            return rec + rec_tp, saving, rec_tp
        return self._get(("rec", b, tp, mode), make)

    def side_comm(self, b: int, tp: int, mode: str) -> dict[str, tuple[float, float]]:
        """Exposed CP seconds of a block, and what recompute changes: its forward again where recompute
        replays the exchanges (full; selective under ring, whose recomputed core is ring attention), less
        backward's second all-gather that all-gather CP skips under full recompute (`regather`)."""
        f, g = self.cp_comm(b, tp)
        again = f if mode == "full" or (mode == "selective" and self.mode == "ring") else 0.0
        again -= self.regather(b, tp) if mode == "full" else 0.0
        return super().side_comm(b, tp, mode) | {"cp": (f + g, again)}

    def hop(self, b: int, tp: int, link: str) -> float:
        """A pipeline boundary carries the rank's b·(s/cp)·h activations."""
        h, sl = self.model.hidden_size, local_seq(self.s, self.cp)
        return self._get(("hop", b, tp, link),
                         lambda: pp_comm_time(self.profile, b, sl, h, tp, self.dtype, tp > 1, link))


def cp_terms(base: Terms, cp: int, mode: str, link: str) -> Terms:
    """The Terms of a candidate with this CP degree and mode (the base Terms for cp = 1), memoised on the
    base Terms so that the search's thousands of candidates share them."""
    if cp <= 1:
        return base
    return base._get(("cp terms", cp, mode, link), lambda: CPTerms(base, cp, mode, link))


def add_cp_buffers(ws: Workspace, model: ModelSpec, cand: Candidate, s: int, dtype: str) -> Workspace:
    """The step's transients with CP's buffers (`kv_buffer_bytes`) at the activation peak of every rank."""
    if cand.cp <= 1:
        return ws
    extra = kv_buffer_bytes(model, cand.b, s, cand.tp, cand.cp, cand.cp_mode, dtype)
    return Workspace([x + extra for x in ws.act], ws.emb, ws.opt, ws.per_layer)


# ---------------------------------------------------------------------------------------------------
# What the search enumerates.
# ---------------------------------------------------------------------------------------------------

# Unpinned, the search tries cp > 1 only from this sequence length on. Below it the attention core is a
# small share of a block (4·s·q_dim against 2·(q + 2·kv + o + MLP) weights per token: 22 % of llama3-8b's
# block FLOPs at 8K, 8 % at 2K), so CP only moves per-token work to more ranks the way dp already can,
# while multiplying the candidates (plan_speed's gpt3-175b/1024 A100 at 2K would search every cp divisor
# of 1024/tp for nothing). Megatron-LM's guidance is the same order: CP for long contexts, >= 8K
# (NVIDIA Megatron-Core docs, "context parallelism", which benchmarks it from 8K on). `--cp` always wins.
CP_MIN_SEQ_LEN = 8192


def mode_fits(model: ModelSpec, seq: int, tp: int, cp: int, mode: str) -> bool:
    """Whether the executor can run this CP degree and mode: ring and all-gather split the sequence into
    2·cp load-balanced chunks; all-to-all scatters heads, so tp·cp divides the query and key/value heads; with
    sequence parallelism each chunk splits again over tp."""
    if cp == 1:
        return True
    if model.cp_obstacle(seq):
        return False
    if (seq // cp) % tp if seq % cp == 0 else True:
        return False
    if mode != "all-to-all":
        return seq % (2 * cp) == 0
    return model.num_heads % (tp * cp) == 0 and model.num_kv_heads % (tp * cp) == 0


def _modes(cluster, constraints) -> tuple[str, ...]:
    """Modes the search may choose: the pinned one; on CPU clusters all but ring (torch's ring attention
    has no CPU implementation in torch 2.13, DESIGN.md §7: the executor would refuse it); only those the
    --software engine runs."""
    engine = getattr(constraints, "engine_cp_modes", None)  # what the --software engine runs
    if getattr(constraints, "cp_mode", None) is not None:
        return (constraints.cp_mode,) if engine is None or constraints.cp_mode in engine else ()
    modes = tuple(m for m in CP_MODES if m != "ring") if cluster.device.kind == "cpu" else CP_MODES
    return modes if engine is None else tuple(m for m in modes if m in engine)


def cp_degrees(model: ModelSpec, cluster, constraints, tp: int) -> list[int]:
    """CP degrees for this tp: the pinned one, else 1 and, for sequences of at least CP_MIN_SEQ_LEN, every
    divisor of world/tp some mode can run."""
    world, seq = cluster.world_size, constraints.effective_seq_len(model)
    if (world // tp) * tp != world:
        return []
    pinned = getattr(constraints, "cp", None)
    if pinned is not None:
        return [pinned] if (world // tp) % pinned == 0 else []
    out = [1]
    if seq < CP_MIN_SEQ_LEN:
        return out
    for cp in range(2, world // tp + 1):
        if (world // tp) % cp == 0 and any(mode_fits(model, seq, tp, cp, m) for m in _modes(cluster, constraints)):
            out.append(cp)
    return out


def cp_pp_pairs(model: ModelSpec, cluster, constraints, tp: int):
    """(cp, pp) pairs with cp·pp dividing world/tp, cp = 1 first."""
    world = cluster.world_size
    for cp in cp_degrees(model, cluster, constraints, tp):
        rest = world // (tp * cp)
        for pp in range(1, rest + 1):
            if rest % pp == 0:
                yield cp, pp


def cp_modes(model: ModelSpec, cluster, constraints, tp: int, cp: int) -> list[str]:
    """The CP modes a candidate of this tp and cp may use ("ring", a placeholder, for cp = 1)."""
    if cp == 1:
        return ["ring"]
    seq = constraints.effective_seq_len(model)
    return [m for m in _modes(cluster, constraints) if mode_fits(model, seq, tp, cp, m)]
