"""The training loop: builds this rank's part of the model from the plan, then steps AdamW with
gradient clipping (global norm over all shards and stages), warm-up + cosine learning rate, mixed
precision per the plan's dtype, metrics and checkpoints.

The loss of a step is the mean over the global batch whatever the plan: each micro-batch loss is a mean
over its tokens, the pipeline (scale_grads) and the plain loop divide by the number of micro-batches,
and FSDP/replicate average over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from meshplan.executor import checkpoint
from meshplan.executor.checks import check_supported
from meshplan.executor.context_parallel import apply_cp, cp_context, shard_sequence
from meshplan.executor.data import Shard as DataShard
from meshplan.executor.data import SyntheticData, TokenFile
from meshplan.executor.expert_parallel import apply_ep, balance_over_cp, expert_meshes
from meshplan.executor.metrics import Metrics, log, peak_memory_bytes, tensor_bytes, track_cpu_allocations
from meshplan.executor.model import Transformer
from meshplan.executor.moe import set_aux_loss_scale
from meshplan.executor.parallel_dims import ParallelDims, build_parallel_dims
from meshplan.executor.parallelize import TORCH_DTYPES, apply_ac, apply_dp, apply_tp, materialise, tp_loss
from meshplan.executor.pipeline import apply_pp, local_stages
from meshplan.planner.plan import Plan
from meshplan.planner.report import human_bytes
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

# The LM head's logits are a view (F.linear on 3-D input); nothing modifies them in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
FAIL_AT_STEP = "MESHPLAN_FAIL_AT_STEP"  # fault injection for tests: "STEP" or "STEP:RANK", first attempt only


@dataclass
class TrainConfig:
    steps: int = 10
    seed: int = 0
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: a tenth of the steps (at least 1)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    metrics: str | None = None
    plan_path: str | None = None  # named in the metrics summary, for `plan calibrate`
    data: str | None = None
    data_dtype: str = "uint16"
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 0  # 0: only at the end
    resume: bool = False
    log_interval: int = 1
    quiet: bool = False
    gc_interval: int = 50  # Python's collector runs every this many steps (torchtitan's default); 0: automatic


@contextlib.contextmanager
def collection_paused(paused: bool):
    """Python's automatic garbage collection off for the training loop (after one collection), as
    torchtitan trains; the loop collects every `gc_interval` steps itself. Automatic collections
    fire on allocation counts, and a pipeline step allocates many Python objects (one per action and
    micro-batch), so automatic collections land inside steps at random: they add to the step time and,
    when a full collection fires, make single steps several times slower."""
    was = gc.isenabled()
    if paused:
        gc.collect(1)
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step (step is 0-based)."""
    warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 10)
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases), as nanoGPT/torchtitan. One parameter
    group per (decay, device mesh), so that every group runs the foreach implementation: foreach cannot
    mix DTensors of different meshes, or DTensors and plain tensors, in one call, and the single-tensor
    loop dispatches through DTensor once per parameter and op, which costs several times the step of the
    same local tensors under foreach."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, p.device_mesh if isinstance(p, DTensor) else None), []).append(p)
    param_groups = [{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0}
                    for (decay, _), ps in groups.items()]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Reduce the gradients tensor parallelism leaves Partial (the sequence-parallel norms' weights: each
    TP rank holds the sum over its sequence shard) to Replicate, with one all-reduce per mesh dimension
    and dtype, before the norm and the step. Left Partial, every foreach AdamW op that reads such a
    gradient all-reduces it again (one collective per op and norm weight, every step), and `local_grads`
    would count each rank's partial sum instead of the total."""
    pending: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or not any(isinstance(x, Partial) for x in g.placements):
            continue
        partial = tuple((i, x.reduce_op) for i, x in enumerate(g.placements) if isinstance(x, Partial))
        if all(op in ("sum", "avg") for _, op in partial):
            pending.setdefault((g.device_mesh, partial, g.dtype), []).append(p)
        else:  # max / min: not what a gradient holds; DTensor's own reduction, one tensor at a time
            p.grad = g.redistribute(placements=_replicated(g.placements))
    for (mesh, partial, _), ps in pending.items():
        local = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, op in partial:
            dist.all_reduce(flat, group=mesh.get_group(dim))
            if op == "avg":
                flat /= mesh.size(dim)
        for p, t, part in zip(ps, local, flat.split([t.numel() for t in local])):
            g = p.grad
            p.grad = DTensor.from_local(part.view_as(t), mesh, _replicated(g.placements), run_check=False,
                                        shape=g.shape, stride=g.stride())


