"""Profile JSON: what the profiler measured (or derived from presets) and the planner consumes.

The planner asks a Profile four questions — layer forward/backward time, recompute time, activation
bytes, collective time — for any micro-batch size, sequence length and tensor-parallel degree. Measured
samples are fitted to the closed-form shape in `profiler.analytic` (time = overhead + FLOPs / rate;
bytes = measured/analytic ratio × analytic), so a few measured points answer the whole search space.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from meshplan.planner.errors import InputError
from meshplan.planner.fields import Fields
from meshplan.planner.jsonio import read_json, write_atomic
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.plan import SCHEDULES
from meshplan.profiler.analytic import layer_activation_bytes, layer_forward_flops
from meshplan.profiler.roofline import Roofline

SCHEMA_VERSION = 1
LAYER_KINDS = ("embedding", "block", "head")
LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
LINK_CLASSES = ("intra_node", "inter_node", "inter_leaf")
RECOMPUTE_MODES = ("none", "selective", "full")
CORRECTION_TERMS = ("compute", "tp_comm", "pp_comm", "dp_comm", "optimizer")


# NCCL's tree all-reduce (double binary trees over the nodes, NCCL >= 2.4): 2·log2(nodes) network steps,
# and the algorithm bandwidth half the bus bandwidth, times 0.92 (NVIDIA/nccl src/graph/tuning.cc, v2.30.7,
# lines 331 and 378-380, 416). NCCL times both algorithms for every size and runs the faster (sjeaugey,
# NVIDIA/nccl#457): the ring's 2(n-1) steps make it slow for small payloads over many nodes, where the tree
# wins, and the ring moves fewer bytes per rank for large ones. Reduce-scatter and all-gather run no tree.
TREE_BW_SHARE = 0.92


def tree_all_reduce_time(alpha_s: float, beta_s_per_byte: float, nbytes: float, nodes: int) -> float:
    """Seconds of a tree all-reduce of `nbytes` over `nodes` nodes: 2·log2(nodes) steps up and down, each
    rank sending and receiving 2·M at the tree's share of the bus bandwidth."""
    return alpha_s * 2.0 * math.log2(max(nodes, 2)) + beta_s_per_byte * 2.0 * nbytes / TREE_BW_SHARE


