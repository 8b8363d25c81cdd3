"""apply_cp: context parallelism (CP) over the plan's `cp` mesh dimension (DESIGN.md §3, §7).

Every CP rank holds one chunk of each sequence of its data-parallel batch; the weights are the same on
all of them (gradients are averaged over the flattened dp x cp mesh by FSDP2/replicate, as torchtitan
does). Three modes:

- all-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023): each rank holds a contiguous chunk of the
  sequence. Inside attention, one all-to-all per q, k, v swaps the split — sequence gathered, heads
  scattered over cp (so cp must divide the rank's key/value heads) — the local SDPA runs unchanged on the
  whole sequence and its share of heads, and one all-to-all brings the output back to the sequence split.
  The collectives are torch's autograd-aware functional ones (`all_to_all_single_autograd`), which run on
  gloo and NCCL alike. Rotary positions are the global positions of the local chunk.
- all-gather (Llama 3, Dubey et al. 2024 §3.3.2; Megatron-LM's --cp-comm-type allgather): each rank
  holds the head-tail chunks of the ring mode; inside attention k and v of every CP rank are gathered
  (torch's autograd-aware functional all-gather, whose backward reduce-scatters dK and dV) and the local
  SDPA runs each of the rank's two query chunks against the keys before it. Runs on gloo and NCCL alike.
- ring (Liu et al. 2023; Megatron-LM CP): torch's own
  `torch.distributed.tensor.experimental.context_parallel`, which replaces SDPA by ring attention. Each rank
  holds chunks c and 2·cp − 1 − c of 2·cp (the head-tail layout of torch's load balancer, which balances
  the causal work); the data is laid out here and `cp_context` checks torch's own sharding of the positions
  agrees. torch's ring attention has no CPU sharding strategy in torch 2.13 (DESIGN.md §7): a ring plan on
  gloo is refused before start (`check_cp_backend`). Not run in this repository's tests (no GPU in CI).

The loss of each CP rank is the mean over its chunk; chunks are equal, so the mean over the cp ranks
(what the gradient averaging and `Trainer.global_loss` take) is the mean over all tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from meshplan.executor.collectives import ALL_GATHER, ALL_GATHER_AUTOGRAD, wait
from meshplan.executor.regather import Gathered, is_paused, regathering, storage_of
from meshplan.planner.errors import InputError
from meshplan.planner.plan import Plan
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

# torch's rotate method for ring attention (torch.distributed.tensor.experimental._attention.set_rotate_method):
# "alltoall" passes each KV block to the next rank (a ring), what planner/cost_cp.py costs; "allgather"
# gathers all KV blocks up front.
RING_ROTATE_METHOD = "alltoall"


def check_cp_backend(plan: Plan, backend: str) -> None:
    """Refuse, before the process group exists, a CP plan this backend cannot run."""
    p = plan.parallel
    if p.cp > 1 and p.cp_mode == "ring" and backend != "nccl":
        raise InputError(f"plan.parallel.cp_mode: 'ring' context parallelism runs on torch's context_parallel, "
                         f"which has no CPU implementation in torch {torch.__version__.split('+')[0]}; on {backend} "
                         "re-plan with --cp-mode all-to-all (or run the plan on CUDA GPUs)")


def check_cp(plan: Plan) -> None:
    """What CP needs of the model and the sequence (executor/checks.py calls it before start)."""
    p, spec = plan.parallel, plan.model
    if p.cp == 1:
        return
    if obstacle := spec.cp_obstacle(p.seq_len):
        raise InputError(f"plan.parallel.cp: {spec.name} {obstacle}, which context parallelism does not run in this "
                         "executor; re-plan with --cp 1")
    if p.cp_mode == "all-to-all":
        for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads)):
            if n % (p.tp * p.cp):
                raise InputError(f"plan.parallel.cp: all-to-all context parallelism scatters heads: tp x cp = "
                                 f"{p.tp * p.cp} must divide the model's {what} = {n}")
    chunks = p.cp if p.cp_mode == "all-to-all" else 2 * p.cp
    per_chunk = p.seq_len // p.cp
    if p.seq_len % chunks or (p.sequence_parallel and per_chunk % p.tp):
        raise InputError(f"plan.parallel.seq_len: {p.seq_len} must be a multiple of "
                         f"{chunks if p.cp_mode == 'all-to-all' else '2 x cp = ' + str(chunks)}"
                         + (f" and of cp x tp = {p.cp * p.tp} (sequence parallel)" if p.sequence_parallel else ""))


def chunk_positions(seq_len: int, cp: int, cp_rank: int, mode: str) -> torch.Tensor:
    """Global positions of this CP rank's tokens: a contiguous chunk (all-to-all), or the head-tail pair
    of chunks c and 2·cp − 1 − c of 2·cp (ring and all-gather; torch's _HeadTailLoadBalancer lays them out
    the same), which gives every rank the same causal work."""
    if mode == "all-to-all":
        if seq_len % cp:
            raise InputError(f"plan.parallel.seq_len: {seq_len} must be a multiple of cp={cp}")
        n = seq_len // cp
        return torch.arange(cp_rank * n, (cp_rank + 1) * n)
    if seq_len % (2 * cp):
        raise InputError(f"plan.parallel.seq_len: {seq_len} must be a multiple of 2 x cp = {2 * cp} (ring "
                         "context parallelism splits it into 2 x cp load-balanced chunks)")
    n = seq_len // (2 * cp)
    head, tail = cp_rank * n, (2 * cp - 1 - cp_rank) * n
    return torch.cat([torch.arange(head, head + n), torch.arange(tail, tail + n)])


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[b, heads, s/cp, d] sequence-sharded -> [b, heads/cp, s, d] head-sharded (rank j gets head group j
    of every rank's chunk, concatenated in rank order = sequence order)."""
    b, heads, sl, d = x.shape
    send = x.reshape(b, cp, heads // cp, sl, d).transpose(0, 1).contiguous()  # [cp(dest), b, h/cp, sl, d]
    recv = wait(funcol.all_to_all_single_autograd(send, None, None, group))
    return recv.view(cp, b, heads // cp, sl, d).permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * sl, d)


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [b, heads/cp, s, d] -> [b, heads, s/cp, d]."""
    b, hl, s, d = x.shape
    sl = s // cp
    send = x.reshape(b, hl, cp, sl, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dest chunk), b, h/cp, sl, d]
    recv = wait(funcol.all_to_all_single_autograd(send, None, None, group))
    return recv.view(cp, b, hl, sl, d).transpose(0, 1).reshape(b, cp * hl, sl, d)


class UlyssesAttention:
    """The attention core under all-to-all CP: `__call__(core, q, k, v)` with q, k, v [b, heads, s/cp, d]
    (this rank's chunk, rotary applied at global positions) runs `core` (the block's SDPA, checkpointed
    under selective recompute) on [b, heads/cp, s, d] and returns its output on the chunk again."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.cp = cp_mesh.size()
        self.group = cp_mesh.get_group()

    def __call__(self, core: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for name, t in (("query", q), ("key/value", k)):
            if t.shape[1] % self.cp:
                raise ValueError(f"plan.parallel.cp: {self.cp} does not divide the rank's {t.shape[1]} {name} heads "
                                 "(all-to-all context parallelism scatters heads)")
        q, k, v = (_seq_to_heads(t, self.cp, self.group) for t in (q, k, v))
        return _heads_to_seq(core(q, k, v), self.cp, self.group)


class AllGatherAttention:
    """The attention core under all-gather CP: `__call__(core, q, k, v)` with q, k, v [b, heads, s/cp, d]
    (this rank's head-tail chunks c and 2·cp − 1 − c) gathers k and v over cp, puts them in sequence
    order, and runs `core` once per local chunk against the keys up to that chunk's end, causal aligned
    bottom-right (`causal_lower_right`: flash and memory-efficient kernels take it without a mask
    tensor), as Transformer Engine's AttnFuncWithCPAndKVAllGather splits the work.

    What the core saves of the gathered K and V for backward (under selective recompute: the checkpoint's
    inputs) is kept as the local chunk and gathered again, once per layer, when backward needs it
    (saved-tensor hooks), as Transformer Engine does (it saves the local k, v and gathers in backward):
    activations hold s/cp tokens of K and V, not s. Not in a block checkpointed whole (full recompute,
    `regather.paused`), whose recompute gathers again anyway."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int):
        self.cp = cp_mesh.size()
        self.group = cp_mesh.get_group()
        rank, n = cp_mesh.get_local_rank(), seq_len // (2 * self.cp)
        gathered = torch.cat([chunk_positions(seq_len, self.cp, r, "all-gather") for r in range(self.cp)])
        self.order = torch.argsort(gathered)  # gathered position of each sequence position
        self.ends = ((rank + 1) * n, (2 * self.cp - rank) * n)  # keys the head and the tail chunk attend to
        # made here, once: a CausalBias cannot be created under a TorchDispatchMode (the executor's CPU
        # memory probe)
        self.masks = tuple(causal_lower_right(n, end) for end in self.ends)
        self.regathers = 0  # gathers backward made (tests)

    def _full(self, x: torch.Tensor, autograd: bool = True) -> torch.Tensor:
        """K or V of the whole sequence, in sequence order, from this rank's chunks."""
        gather = ALL_GATHER_AUTOGRAD if autograd else ALL_GATHER
        out = wait(gather(x.contiguous(), 2, self.group))
        if self.order.device != out.device:
            self.order = self.order.to(out.device)
        return out.index_select(2, self.order)

    def __call__(self, core: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kf, vf = self._full(k), self._full(v)
        n = q.shape[2] // 2

        def attend() -> torch.Tensor:
            return torch.cat([core(q[:, :, i * n:(i + 1) * n], kf[:, :, :end], vf[:, :, :end], attn_mask=mask,
                                   is_causal=False) for i, (end, mask) in enumerate(zip(self.ends, self.masks))],
                             dim=2)

        if is_paused() or not torch.is_grad_enabled():
            return attend()
        sources = {storage_of(kf): Gathered(k.detach()), storage_of(vf): Gathered(v.detach())}

        def counted() -> None:
            self.regathers += 1

        with regathering(sources, partial(self._full, autograd=False), counted):
            return attend()


class RingAttention:
    """The attention core under ring CP on CUDA: torch's ring SDPA is patched in by `context_parallel`
    around the step (`cp_context`); grouped-query k and v are repeated to the query heads first, as
    torchtitan feeds torch's ring attention."""

    def __call__(self, core: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return core(q, k, v)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, mode: str, seq_len: int) -> None:
    """Context parallelism on one stage module (after TP, before AC and FSDP: torchtitan's order). Sets
    the global positions of this rank's tokens on the embedding (learned positions) and on every block's
    rotary, and the attention core's CP wrapper."""
    cp = cp_mesh.size()
    if cp == 1:
        return
    positions = chunk_positions(seq_len, cp, cp_mesh.get_local_rank(), mode)
    if mode == "all-gather":
        shared = AllGatherAttention(cp_mesh, seq_len)
    else:
        shared = UlyssesAttention(cp_mesh) if mode == "all-to-all" else RingAttention()
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        embedding.positions = positions
    for block in model.blocks.values():
        attention = block.attention
        attention.positions = positions
        attention.cp_attention = shared


def shard_sequence(x: torch.Tensor, y: torch.Tensor, seq_len: int, cp: int, cp_rank: int, mode: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's tokens of inputs and targets [rows, seq_len] (`chunk_positions`)."""
    if cp == 1:
        return x, y
    idx = chunk_positions(seq_len, cp, cp_rank, mode).to(x.device)
    return x.index_select(1, idx).contiguous(), y.index_select(1, idx).contiguous()


@contextlib.contextmanager
def cp_context(cp_mesh: DeviceMesh | None, mode: str, seq_len: int, device: torch.device):
    """Ring mode: a step under torch's `context_parallel` (ring SDPA patched in for forward and backward,
    rotate method RING_ROTATE_METHOD). Its buffer is the sequence's positions, which it shards in place with
    its load balancer: the shard must be `chunk_positions`, how `shard_sequence` laid out the tokens (checked,
    so that a change of torch's layout cannot go unnoticed). A null context otherwise."""
    if cp_mesh is None or cp_mesh.size() == 1 or mode != "ring":
        yield
        return
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(RING_ROTATE_METHOD)
    positions = torch.arange(seq_len, device=device)
    with context_parallel(cp_mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
        want = chunk_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), mode)
        if not torch.equal(positions.cpu(), want):
            raise RuntimeError("torch's context_parallel sharded the sequence otherwise than chunk_positions "
                               f"(rank {cp_mesh.get_local_rank()}: {positions.tolist()[:8]}...)")
        yield
