"""Cost terms of expert parallelism (EP, DESIGN.md §5) for mixture-of-experts models (ModelSpec.moe).

EP is carved out of the dp·cp ranks (DESIGN.md §3): each EP rank holds num_experts/ep experts, and in every
MoE block the routed tokens go to their experts' ranks and come back with two all-to-alls (dispatch,
combine) in forward and two in backward (Lepikhin et al. 2020, GShard §2.2; Megatron-Core MoE's alltoall
token dispatcher). How the MoE layer meets tensor parallelism (expert_tp) follows Megatron-Core and
torchtitan: with expert_tp = 1 each TP rank routes its own sequence shard (T/tp tokens) to whole experts;
with expert_tp = tp the experts' width is split over the TP group as well. Either way a rank's routed rows
are T·top_k/tp per micro-batch on average, T = b·s/cp its tokens, and the expert FLOPs per rank are
÷tp (profiler/moe_cost.py). meshplan's own executor (executor/expert_parallel.py) runs both as planned
under sequence parallelism; with expert_tp = 1 and without it, every TP rank holds the whole sequence and
runs the MoE replicated over TP: its tp ranks repeat the MoE's work, which this model does not charge.

Terms, per MoE block and micro-batch (a model's "block" is the mean over its dense and sparse blocks, so
each term is weighted by the sparse fraction):
- All-to-all: 4 per block (dispatch + combine, forward and backward; full recompute replays the forward
  two), each moving imbalance · (T/tp) · top_k · h values per rank (T · top_k · h for an engine that gathers
  the sequence before routing under expert TP, below), (ep − 1)/ep of it off the rank: an
  all-to-all over n ranks runs with the all-gather's bus factor (n − 1)/n (nccl-tests PERFORMANCE.md), as
  planner/cost_cp.all_to_all_time times it, on the link class of the EP group as placed (intra-node when
  the ep ranks share an NVLink domain; across domains each rank's chunks for its own domain take NVLink
  and the rest its NIC). On the critical path: the dispatcher waits for its
  tokens (Megatron-Core overlaps only the shared experts, which this model ignores).
- Tensor parallelism (the block is charged the dense MLP's all-gather and reduce-scatter of b·s·h, planner/
  cost_collectives.tp_comm_time; `moe_tp_comm_time` is what a MoE block's differ by): with expert_tp = 1 under
  sequence parallelism the MoE takes the rank's sequence shard and runs no TP collective (Megatron-Core's
  shared experts still gather and reduce-scatter the sequence). With expert_tp = tp it depends on the
  software (profiler/roofline.MOE_DISPATCH): Megatron-Core and the executor dispatch the rank's shard, then
  all-gather the received rows over TP and reduce-scatter the experts' output, imbalance · T·top_k·h values
  each way instead of T·h; an engine that gathers the sequence first dispatches all T tokens' rows from
  every TP rank (T·top_k per all-to-all, not T/tp), its TP collectives the dense MLP's.
- Load imbalance: the busiest EP rank receives `imbalance` times the mean rows; its all-to-alls and its
  grouped GEMMs set the pace. Default DEFAULT_IMBALANCE = 1.25, the capacity factor that Switch Transformer
  (Fedus et al. 2022, §2.2 and Table 1: 1.0-1.25 as the useful range) and GShard (Lepikhin et al. 2020,
  §2.2, expert capacity) size an expert's buffer with: under a load-balancing loss a dropless router's
  busiest expert stays near the load a capacity-factor router accepts. Settable (`plan --moe-imbalance`).
- Grouped GEMM: the rank's E/ep experts run as one grouped GEMM (Megatron-Core --moe-grouped-gemm) of
  E/ep GEMMs with imbalance · T·top_k·ep/E rows each; on GPU presets the roofline's tile and wave
  quantisation of those small GEMMs is their efficiency (profiler/moe_cost.moe_ffn_time). Measured
  profiles time the executor's MoE at ep = 1; EP then scales the routed experts' share by the imbalance.
- Memory: a MoE block's routed experts ÷ (ep · expert_tp) per rank instead of ÷ tp; their gradients and
  optimizer state sharded by ZeRO over the expert-data-parallel ranks dp·cp/ep (DESIGN.md §3), the rest
  of the block over dp·cp; their gradient reduction runs over those edp ranks, on their links as placed
  (`edp_link`: every ep-th rank, so ep 8 inside 8-GPU nodes leaves one per node). Token buffers at the
  block's peak: the received rows and the combine's output, 2 · imbalance · (T/tp)·top_k·h values (T·top_k·h
  under expert TP, gathered over TP). Activations: the closed forms divide a MoE block's by tp
  (profiler/moe_cost.block_ffn_activation_values); under expert TP the rows an expert multiplies are whole
  on every TP rank, so the experts' input rows (imbalance · T·top_k·h) stay whole as the expert GEMMs save
  them, and where the sequence is gathered before routing also the experts' partial-sum output, which the
  routing weights' gradient reads: (1 − 1/tp) of them more (`whole_rows_bytes`).
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.planner.candidate import Candidate, Links
from meshplan.planner.cost_collectives import (
    GradSync,
    dp_reduction_times,
    engine_copy_time,
    gather_bytes,
    optimizer_time,
    sharded_dp_time,
    tp_exchange_time,
)
from meshplan.planner.cost_compute import compute_time
from meshplan.planner.cost_cp import CPTerms, all_to_all_time
from meshplan.planner.cost_memory import Workspace, state_bytes
from meshplan.planner.cost_model import Terms
from meshplan.planner.model_spec import ModelSpec, expert_params, is_sparse_block
from meshplan.planner.plan import ep_fits
from meshplan.planner.topology import spread_class
from meshplan.profiler.analytic import DTYPE_BYTES, layer_forward_flops
from meshplan.profiler.moe_cost import moe_ffn_time, routed_mats, sparse_fraction

# Busiest EP rank's routed rows over the mean (module docstring: Fedus et al. 2022's capacity factor 1.25).
DEFAULT_IMBALANCE = 1.25


def is_moe(model: ModelSpec) -> bool:
    return model.moe is not None


def spans_tp(ep: int, tp: int, expert_tp: int) -> bool:
    """EP folded over TP (ParallelConfig.experts_span_tp; the planner's plans with tp > 1 run sequence
    parallelism): expert_tp 1, each TP rank routing its own sequence shard to the EP group it is in."""
    return ep > 1 and tp > 1 and expert_tp == 1


def ep_sizes(dp: int, cp: int, tp: int, expert_tp: int, num_experts: int) -> list[int]:
    """The ep degrees a mesh allows: expert_tp = tp (or tp 1), a divisor of dp·cp; expert_tp 1 under TP,
    1 or tp times a divisor of dp·cp (EP groups of whole TP groups, Megatron-Core's folding as the executor
    runs it); each a divisor of the expert count."""
    return [d for d in range(1, min(num_experts, dp * cp * tp) + 1)
            if num_experts % d == 0 and ep_fits(d, dp, cp, tp, spans_tp(d, tp, expert_tp))]


def ep_options(model: ModelSpec, dp: int, cp: int, tp: int, ep_pin: int | None, etp_pin: int | None
               ) -> list[tuple[int, int]]:
    """(ep, expert_tp) pairs the search tries for a mesh (`ep_sizes`); expert_tp 1 or tp (tp must divide the
    experts' width). A dense model: (1, 1) only (no enumeration, so dense planning speed is unchanged).
    Every schedule takes any ep: under zero-bubble the input pass runs the all-to-alls' backward."""
    if model.moe is None:
        return [(1, 1)]
    etps = [1] + ([tp] if tp > 1 and model.moe.expert_ffn_hidden_size % tp == 0 else [])
    return [(ep, etp) for etp in etps for ep in ep_sizes(dp, cp, tp, etp, model.moe.num_experts)
            if (ep_pin is None or ep == ep_pin) and (etp_pin is None or etp == etp_pin)]


def _expert_group_links(placer, cand: Candidate) -> tuple[str, str]:
    """(EP group's, expert-data-parallel group's) link classes as placed, each with its fewest members per
    NVLink domain when it spans domains (topology.spread_class), from one grid of the candidate's ranks: the
    dp·cp ranks of each (pp, tp) position, dp-major and cp-minor, cut into runs of ep (or folded over TP the
    dp·cp·tp ranks of each pp position), executor/expert_parallel.expert_meshes's (edp, ep) layout."""
    memo = placer.__dict__.setdefault("_expert_links", {})
    key = (cand.pp, cand.dp, cand.tp, cand.order, cand.cp, cand.ep, spans_tp(cand.ep, cand.tp, cand.expert_tp))
    if key not in memo:
        ranks = placer.place(cand.pp, cand.dp, cand.tp, cand.order, cand.cp).ranks  # [pp, dp, cp, tp]
        if spans_tp(cand.ep, cand.tp, cand.expert_tp):  # runs of ep over the flattened dp, cp, tp
            grid = ranks.reshape(cand.pp, cand.dp * cand.cp * cand.tp // cand.ep, cand.ep, 1)
        else:
            grid = ranks.reshape(cand.pp, cand.dp * cand.cp // cand.ep, cand.ep, cand.tp)
        domains, sus = placer.domains[grid], placer.sus[grid]
        memo[key] = spread_class(domains, sus, 2), spread_class(domains, sus, 1)
    return memo[key]


def ep_link(placer, cand: Candidate) -> str:
    """Link class of the worst EP group as placed, with its fewest members per NVLink domain when it spans
    domains ("inter_node/8", cost_cp.all_to_all_time): a run of ep ranks (`_expert_group_links`)."""
    return _expert_group_links(placer, cand)[0] if cand.ep > 1 else "intra_node"


def edp_link(placer, cand: Candidate) -> str:
    """Link class of the worst expert-data-parallel group as placed (the ranks holding the same experts, over
    which ZeRO shards them and their gradients are reduced: every ep-th rank of the runs `ep_link` cuts), with
    its fewest members per NVLink domain when it spans domains ("inter_node/2": NCCL reduces inside each domain
    first and that many NICs carry the rest, Profile.collective_time), as Links.dp_cp_group for the dp x cp
    group. ep 8 inside each 8-GPU node: one member per node, every byte through one NIC."""
    return _expert_group_links(placer, cand)[1]


def links_with_ep(placer, cand: Candidate, links: Links) -> Links:
    return replace(links, ep=ep_link(placer, cand), edp=edp_link(placer, cand)) if cand.ep > 1 else links


def local_tokens(b: int, s: int, cp: int) -> float:
    return float(b * (s // cp))


def sharded_dispatch(profile) -> bool:
    """Each TP rank dispatches its sequence shard under expert TP (roofline.MOE_DISPATCH "sharded": Megatron-Core
    and the executor, whose measured profiles these are too)."""
    r = getattr(profile, "roofline", None)
    return r is None or r.moe_dispatch == "sharded"


def dispatch_shard(profile, tp: int, expert_tp: int) -> int:
    """What a rank's tokens are divided by to get those it dispatches: tp (its sequence shard), or 1 for an
    engine that gathers the sequence before routing under expert TP (roofline.MOE_DISPATCH "gathered")."""
    return 1 if expert_tp == tp > 1 and not sharded_dispatch(profile) else tp


def moe_tp_comm_time(profile, model: ModelSpec, tokens: float, tp: int, ep: int, expert_tp: int, dtype: str,
                     imbalance: float) -> float:
    """Seconds per direction (forward; backward moves the same) by which a MoE block's TP collectives
    differ from the dense MLP's all-gather + reduce-scatter of T·h that tp_comm_time charges every block
    (module docstring; each an exchange as `tp_exchange_time` charges it). `tokens` = T, the micro-batch's
    b·s/cp."""
    if tp <= 1 or model.moe is None or profile.tp_collectives_measured("block", tp):
        return 0.0
    dense = tokens * model.hidden_size * DTYPE_BYTES[dtype]
    mlp = tp_exchange_time(profile, dense, tp)  # the dense MLP's, which every block is charged
    sharded = sharded_dispatch(profile)
    shared = mlp if sharded and model.moe.num_shared_experts else 0.0
    if expert_tp != tp:  # expert_tp 1: the MoE takes the sequence shard
        routed = 0.0
    elif sharded:  # the received rows gathered over TP, the experts' output reduce-scattered
        routed = tp_exchange_time(profile, model.moe.top_k * (imbalance if ep > 1 else 1.0) * dense, tp)
    else:
        routed = mlp
    return routed + shared - mlp


def dispatch_bytes(model: ModelSpec, tokens: float, tp: int, dtype: str, imbalance: float) -> float:
    """Bytes one all-to-all moves per rank (the busiest): imbalance · (T/tp) · top_k · h values."""
    assert model.moe is not None
    return imbalance * tokens / tp * model.moe.top_k * model.hidden_size * DTYPE_BYTES[dtype]


def ep_comm_time(profile, model: ModelSpec, tokens: float, tp: int, ep: int, dtype: str, link: str,
                 imbalance: float) -> tuple[float, float]:
    """(forward, backward) all-to-all seconds of one MoE block per micro-batch: dispatch + combine each way."""
    if ep <= 1 or model.moe is None:
        return 0.0, 0.0
    one = all_to_all_time(profile, dispatch_bytes(model, tokens, tp, dtype, imbalance), ep, link)
    k = profile.correction("ep_comm") if hasattr(profile, "correction") else 1.0
    return 2.0 * one * k, 2.0 * one * k


def expert_compute_delta(profile, model: ModelSpec, b: int, s: int, tp: int, ep: int, expert_tp: int,
                         imbalance: float) -> tuple[float, float]:
    """(forward, backward) seconds to add to the profile's MoE block (timed at ep = 1, balanced) for the
    busiest EP rank. GPU presets: the roofline's grouped GEMMs at this ep and imbalance, less at ep = 1.
    Measured / FLOP profiles: the routed experts' FLOP share of the block times (imbalance − 1)."""
    phi = sparse_fraction(model)
    rl = getattr(profile, "roofline", None)
    tokens = float(b * s)
    if rl is not None:
        shard = tp if expert_tp == tp else 1
        tok = tokens if expert_tp == tp else tokens / tp  # etp = 1: the rank routes its sequence shard
        nf, nb = moe_ffn_time(rl, model, tok, tp if expert_tp == tp else 1, ep, shard, imbalance)
        bf, bb = moe_ffn_time(rl, model, tokens, tp)
        k = profile.correction("compute")
        return phi * (nf - bf) * k, phi * (nb - bb) * k
    fwd, bwd = compute_time(profile, "block", b, s, tp)
    total = layer_forward_flops(model, "block", b, s, tp)
    share = phi * 2.0 * b * s * routed_mats(model) / tp / total if total > 0 else 0.0
    return fwd * share * (imbalance - 1.0), bwd * share * (imbalance - 1.0)


def token_buffer_bytes(model: ModelSpec, tokens: float, tp: int, ep: int, dtype: str, imbalance: float) -> float:
    """Transient bytes of a MoE block at its peak: the received rows and the combined output."""
    if model.moe is None:
        return 0.0
    return 2.0 * dispatch_bytes(model, tokens, tp, dtype, imbalance if ep > 1 else 1.0)


class _EPMixin:
    """Terms of a MoE model's candidate (any ep): blocks carry the EP all-to-alls in their communication
    value and the busiest rank's expert compute; per-layer state and gradient sync split experts from the
    rest. Mixed into Terms, or into CPTerms when cp > 1 (so CP's own terms stay)."""

    ep: int
    expert_tp: int
    ep_link: str
    imbalance: float

    def _setup(self, base: Terms, ep: int, expert_tp: int, link: str, imbalance: float, edp_link: str) -> None:
        self.ep, self.expert_tp, self.ep_link, self.imbalance = ep, expert_tp, link, imbalance
        self.edp_link = edp_link  # "": the dp x cp group's
        # the per-parameter terms depend on no candidate's CP or EP link: memoised on the root Terms, shared
        self.root = getattr(base, "root", base)

    def _cp(self) -> int:
        return getattr(self, "cp", 1)

    def ep_comm(self, b: int, tp: int) -> tuple[float, float]:
        """(forward, backward) all-to-all seconds of the mean block per micro-batch."""
        def make():
            tokens = local_tokens(b, self.s, self._cp())
            f, g = ep_comm_time(self.profile, self.model, tokens, dispatch_shard(self.profile, tp, self.expert_tp),
                                self.ep, self.dtype, self.ep_link, self.imbalance)
            phi = sparse_fraction(self.model)
            return phi * f, phi * g
        return self._get(("ep comm", b, tp), make)

    def moe_tp(self, b: int, tp: int) -> float:
        """Seconds per direction the mean block's TP collectives differ from a dense block's (`moe_tp_comm_time`)."""
        return self._get(("moe tp", b, tp), lambda: sparse_fraction(self.model) * moe_tp_comm_time(
            self.profile, self.model, local_tokens(b, self.s, self._cp()), tp, self.ep, self.expert_tp,
            self.dtype, self.imbalance))

    def kind(self, kind: str, b: int, tp: int, schedule: str = "1f1b") -> tuple[float, float, float, float]:
        row = super().kind(kind, b, tp, schedule)
        if kind != "block":
            return row

        def make():
            f, g, c, a = row
            df, dg = self.compute_delta(b, tp)
            return f + df, g + dg, c + sum(self.ep_comm(b, tp)) + 2 * self.moe_tp(b, tp), \
                a + self.whole_rows_bytes(b, tp)
        return self._get(("ep kind", b, tp, schedule == "zero-bubble"), make)

    def whole_rows_bytes(self, b: int, tp: int) -> float:
        """Activation bytes of the mean block beyond the closed forms' ÷tp under expert TP (module docstring);
        memoised: every candidate's recompute asks for it."""
        if self.model.moe is None or not self.expert_tp == tp > 1:
            return 0.0

        def make():
            copies = 1 if sharded_dispatch(self.profile) else 2
            rows = (self.imbalance if self.ep > 1 else 1.0) * local_tokens(b, self.s, self._cp()) * self.model.moe.top_k
            return (sparse_fraction(self.model) * copies * rows * self.model.hidden_size * DTYPE_BYTES[self.dtype]
                    * (1 - 1 / tp))
        return self._get(("whole rows", b, tp), make)

    def compute_delta(self, b: int, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds the busiest EP rank's experts add to the profile's block."""
        return self._get(("ep delta", b, tp), lambda: expert_compute_delta(
            self.profile, self.model, b, self.s // self._cp(), tp, self.ep, self.expert_tp, self.imbalance))

    def recompute(self, b: int, tp: int, mode: str) -> tuple[float, float, float]:
        """Full recompute replays the block's forward, its experts' delta, dispatch and combine and the MoE's
        forward TP collectives included."""
        rec, saving, rec_tp = super().recompute(b, tp, mode)
        if mode == "none" or not self.model.num_layers:
            return rec, saving, rec_tp
        if mode != "full":  # the saving counts the whole rows the block kept; only full recompute drops them
            saving -= self.whole_rows_bytes(b, tp)
        if not isinstance(self, CPTerms):  # Terms.recompute subtracts the block's whole communication value
            bias = sum(self.ep_comm(b, tp)) + 2 * self.moe_tp(b, tp)  # from the dense block's: give it back
            rec, rec_tp = rec + bias, rec_tp + bias
        if mode == "full":
            rec += self.ep_comm(b, tp)[0] + self.compute_delta(b, tp)[0] + self.moe_tp(b, tp)
            rec_tp += self.moe_tp(b, tp)
        return rec, saving, rec_tp

    def side_comm(self, b: int, tp: int, mode: str) -> dict[str, tuple[float, float]]:
        """The mean block's dispatch and combine, and the forward ones again under full recompute."""
        out = super().side_comm(b, tp, mode)
        if self.ep > 1:
            f, g = self.ep_comm(b, tp)
            out["ep"] = (f + g, f if mode == "full" else 0.0)
        return out

    def per_layer(self, tp: int, dp: int, zero: int, link: str, sync: GradSync = GradSync(False, 1)
                  ) -> tuple[list, list, list, list, list]:
        """`dp` = dp·cp. A MoE block: experts ÷ (ep·expert_tp), ZeRO and gradient sync over their
        expert-data-parallel ranks, dp·cp/ep (dp·cp·tp/ep folded over TP) on those ranks' links (`edp_link`);
        the rest as Terms.per_layer."""
        elink = self.edp_link or link

        def make():
            base = self.root.per_layer(tp, dp, zero, link, sync)
            out = tuple(list(x) for x in base)
            model = self.model
            edp = max(1, dp * (tp if spans_tp(self.ep, tp, self.expert_tp) else 1) // self.ep)
            experts = model.moe.num_experts * expert_params(model)
            ex = experts / (self.ep * self.expert_tp)
            bytes_dp = sum(state_bytes(self.profile, self.dtype, zero, dp, sync.full_grads))
            bytes_edp = sum(state_bytes(self.profile, self.dtype, zero, edp, sync.full_grads))
            in_situ = dp > 1 and self.profile.wrapper(zero) is not None
            by_params: dict[float, tuple] = {}  # sparse blocks repeat
            for i, layer in enumerate(model.layers):
                if layer.kind != "block" or not is_sparse_block(model, int(layer.name.split(".")[-1])):
                    continue
                if layer.params not in by_params:
                    rest = (layer.params - experts) / tp
                    g = gather_bytes(self.profile, self.dtype, zero, True)
                    tail_r, reduce_r = dp_reduction_times(self.profile, rest, self.dtype, dp, zero, link, sync, g)
                    tail_e, reduce_e = dp_reduction_times(self.profile, ex, self.dtype, edp, zero, elink, sync, g)
                    by_params[layer.params] = (
                        rest * bytes_dp + ex * bytes_edp,
                        optimizer_time(self.profile, rest, dp, zero, tp)
                        + optimizer_time(self.profile, ex, edp, zero, tp)
                        + engine_copy_time(self.profile, rest, self.dtype, dp, zero, sync)
                        + engine_copy_time(self.profile, ex, self.dtype, edp, zero, sync),
                        tail_r + tail_e,
                        None if in_situ else sharded_dp_time(self.profile, rest, self.dtype, dp, zero, link, g)
                        + sharded_dp_time(self.profile, ex, self.dtype, edp, zero, elink, g), reduce_r + reduce_e)
                state, opt, sync_s, per_mb, reduce = by_params[layer.params]
                out[0][i], out[1][i], out[2][i], out[4][i] = state, opt, sync_s, reduce
                if per_mb is not None:
                    out[3][i] = per_mb
            return out
        return self.root._get(("ep layer", self.ep, self.expert_tp, tp, dp, zero, link, elink, sync), make)


class EPTerms(_EPMixin, Terms):
    def __init__(self, base: Terms, ep: int, expert_tp: int, link: str, imbalance: float, edp_link: str = ""):
        Terms.__init__(self, base.model, base.profile, base.s, base.dtype)
        self._setup(base, ep, expert_tp, link, imbalance, edp_link)


class EPCPTerms(_EPMixin, CPTerms):
    def __init__(self, base: CPTerms, ep: int, expert_tp: int, link: str, imbalance: float, edp_link: str = ""):
        CPTerms.__init__(self, base, base.cp, base.mode, base.link)
        self._setup(base, ep, expert_tp, link, imbalance, edp_link)


def ep_terms(terms: Terms, cand: Candidate, link: str, imbalance: float = DEFAULT_IMBALANCE,
             edp_link: str = "") -> Terms:
    """The Terms of a MoE model's candidate (`terms` itself for a dense model), memoised on `terms`.
    `link`: the EP group's (`ep_link`); `edp_link`: the expert-data-parallel group's ("": the dp x cp one's)."""
    if terms.model.moe is None:
        return terms
    key = ("ep terms", cand.ep, cand.expert_tp, link, imbalance, edp_link)
    cls = EPCPTerms if isinstance(terms, CPTerms) else EPTerms
    return terms._get(key, lambda: cls(terms, cand.ep, cand.expert_tp, link, imbalance, edp_link))


def add_ep_buffers(ws: Workspace, model: ModelSpec, cand: Candidate, s: int, dtype: str,
                   imbalance: float = DEFAULT_IMBALANCE) -> Workspace:
    """The step's transients with a MoE block's token buffers at every rank's activation peak."""
    if model.moe is None:
        return ws
    # under expert TP a rank holds all T·top_k rows: gathered over TP after the dispatch, or dispatched whole
    shard = 1 if cand.expert_tp == cand.tp > 1 else cand.tp
    extra = token_buffer_bytes(model, local_tokens(cand.b, s, cand.cp), shard, cand.ep, dtype, imbalance)
    return Workspace([x + extra for x in ws.act], ws.emb, ws.opt, ws.per_layer)