def collective_factors(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bytes factor) of ring algorithms for a message of M bytes over n ranks
    (Thakur et al. 2005; NCCL's bus-bandwidth convention): all-reduce 2(n-1) steps moving 2(n-1)/n·M,
    all-gather / reduce-scatter (n-1) steps moving (n-1)/n·M (M = the full tensor), send/recv 1 and M."""
    if n <= 1 and op != "send_recv":
        return 0.0, 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return float(n - 1), (n - 1) / n
    if op == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass
class ComputeSample:
    kind: str
    micro_batch_size: int
    seq_len: int
    tp: int
    forward_s: float
    backward_s: float
    spread: float = 0.0  # (p90 - p10) / median over the repeats, of forward + backward
    # backward including the re-run forward with full / selective recompute (0: not measured)
    backward_full_s: float = 0.0
    backward_selective_s: float = 0.0
    # the forward under that recompute's checkpoint (0: not measured, taken as forward_s)
    forward_full_s: float = 0.0
    forward_selective_s: float = 0.0
    # True: timed tensor-parallel across tp ranks, TP collectives (and DTensor's dispatch) included;
    # False: one rank's shard shapes alone (the cost model adds the collectives from the link fit)
    with_collectives: bool = False

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "ComputeSample":
        f = Fields(data, path)
        return cls(f.str("kind", choices=LAYER_KINDS), f.int("micro_batch_size", min=1), f.int("seq_len", min=1),
                   f.int("tp", min=1), f.float("forward_s", min=0.0), f.float("backward_s", min=0.0),
                   f.float("spread", min=0.0, default=0.0), f.float("backward_full_s", min=0.0, default=0.0),
                   f.float("backward_selective_s", min=0.0, default=0.0),
                   forward_full_s=f.float("forward_full_s", min=0.0, default=0.0),
                   forward_selective_s=f.float("forward_selective_s", min=0.0, default=0.0),
                   with_collectives=f.bool("with_collectives", default=False))


@dataclass
class MemorySample:
    kind: str
    micro_batch_size: int
    seq_len: int
    tp: int
    recompute: str
    activation_bytes: float
    saved_tensors: int = 0  # distinct storages saved for backward (activation_bytes is their total size)
    allocated_bytes: float = 0.0  # CUDA cross-check: memory_allocated growth over the forward (0 on CPU)
    peak_bytes: float = 0.0  # CUDA: max_memory_allocated over the forward, above the start (0 on CPU)

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "MemorySample":
        f = Fields(data, path)
        return cls(f.str("kind", choices=LAYER_KINDS), f.int("micro_batch_size", min=1), f.int("seq_len", min=1),
                   f.int("tp", min=1), f.str("recompute", choices=RECOMPUTE_MODES),
                   f.float("activation_bytes", min=0.0), f.int("saved_tensors", min=0, default=0),
                   f.float("allocated_bytes", min=0.0, default=0.0), f.float("peak_bytes", min=0.0, default=0.0))


@dataclass
class StateSample:
    """Model-state bytes of one layer on one TP rank, as allocated: parameters and gradients in the plan's
    dtype, optimizer state as AdamW created it (moments, step, and the fp32 master copy in mixed precision)."""

    kind: str
    tp: int
    parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "StateSample":
        f = Fields(data, path)
        return cls(f.str("kind", choices=LAYER_KINDS), f.int("tp", min=1), f.int("parameters", min=0),
                   f.int("parameter_bytes", min=0), f.int("gradient_bytes", min=0), f.int("optimizer_bytes", min=0))


@dataclass
class LinkFit:
    """time(op, M, n) = alpha_s · steps(op, n) + beta_s_per_byte · factor(op, n) · M."""

    alpha_s: float
    beta_s_per_byte: float
    measured_group_size: int = 0  # 0: from presets
    spread: float = 0.0  # median over message sizes of (p90 - p10) / median of the repeats
    fit_error: float = 0.0  # largest |fit - measured| / measured over the message sizes
    # presets: nccl-tests' all-reduce bus bandwidth by payload, [[bytes, B/s], ...] (latency included); when
    # given, collectives follow it instead of alpha and beta (planner/cluster_spec.py cites the sweeps)
    busbw_curve: list[list[float]] = field(default_factory=list)
    # where the curve is NVLS's (planner/cluster_spec.LinkSpec.nvls_min_ranks): an all-reduce over this many
    # ranks or more follows it; other collectives and smaller groups run the ring, at most the fit's own
    # bandwidth (1 / beta_s_per_byte, the link's ring busbw)
    nvls_min_ranks: int = 0

    def collective_time(self, op: str, nbytes: float, steps: float, factor: float, ranks: int = 0) -> float:
        if self.busbw_curve and op != "send_recv":
            busbw = busbw_at(self.busbw_curve, nbytes)
            nvls = op == "all_reduce" and ranks >= self.nvls_min_ranks
            if self.nvls_min_ranks and self.beta_s_per_byte > 0 and not nvls:
                busbw = min(busbw, 1.0 / self.beta_s_per_byte)
            return factor * max(nbytes, 1.0) / busbw
        return self.alpha_s * steps + self.beta_s_per_byte * factor * nbytes

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "LinkFit":
        f = Fields(data, path)
        curve = f.list("busbw_curve", default=[])
        if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p)
                   for p in curve):
            raise InputError(f"{path}.busbw_curve: expected a list of [bytes, B/s] pairs")
        return cls(f.float("alpha_s", min=0.0), f.float("beta_s_per_byte", min=0.0),
                   f.int("measured_group_size", min=0, default=0), f.float("spread", min=0.0, default=0.0),
                   f.float("fit_error", min=0.0, default=0.0), [[float(a), float(b)] for a, b in curve],
                   f.int("nvls_min_ranks", min=0, default=0))


def busbw_at(curve: list[list[float]], nbytes: float) -> float:
    """Bus bandwidth at a payload, log-log interpolated between measured sizes; below the smallest the
    smallest's time (latency bound), above the largest its bandwidth."""
    pts = sorted(curve)
    if nbytes <= pts[0][0]:
        return pts[0][1] * nbytes / pts[0][0]
    for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
        if nbytes <= s1:
            w = math.log(nbytes / s0) / math.log(s1 / s0)
            return math.exp(math.log(b0) + w * (math.log(b1) - math.log(b0)))
    return pts[-1][1]


@dataclass
class PipelineSample:
    """Each schedule's in-situ cost per crossing stage boundary and micro-batch (profiler/pipeline_insitu.py)
    at one micro-batch size: the P2P of b·s·h values grows with b, so one size's figure does not hold
    for the others."""

    micro_batch_size: int
    overheads: dict[str, float]

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "PipelineSample":
        f = Fields(data, path)
        return cls(f.int("micro_batch_size", min=1), _overheads(f, "overheads"))


@dataclass
class ChainSample:
    """Forward + backward seconds of the model cut to embedding, `blocks` blocks and head + loss, run
    as one module (profiler/wrappers.py): layers in sequence run slower than the same layers timed
    alone (caches, allocator), by a factor the planner applies to the per-layer fit. With tp > 1 the cut
    runs tensor-parallel across a TP group as the executor runs it (layers in sequence there also wait
    on each other's collectives)."""

    micro_batch_size: int
    seq_len: int
    blocks: int
    seconds: float
    # what splitting the backward as zero-bubble schedules do (input-grad, then weight-grad:
    # torch.distributed.pipelining's stage_backward_input / stage_backward_weight) adds to the backward of
    # the cut's blocks and head; 0: not measured
    split_extra_s: float = 0.0
    tp: int = 1
    # tp > 1: the executor's AdamW step (make_optimizer, Partial gradients reduced first) over the cut's
    # DTensor parameters, over the same step on plain tensors of the local shards' sizes; 0: not measured
    optimizer_ratio: float = 0.0

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "ChainSample":
        f = Fields(data, path)
        return cls(f.int("micro_batch_size", min=1), f.int("seq_len", min=1), f.int("blocks", min=1),
                   f.float("seconds", min=0.0), f.float("split_extra_s", min=0.0, default=0.0),
                   f.int("tp", min=1, default=1), f.float("optimizer_ratio", min=0.0, default=0.0))


ENGINES = ("replicate", "fully_shard", "fully_shard_reshard")  # executor.parallelize.apply_dp at ZeRO 0, 1-2, 3


def engine_for(zero: int) -> str:
    return ENGINES[0] if zero == 0 else (ENGINES[1] if zero <= 2 else ENGINES[2])


@dataclass
class WrapperSample:
    """The data-parallel engine's own costs, measured in situ (profiler/wrappers.py) on `ranks` ranks."""

    engine: str
    ranks: int
    micro_batch_size: int
    seq_len: int
    unit_params: list[int]  # parameters of each wrapped unit of the measured model (blocks, then the root)
    hook_s: float  # added per wrapped unit per gradient-accumulation micro-batch (ZeRO-3: with its gathers)
    sync_s: float  # added by a synchronising micro-batch over all units (the per-iteration reduction)
    optimizer_ratio: float  # AdamW over the engine's parameters / over plain tensors of the same size

    @classmethod
    def from_dict(cls, data: dict, path: str) -> "WrapperSample":
        f = Fields(data, path)
        units = f.list("unit_params")
        if not units or not all(isinstance(x, int) and x >= 0 for x in units):
            raise InputError(f"{path}.unit_params: expected a non-empty list of parameter counts")
        return cls(f.str("engine", choices=ENGINES), f.int("ranks", min=2), f.int("micro_batch_size", min=1),
                   f.int("seq_len", min=1), units, f.float("hook_s", min=0.0), f.float("sync_s", min=0.0),
                   f.float("optimizer_ratio", min=0.0))


@dataclass
class Profile:
    model: ModelSpec
    dtype: str
    source: str  # "measured" or "preset"
    device_kind: str  # "cuda" or "cpu"
    device_name: str
    torch_version: str
    compute: list[ComputeSample]
    links: dict[str, dict[str, LinkFit]]
    memory: list[MemorySample] = field(default_factory=list)
    optimizer_s_per_param: float = 0.0
    concurrent_ranks: int = 1  # processes that ran at once while measuring (CPU ranks share cores)
    corrections: dict[str, float] = field(default_factory=dict)  # per-term factors from `plan calibrate`
    created: str = ""
    state: list[StateSample] = field(default_factory=list)
    threads_per_rank: int = 0  # torch intra-op threads of each measuring process (CPU), 0: not recorded
    cpu_cores: int = 0  # cores the measuring processes shared (CPU), 0: not recorded
    settings: dict[str, float] = field(default_factory=dict)  # warm-up, repeats, ... of the measurement
    wrappers: list[WrapperSample] = field(default_factory=list)  # data-parallel engines in situ (measured)
    # torch.distributed.pipelining's own cost per crossing stage boundary and micro-batch, by schedule,
    # P2P included (measured in situ; empty: not measured, the cost model uses the send/recv link fit)
    pipeline_overheads: dict[str, float] = field(default_factory=dict)  # at the smallest micro-batch size
    pipeline_samples: list[PipelineSample] = field(default_factory=list)  # per micro-batch size
    chains: list[ChainSample] = field(default_factory=list)  # whole-model cuts, see `chain_factor`
    # one all-reduce of a scalar over all the measured ranks: the executor's step runs two (the global
    # gradient norm, the logged loss); far below the link fit's intercept on CPU, which is fitted from
    # 4 KiB up; 0: not measured
    step_sync_s: float = 0.0
    # presets of a GPU: the per-operation model (profiler/roofline.py) answers layer and recompute times
    roofline: Roofline | None = None
    schema_version: int = SCHEMA_VERSION

    # ---- queries used by the planner's cost model ----

    def layer_time(self, kind: str, b: int, s: int, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of one layer for one micro-batch on one TP rank: the fit of the
        samples, times the measured `chain_factor` at this TP degree (1 where no chain ran at it); for
        GPU presets, the per-operation model."""
        if self.roofline is not None:
            return self.roofline.layer(self.model, kind, b, s, tp)
        fwd, bwd = self._fitted_time(kind, b, s, tp)
        k = self.chain_factor(b, tp)
        return fwd * k, bwd * k

    def _fitted_time(self, kind: str, b: int, s: int, tp: int) -> tuple[float, float]:
        work = layer_forward_flops(self.model, kind, b, s, tp)
        fwd = self._fit(kind, tp, "forward_s")
        bwd = self._fit(kind, tp, "backward_s")
        return fwd[0] + fwd[1] * work, bwd[0] + bwd[1] * work

    def chain_factor(self, b: int, tp: int = 1) -> float:
        """Measured time of the cut model run as one module over the sum of its layers' fitted times, at
        TP degree `tp`, interpolated over log2(micro-batch size) between measured sizes (clamped
        outside); 1 without chain samples at that degree."""
        points = []
        for c in self.chains:
            if c.tp != tp:
                continue
            alone = sum(sum(self._fitted_time(k, c.micro_batch_size, c.seq_len, tp)) for k in _cut_kinds(c))
            if alone > 0 and c.seconds > 0:
                points.append((c.micro_batch_size, c.seconds / alone))
        return _interpolate(points, b)

    def split_backward_factor(self, b: int) -> float:
        """How much longer a layer's backward takes split into input- and weight-grad passes (zero-bubble
        schedules) than whole: 1 + the measured extra / the backward of the cut's blocks and head,
        interpolated over log2(micro-batch size) like `chain_factor`; 1 when not measured."""
        points = []
        for c in self.chains:
            if c.split_extra_s > 0 and c.tp == 1:
                b_ = c.micro_batch_size
                bwd = sum(self._fitted_time(k, b_, c.seq_len, 1)[1] for k in _cut_kinds(c)[1:])
                if bwd > 0:
                    points.append((b_, 1.0 + c.split_extra_s / (bwd * self.chain_factor(b_))))
        return _interpolate(points, b)

    def pipeline_overhead(self, schedule: str, b: int | None = None) -> float:
        """Seconds per crossing stage boundary and micro-batch of `schedule`, measured in situ; with `b`
        interpolated over log2(micro-batch size) between the measured sizes (clamped outside); 0 when not
        measured (a schedule missing from an older profile takes 1F1B's figure)."""
        name = schedule if schedule in self.pipeline_overheads else "1f1b"
        points = [(p.micro_batch_size, p.overheads[name]) for p in self.pipeline_samples if name in p.overheads]
        if b is not None and points:
            return _interpolate(points, b)
        return self.pipeline_overheads.get(name, 0.0)

    def tp_optimizer_ratio(self, tp: int) -> float | None:
        """The executor's AdamW step over tensor-parallel (DTensor) parameters relative to plain tensors of
        the same size, measured on the TP chain at this degree; None when not measured."""
        ratios = sorted(c.optimizer_ratio for c in self.chains if c.tp == tp and c.optimizer_ratio > 0)
        return ratios[len(ratios) // 2] if ratios else None

    def tp_collectives_measured(self, kind: str, tp: int) -> bool:
        """Whether `layer_time(kind, ·, ·, tp)` already includes the TP collectives (timed across ranks)."""
        return tp > 1 and any(c.kind == kind and c.tp == tp and c.with_collectives for c in self.compute)

    def _fit(self, kind: str, tp: int, attr: str) -> tuple[float, float]:
        """Least-squares (overhead, seconds per FLOP) over the samples of this kind, preferring this tp."""
        key = (kind, tp, attr)
        cache = self.__dict__.setdefault("_fits", {})
        if key in cache:
            return cache[key]
        samples = [c for c in self.compute if c.kind == kind]
        if not samples:
            raise InputError(f"profile: no compute samples for layer kind '{kind}'")
        same_tp = [c for c in samples if c.tp == tp]
        if len({(c.micro_batch_size, c.seq_len) for c in same_tp}) >= 2:
            samples = same_tp
        xs = [layer_forward_flops(self.model, c.kind, c.micro_batch_size, c.seq_len, c.tp) for c in samples]
        ys = [getattr(c, attr) for c in samples]
        cache[key] = _fit_line(xs, ys)
        return cache[key]

    def recompute_time(self, kind: str, b: int, s: int, tp: int, mode: str) -> float:
        """Extra work of a recomputed layer: a whole forward (full) or the attention core (selective) again
        in backward, and the checkpoint's own cost in forward, as measured; unmeasured, the share of the
        forward is taken from the FLOP count (4·b·s²·q_dim of the total for the attention core)."""
        if mode == "none" or kind != "block":
            return 0.0
        if self.roofline is not None:
            return self.roofline.recompute(self.model, b, s, tp, mode)
        fwd, _ = self.layer_time(kind, b, s, tp)
        measured = self._recompute_ratio(kind, mode)
        if measured is not None:
            return fwd * measured
        if mode == "full":
            return fwd
        q_dim = self.model.num_heads * self.model.head_dim
        attn = 4.0 * b * s * s * q_dim / tp
        return fwd * attn / layer_forward_flops(self.model, kind, b, s, tp)

    def _recompute_ratio(self, kind: str, mode: str) -> float | None:
        """Measured extra time of a recomputed layer over its forward, median over samples; None if
        unmeasured. The extra is the backward's (the forward run again) plus the checkpointed forward's
        over the plain one (its bookkeeping, which is not negligible on small layers)."""
        def extra(c: ComputeSample) -> float:
            fwd_mode = getattr(c, f"forward_{mode}_s") or c.forward_s
            return max(0.0, getattr(c, f"backward_{mode}_s") - c.backward_s) + max(0.0, fwd_mode - c.forward_s)
        ratios = sorted(extra(c) / c.forward_s for c in self.compute
                        if c.kind == kind and getattr(c, f"backward_{mode}_s") > 0 and c.forward_s > 0)
        return ratios[len(ratios) // 2] if ratios else None

    def activation_bytes(self, kind: str, b: int, s: int, tp: int, recompute: str = "none",
                         sequence_parallel: bool = False) -> float:
        r = self.roofline
        sequence_parallel = sequence_parallel and (r is None or r.sequence_parallel)
        analytic = layer_activation_bytes(self.model, kind, b, s, tp, self.dtype, recompute, sequence_parallel,
                                          unfused_attention=r is not None and r.attention == "unfused",
                                          sharded_inputs=r is None or r.activations == "sharded",
                                          selective=r.selective if r is not None else "attention",
                                          fused_loss=r is not None and r.loss == "fused",
                                          fp8=r is not None and r.fp8 != "none")
        # the samples measured the executor's layers, which keep their Linear inputs sharded
        ratios = [m.activation_bytes / a for m in self.memory if m.kind == kind and m.recompute == recompute
                  for a in [layer_activation_bytes(self.model, kind, m.micro_batch_size, m.seq_len, m.tp,
                                                   self.dtype, recompute, sharded_inputs=True)] if a > 0]
        return analytic * (sum(ratios) / len(ratios) if ratios else 1.0)

    def collective_time(self, op: str, nbytes: float, n: int, link_class: str) -> float:
        """Seconds of one collective over n ranks on a class of link. "inter_node/g": a group spanning
        domains with g members in each; NCCL reduces inside a domain first and all g NICs carry the
        inter-node part, so the NIC fit sees 1/g of the bytes (4 nodes x 8 B200 on 8 NICs each: 381.8 GB/s
        all-reduce busbw against 50 GB/s per NIC, stas00/ml-engineering network/README.md), never faster
        than the domain's own links."""
        link_class, _, local = link_class.partition("/")
        if local and int(local) > 1 and n > int(local):
            g = int(local)
            inside = self._flat_time(op, nbytes, n, "intra_node", n)
            return max(inside, self._flat_time(op, nbytes / g, n, link_class, n // g))
        return self._flat_time(op, nbytes, n, link_class, n)

    def _flat_time(self, op: str, nbytes: float, n: int, link_class: str, nodes: int) -> float:
        """One collective over n ranks on one class of link; across nodes an all-reduce takes the faster of
        NCCL's ring and its tree over `nodes` (`tree_all_reduce_time`)."""
        steps, factor = collective_factors(op, n)
        if steps == 0.0:
            return 0.0
        fits = self.links.get(link_class) or (link_class == "inter_leaf" and self.links.get("inter_node")) \
            or self.links["intra_node"]
        fit = fits.get(op) or fits["all_reduce"]
        ring = fit.collective_time(op, nbytes, steps, factor, n)
        if op != "all_reduce" or link_class == "intra_node" or fit.busbw_curve or nodes <= 2:
            return ring
        return min(ring, tree_all_reduce_time(fit.alpha_s, fit.beta_s_per_byte, nbytes, nodes))

    def wrapper(self, zero: int) -> WrapperSample | None:
        """The in-situ sample of the engine the executor uses at this ZeRO level (smallest micro-batch)."""
        engine = engine_for(zero)
        found = sorted((w for w in self.wrappers if w.engine == engine), key=lambda w: w.micro_batch_size)
        return found[0] if found else None

    def correction(self, term: str) -> float:
        return self.corrections.get(term, 1.0)

    # ---- JSON ----

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data["model"] = self.model.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict, path: str = "profile") -> "Profile":
        f = Fields(data, path)
        version = f.int("schema_version")
        if version != SCHEMA_VERSION:
            raise f.fail("schema_version", f"{SCHEMA_VERSION} (this meshplan's profile format)", version)
        links_f = f.obj("links")
        links = {}
        for cls_name in links_f.data:
            if cls_name not in LINK_CLASSES:
                raise InputError(f"{path}.links.{cls_name}: expected one of {', '.join(LINK_CLASSES)}")
            ops_f = links_f.obj(cls_name)
            for op in ops_f.data:
                if op not in LINK_OPS:
                    raise InputError(f"{path}.links.{cls_name}.{op}: expected one of {', '.join(LINK_OPS)}")
            links[cls_name] = {op: LinkFit.from_dict(v, f"{path}.links.{cls_name}.{op}")
                               for op, v in ops_f.data.items()}
        if "intra_node" not in links or "all_reduce" not in links["intra_node"]:
            raise InputError(f"{path}.links.intra_node.all_reduce: missing (required field)")
        corrections = f.number_map("corrections", default={})
        for term in corrections:
            if term not in CORRECTION_TERMS:
                raise InputError(f"{path}.corrections.{term}: expected one of {', '.join(CORRECTION_TERMS)}")
        return cls(
            model=ModelSpec.from_dict(f.obj("model").data, f"{path}.model"),
            dtype=f.str("dtype", choices=("fp32", "bf16", "fp16")),
            source=f.str("source", choices=("measured", "preset")),
            device_kind=f.str("device_kind", choices=("cuda", "cpu")),
            device_name=f.str("device_name"), torch_version=f.str("torch_version"),
            compute=[ComputeSample.from_dict(c, f"{path}.compute[{i}]") for i, c in enumerate(f.list("compute"))],
            links=links,
            memory=[MemorySample.from_dict(m, f"{path}.memory[{i}]")
                    for i, m in enumerate(f.list("memory", default=[]))],
            optimizer_s_per_param=f.float("optimizer_s_per_param", min=0.0, default=0.0),
            concurrent_ranks=f.int("concurrent_ranks", min=1, default=1),
            corrections=corrections, created=f.str("created", default=""),
            state=[StateSample.from_dict(m, f"{path}.state[{i}]") for i, m in enumerate(f.list("state", default=[]))],
            threads_per_rank=f.int("threads_per_rank", min=0, default=0),
            cpu_cores=f.int("cpu_cores", min=0, default=0),
            settings=f.number_map("settings", default={}),
            wrappers=[WrapperSample.from_dict(w, f"{path}.wrappers[{i}]")
                      for i, w in enumerate(f.list("wrappers", default=[]))],
            pipeline_overheads=_overheads(f, "pipeline_overheads"),
            pipeline_samples=[PipelineSample.from_dict(p, f"{path}.pipeline_samples[{i}]")
                              for i, p in enumerate(f.list("pipeline_samples", default=[]))],
            chains=[ChainSample.from_dict(c, f"{path}.chains[{i}]")
                    for i, c in enumerate(f.list("chains", default=[]))],
            step_sync_s=f.float("step_sync_s", min=0.0, default=0.0),
            roofline=Roofline.from_dict(f.obj("roofline").data, f"{path}.roofline")
            if data.get("roofline") is not None else None,
        )


def _cut_kinds(c: ChainSample) -> list[str]:
    return ["embedding"] + ["block"] * c.blocks + ["head"]


def _interpolate(points: list[tuple[int, float]], b: int) -> float:
    """Piecewise linear in log2(micro-batch size) through (size, value) points, clamped outside; 1 without."""
    if not points:
        return 1.0
    pts = sorted((math.log2(size), value) for size, value in points)
    x = math.log2(b)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


def _overheads(f: Fields, key: str) -> dict[str, float]:
    sub = f.obj(key, default={})
    for name in sub.data:
        if name not in SCHEDULES:
            raise InputError(f"{sub.path}.{name}: expected one of {', '.join(SCHEDULES)}")
    return {name: sub.float(name, min=0.0) for name in sub.data}


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + c·x with a, c >= 0 (least squares; through the origin when x does not vary). A negative
    slope (time flat in the work, e.g. latency-bound TP collectives, within noise) gives the constant."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var > 0:
        c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        a = my - c * mx
        if a >= 0 and c >= 0:
            return a, c
        if c < 0:
            return my, 0.0
    total = sum(xs)
    return 0.0, (sum(ys) / total if total > 0 else 0.0)


def same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Equal dimensions and layers; the name may differ (a config.json and a built-in can match)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("name"), db.pop("name")
    return da == db


def load_profile(path: str, model: ModelSpec | None = None) -> Profile:
    """Read and validate a profile; refuse one measured for another model or schema version."""
    profile = Profile.from_dict(read_json(path, "--profile"), "profile")
    if model is not None and not same_model(profile.model, model):
        raise InputError(f"--profile: '{path}' was measured for model '{profile.model.name}', "
                         f"not '{model.name}' (dimensions differ)")
    return profile


def save_profile(profile: Profile, path: str) -> None:
    write_atomic(path, json.dumps(profile.to_dict(), indent=2) + "\n")