def _replicated(placements) -> list:
    """The placements with every Partial reduced to Replicate."""
    return [Replicate() if isinstance(x, Partial) else x for x in placements]


def local_grads(params: list[nn.Parameter], replicas: int, exclude: frozenset[int] = frozenset()
                ) -> dict[float, list[torch.Tensor]]:
    """Local gradient tensors grouped by their weight in the global norm: a shard held by k ranks counts
    1/k on each, so that summing over the world counts every distinct shard once. `exclude`: ids of
    parameters that are copies of another (a tied LM head on another stage), weight 0."""
    groups: dict[float, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        shards = 1
        if isinstance(g, DTensor):
            for dim, placement in enumerate(g.placements):
                if isinstance(placement, (Shard, _StridedShard)):  # FSDP over TP/EP-sharded dims: strided
                    shards *= g.device_mesh.size(dim)
            g = g.to_local()
        groups.setdefault(0.0 if id(p) in exclude else shards / replicas, []).append(g)
    return groups


def grad_norm_sq(groups: dict[float, list[torch.Tensor]]) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (all-reduce SUM it over the world)."""
    total = torch.zeros((), dtype=torch.float64)
    for weight, grads in groups.items():
        if weight == 0.0:
            continue
        norms = torch._foreach_norm(grads)
        total += torch.stack(norms).double().pow(2).sum().cpu() * weight
    return total


class LossScaler:
    """Dynamic loss scaling for fp16 (a no-op scale of 1 otherwise)."""

    def __init__(self, enabled: bool):
        self.scale = 2.0 ** 16 if enabled else 1.0
        self.enabled, self.good = enabled, 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = self.scale / 2, 0
        else:
            self.good += 1
            if self.good % 1000 == 0:
                self.scale *= 2


class Trainer:
    """One plan on an initialised default process group (several Trainers may share it, one after another)."""

    def __init__(self, plan: Plan, cfg: TrainConfig, device: torch.device):
        check_supported(plan)
        self.plan, self.cfg, self.device = plan, cfg, device
        self.dims: ParallelDims = build_parallel_dims(plan, device)
        p = plan.parallel
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.stage_plans = local_stages(plan, self.dims.pp_rank)
        self.modules = [self._build(s.layers, s.recompute_layers) for s in self.stage_plans]
        self.optims = [make_optimizer(m, cfg) for m in self.modules]
        self.params = [q for m in self.modules for q in m.parameters()]
        self.scaler = LossScaler(p.dtype == "fp16")
        self.tied_split = plan.model.tied_embeddings and len(plan.stages) > 1
        self.tied_group, self.tied_copies = self._tied_setup()
        self.loss, self.loss_context = tp_loss(self.modules[0], self.dims.mesh["tp"] if p.tp > 1 else None)
        self.schedule = apply_pp(plan, self.dims, self.modules, self._scaled_loss) if p.pp > 1 else None
        self.has_first = any(s.stage == 0 for s in self.stage_plans)
        self.has_last = any(s.stage == len(plan.stages) - 1 for s in self.stage_plans)
        self.autocast = p.dp * p.cp == 1 and p.dtype != "fp32"  # with dp > 1 FSDP's MixedPrecisionPolicy casts
        rows = p.micro_batch_size * p.num_micro_batches
        if cfg.data:
            source = TokenFile(cfg.data, cfg.data_dtype, plan.model.vocab_size, p.seq_len, p.global_batch_size)
        else:
            source = SyntheticData(plan.model.vocab_size, p.seq_len, p.global_batch_size, cfg.seed)
        self.data = DataShard(source, self.dims.dp_rank, rows)

    def _build(self, layers: list[int], recompute_layers: int) -> Transformer:
        p = self.plan.parallel
        with torch.device("meta"):
            model = Transformer(self.plan.model).keep_layers(*layers)
        if p.tp > 1:
            apply_tp(model, self.dims.mesh["tp"], p.sequence_parallel, expert_tp=p.expert_tp > 1,
                     experts_span_tp=p.experts_span_tp)
        if p.cp > 1:  # torchtitan's order: TP -> CP -> EP -> AC -> FSDP
            apply_cp(model, self.dims.mesh["cp"], p.cp_mode, p.seq_len)
            balance_over_cp(model, self.dims.mesh["cp"])  # MoE: the load-balancing loss over whole sequences
        ep_meshes = expert_meshes(self.dims.mesh, p) if p.ep > 1 else None
        if ep_meshes is not None:
            apply_ep(model, ep_meshes[0])
        apply_ac(model, p.recompute, recompute_layers)
        if p.dp * p.cp > 1:  # gradients averaged over dp x cp
            apply_dp(model, self.dims.dp_cp_mesh, p, edp_mesh=ep_meshes[1] if ep_meshes else None)
        materialise(model, self.device, self.cfg.seed)
        return model

    def _tied_setup(self) -> tuple[dist.ProcessGroup | None, frozenset[int]]:
        """A tied embedding/LM head split over pipeline stages (Megatron-LM): the last stage keeps its own
        copy of the weight, initialised alike; after backward the two gradients are summed between the
        first and last stage ranks of each (dp, tp) position, so both copies take identical steps. The
        copy is left out of the gradient norm."""
        plan, p = self.plan, self.plan.parallel
        if not plan.model.tied_embeddings or len(plan.stages) == 1:
            return None, frozenset()
        copies = frozenset(id(m.head.output.weight) for m in self.modules if m.head is not None)
        first, last = plan.stages[0].pp_rank, plan.stages[-1].pp_rank
        if first == last:  # V placement: both stages on this rank
            return None, copies
        grid, mine = self.dims.mesh.mesh, None
        for d in range(p.dp):
            for c in range(p.cp):
                for t in range(p.tp):
                    ranks = [int(grid[first, d, c, t]), int(grid[last, d, c, t])]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
        return mine, copies

    def _sync_tied(self) -> None:
        """Sum the two copies' gradients (as full tensors: the sides may be laid out differently, e.g.
        a vocab-parallel embedding's gradient comes back replicated) and write the sum into both."""
        if not self.tied_split:
            return
        grads = [m.embedding.tok.weight.grad for m in self.modules if m.embedding is not None]
        grads += [m.head.output.weight.grad for m in self.modules if m.head is not None]
        if not grads:
            return
        fulls = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
        total = fulls[0] + fulls[1] if len(fulls) == 2 else fulls[0].clone()
        if len(fulls) == 1:
            dist.all_reduce(total, group=self.tied_group)
        for g in grads:
            if isinstance(g, DTensor):
                g.to_local().copy_(distribute_tensor(total, g.device_mesh, g.placements, src_data_rank=None).to_local())
            else:
                g.copy_(total)

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, targets) * self.scaler.scale

    def _amp(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=TORCH_DTYPES[self.plan.parallel.dtype])

    def forward_backward(self, step: int) -> torch.Tensor:
        """Run one global batch; return this rank's mean loss (0 on ranks without the last stage)."""
        p = self.plan.parallel
        cp_mesh = self.dims.mesh["cp"] if p.cp > 1 else None
        # vocab-parallel loss: its forward and backward (entered once: not reentrant); ring CP: torch's ring SDPA
        with self.loss_context(), cp_context(cp_mesh, p.cp_mode, p.seq_len, self.device):
            return self._forward_backward(step)

    def _forward_backward(self, step: int) -> torch.Tensor:
        p = self.plan.parallel
        x, y = self.data.inputs_targets(step)
        x, y = x.to(self.device), y.to(self.device)
        x, y = shard_sequence(x, y, p.seq_len, p.cp, self.dims.cp_rank, p.cp_mode)  # this CP rank's tokens
        # the load-balancing loss's gradient takes the main loss's scale (executor/moe.py)
        set_aux_loss_scale(self.modules, self.scaler.scale / (1 if self.schedule is not None else p.num_micro_batches))
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (x,) if self.has_first else ()
            with self._amp():
                self.schedule.step(*args, target=y if self.has_last else None, losses=losses)
            if not self.has_last:
                return torch.zeros((), dtype=torch.float64)
            return torch.stack([v.detach().double() for v in losses]).mean().cpu() / self.scaler.scale
        model, n = self.modules[0], p.num_micro_batches
        total = torch.zeros((), dtype=torch.float64)
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
            if p.dp * p.cp > 1 and n > 1:
                if p.zero <= 1:  # accumulate full gradients locally; reduce once at the end (DDP's no_sync)
                    model.set_requires_gradient_sync(i == n - 1)
                # ZeRO-2/3 reduce-scatter every micro-batch: gradients stay sharded (planner.cost_collectives.grad_sync)
                if p.zero <= 2:  # below ZeRO-3 the parameters stay gathered until the last micro-batch
                    model.set_reshard_after_backward(i == n - 1)
            with self._amp():
                loss = self._scaled_loss(model(xm), ym) / n
            loss.backward()
            total += loss.detach().double().cpu()
        return total / self.scaler.scale

    def clip_and_step(self, step: int) -> float:
        """Global-norm clipping over every shard of every stage, then AdamW (skipped on fp16 overflow)."""
        p = self.plan.parallel
        reduce_partial_grads(self.params)  # before the tied sum and the norm: both read whole gradients
        self._sync_tied()
        groups = local_grads(self.params, p.dp * p.cp * p.tp, self.tied_copies)
        sq = grad_norm_sq(groups)
        if self.world > 1:
            sq = sq.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(sq)
        norm = math.sqrt(sq.item()) / self.scaler.scale
        finite = math.isfinite(norm)
        if finite:
            coef = min(1.0, self.cfg.grad_clip / (norm + 1e-6)) / self.scaler.scale
            if coef != 1.0:
                for grads in groups.values():
                    torch._foreach_mul_(grads, coef)
            lr = self.cfg.lr * lr_multiplier(step, self.cfg)
            for opt in self.optims:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
        self.scaler.update(finite)
        for opt in self.optims:
            opt.zero_grad(set_to_none=True)
        return norm

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step over the global batch of `step` (0-based): (global mean loss, grad norm)."""
        local = self.forward_backward(step)
        norm = self.clip_and_step(step)
        return self.global_loss(local), norm

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean over the global batch: the last stage's tp ranks all hold their dp shard's mean."""
        p = self.plan.parallel
        if self.world == 1:
            return float(local)
        t = local.to(self.device, copy=True)
        dist.all_reduce(t)
        return float(t) / (p.dp * p.cp * p.tp)

    def run(self) -> list[float]:
        """Train to cfg.steps; return the losses of the steps run here."""
        cfg, p, rank0 = self.cfg, self.plan.parallel, self.rank == 0
        start = self._maybe_resume()
        metrics = Metrics(cfg.metrics, rank0, keep_until_step=start if cfg.resume else None)
        tokens = p.global_batch_size * p.seq_len
        _, mem_source = peak_memory_bytes(self.device)
        log(rank0 and not cfg.quiet, f"executor: {self.world} ranks, mesh pp={p.pp} dp={p.dp} tp={p.tp}, "
            f"{len(self.plan.stages)} stages,\n  schedule {p.schedule}, zero {p.zero}, recompute {p.recompute}, "
            f"{p.dtype};\n  global batch {p.global_batch_size} x {p.seq_len} tokens; steps {start + 1}..{cfg.steps}")
        losses = []
        probe_step = start + 1 if self.device.type == "cpu" and cfg.steps - start >= 3 else None
        peak_tensor_bytes = None
        with collection_paused(cfg.gc_interval > 0):
            for step in range(start, cfg.steps):
                self._maybe_fail(step)
                probe = step == probe_step
                if probe:
                    baseline = tensor_bytes(self._state_tensors())
                t0 = time.perf_counter()
                if cfg.gc_interval and step > start and (step - start) % cfg.gc_interval == 0:
                    gc.collect(1)  # inside the timed step: its cost is the loop's
                with track_cpu_allocations() if probe else contextlib.nullcontext({}) as tracked:
                    loss, norm = self.train_step(step)
                dt = time.perf_counter() - t0
                if probe:
                    peak_tensor_bytes = self._max_over_ranks(baseline + tracked["peak"])
                mem = self._peak_memory()
                losses.append(loss)
                metrics.step(step + 1, loss, dt, tokens, mem, timed=not probe)
                if rank0 and not cfg.quiet and ((step + 1) % cfg.log_interval == 0 or step + 1 == cfg.steps):
                    # at most 80 columns (gnorm: the gradients' global norm before clipping, as fairseq logs it)
                    print(f"step {step + 1:>5} | loss {loss:.4f} | gnorm {norm:.3f} | {dt * 1e3:6.1f} ms | "
                          f"{tokens / dt:6.0f} tok/s | {human_bytes(mem)}", flush=True)
                if cfg.checkpoint_dir and cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0 \
                        and step + 1 < cfg.steps:
                    self._save(step + 1)
        if cfg.checkpoint_dir and cfg.steps > start:
            self._save(cfg.steps)
        summary = metrics.summary(self.plan.predicted.iteration_time_s, self.cfg.plan_path, peak_tensor_bytes)
        if rank0 and not cfg.quiet and losses:
            measured, predicted = summary["measured_iteration_time_s"], summary["predicted_iteration_time_s"]
            lines = [f"done: predicted {predicted:.4f} s/iter, measured {measured:.4f} s/iter (median after warm-up)"]
            if predicted > 0:
                lines.append(f"      measured/predicted {measured / predicted:.2f}")
            lines.append(f"      memory in the step lines: {mem_source}")
            if peak_tensor_bytes is not None:
                lines.append(f"      peak tensor memory {human_bytes(peak_tensor_bytes)} (step {probe_step + 1}, "
                             "every op tracked)")
            print("\n".join(lines), flush=True)
        return losses

    def _peak_memory(self) -> int:
        return self._max_over_ranks(peak_memory_bytes(self.device)[0])

    def _max_over_ranks(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor(value, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def _state_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradients and optimizer state alive between steps (what the probe's baseline counts)."""
        out = [q for q in self.params] + [q.grad for q in self.params if q.grad is not None]
        for opt in self.optims:
            for st in opt.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def _maybe_resume(self) -> int:
        if not (self.cfg.resume and self.cfg.checkpoint_dir):
            return 0
        found = checkpoint.latest(self.cfg.checkpoint_dir)
        if found is None:
            log(self.rank == 0 and not self.cfg.quiet, "executor: --resume: no complete checkpoint, starting at step 1")
            return 0
        path, meta = found
        checkpoint.load(path, self.modules, self.optims)
        if "loss_scale" in meta:
            self.scaler.scale = float(meta["loss_scale"])
        log(self.rank == 0 and not self.cfg.quiet, f"executor: resumed from {path} (step {meta['step']}, "
            f"data position {meta.get('data_position')})")
        return int(meta["step"])

    def _save(self, step: int) -> None:
        meta = {"data_position": self.data.source.position(step), "seed": self.cfg.seed,
                "loss_scale": self.scaler.scale, "model": self.plan.model.name,
                "parallel": {"dp": self.plan.parallel.dp, "tp": self.plan.parallel.tp, "pp": self.plan.parallel.pp}}
        path = checkpoint.save(self.cfg.checkpoint_dir, step, self.modules, self.optims, meta)
        log(self.rank == 0 and not self.cfg.quiet, f"executor: checkpoint {path}")

    def _maybe_fail(self, step: int) -> None:
        spec = os.environ.get(FAIL_AT_STEP)
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        at, _, rank = spec.partition(":")
        if step + 1 == int(at) and self.rank == int(rank or 0):
            print(f"executor: rank {self.rank} killed at step {step + 1} ({FAIL_AT_STEP})", flush=True)
            os._exit(1)
