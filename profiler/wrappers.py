"""What the executor's data-parallel engines add to every micro-batch and to every optimizer step.

FSDP2 (`fully_shard`, ZeRO ≥ 1) and `replicate` (ZeRO-0) run Python hooks around each wrapped unit's
forward and backward, and keep parameters as DTensors, so AdamW dispatches through DTensor. On small
layers or on CPU these costs are of the order of the layer's own compute per unit and micro-batch, and
no layer micro-benchmark sees them.
This phase times the model cut to `blocks` blocks (embedding and head kept: the root unit) bare and
wrapped exactly as `executor.parallelize.apply_dp` wraps it, over a data-parallel mesh of all the ranks:
on gradient-accumulation micro-batches (hooks, and ZeRO-3's parameter gathers), on synchronising ones
(plus the gradient reduction, exposed as it is on this device), and AdamW over the wrapped parameters.
Collectives inside the engines cost far more than the bare link fit on CPU (copy-in/out, waiting for
the slower rank): the profile keeps their in-situ cost relative to the link fit.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist
from meshplan.executor.model import loss_fn
from meshplan.executor.parallelize import tp_loss
from meshplan.planner.model_spec import ModelSpec, wrapped_unit_params
from meshplan.profiler.compute import TimingConfig, median, typical_time
from meshplan.profiler.layers import TORCH_DTYPES
from meshplan.profiler.profile import ENGINES, ChainSample, WrapperSample

ENGINE_ZERO = dict(zip(ENGINES, (0, 1, 3)))  # the ZeRO level each engine is measured at


def _model(spec: ModelSpec, blocks: int, device: torch.device, dtype: str, mesh=None, zero: int = 0,
           tp_mesh=None):
    """The model cut to its embedding, first `blocks` blocks and head; wrapped as the executor wraps a
    stage when `mesh` is given; tensor-parallel over `tp_mesh` (sequence parallel, untied like the
    per-layer TP samples) when that is given."""
    from meshplan.executor.model import Transformer
    from meshplan.executor.parallelize import apply_dp, apply_tp, materialise
    from meshplan.planner.plan import ParallelConfig

    with torch.device("meta"):
        model = Transformer(replace(spec, tied_embeddings=False) if tp_mesh is not None else spec)
    for name in list(model.blocks.keys())[blocks:]:  # embedding, the first `blocks` blocks, head
        del model.blocks[name]
    if mesh is not None:
        cfg = ParallelConfig(dp=mesh.size(), tp=1, pp=1, virtual_stages=1, zero=zero, schedule="1f1b",
                             micro_batch_size=1, num_micro_batches=1, global_batch_size=mesh.size(), seq_len=1,
                             recompute="none", dtype=dtype)
        apply_dp(model, mesh, cfg)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=True)
    materialise(model, device, seed=0)
    if mesh is None:
        model = model.to(TORCH_DTYPES[dtype])
    return model


def _pass_time(model, b: int, s: int, spec: ModelSpec, device: torch.device, cfg: TimingConfig,
               sync: bool | None = None, zero: int = 0, tp_mesh=None) -> float:
    """Typical forward + backward seconds of a pass (a fixed count: wrapped ranks run them in lockstep).
    sync=False: gradient-accumulation micro-batches as the executor runs them (nothing reduced; below
    ZeRO-3 parameters stay gathered); sync=True: every pass reduces its gradients (the last micro-batch)."""
    return _pass_times(model, b, s, spec, device, cfg, sync, zero, tp_mesh)[0]


def _pass_times(model, b: int, s: int, spec: ModelSpec, device: torch.device, cfg: TimingConfig,
                sync: bool | None = None, zero: int = 0, tp_mesh=None) -> tuple[float, float]:
    """`_pass_time` and the mean process CPU seconds of the same timed passes."""
    if sync is not None:
        model.set_requires_gradient_sync(sync)
        if zero <= 2:
            model.set_reshard_after_backward(sync)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)
    targets = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)
    loss, context = tp_loss(model, tp_mesh)  # the executor's loss

    def one() -> None:
        with context():
            loss(model(tokens), targets).backward()
    for _ in range(cfg.warmup):
        one()
    c0 = time.process_time()
    wall = typical_time(one, device, 0, cfg.repeats)
    return wall, (time.process_time() - c0) / cfg.repeats


def _optimizer_time(model, device: torch.device, cfg: TimingConfig, executors: bool = False) -> float:
    """AdamW step seconds: the bare reference as profiler.measure times optimizer_s_per_param (foreach
    over plain tensors, random gradients), or with `executors` the wrapped model's optimizer as the executor
    builds it (executor.train.make_optimizer: foreach per parameter group, through DTensor), on the
    gradients the model's passes left (tensor parallelism's Partial ones reduced first, as the executor
    does; each timed step starts from them again)."""
    from meshplan.executor.train import TrainConfig, make_optimizer, reduce_partial_grads

    params = list(model.parameters())
    for p in params:  # random, not zero, gradients: on CPU AdamW's time depends on the values (zeros are slower)
        if not executors:
            p.grad = torch.randn_like(p)
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
    if not executors:
        return typical_time(torch.optim.AdamW(params, lr=1e-4, foreach=True).step, device, cfg.warmup, cfg.repeats)
    grads = [p.grad for p in params]
    opt = make_optimizer(model, TrainConfig())

    def step() -> None:
        reduce_partial_grads(params)
        opt.step()

    def restore() -> None:
        for p, g in zip(params, grads):
            p.grad = g
    return typical_time(step, device, cfg.warmup, cfg.repeats, between=restore)


def _tp_optimizer_ratio(model, device: torch.device, cfg: TimingConfig) -> float:
    """The executor's AdamW step over the tensor-parallel model's DTensor parameters (after its passes,
    so with the gradients' real placements), over the same step on plain tensors of the local shards'
    sizes: what the DTensor dispatch and the Partial gradients' reduction add (every rank of the TP
    group calls this together)."""
    from torch.distributed.tensor import DTensor

    executors = _optimizer_time(model, device, cfg, executors=True)
    local = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros_like(p.to_local() if isinstance(p, DTensor) else p))
                                   for p in model.parameters())
    return executors / max(_optimizer_time(local, device, cfg), 1e-12)


def _hook_seconds(bare_s: float, accumulate_s: float, bare_cpu: float, accumulate_cpu: float, units: int,
                  cpu_bound: bool) -> float:
    """Per unit and micro-batch: what the engine's hooks add. Where the hooks only compute (no collective
    on accumulation micro-batches: ZeRO-0 to 2) and the ranks share CPU cores, from the passes' process
    CPU time, at the bare pass's own wall over CPU ratio (the share of a core each rank got): the
    difference of two wall times of short passes on ranks time-sliced over fewer cores swings by more
    than the hooks cost, while the CPU-time difference stays within a small range; otherwise, and on
    GPUs, from the wall times."""
    if cpu_bound and bare_cpu > 0:
        return max(0.0, accumulate_cpu - bare_cpu) / units * max(1.0, bare_s / bare_cpu)
    return max(0.0, accumulate_s - bare_s) / units


def measure_wrappers(spec: ModelSpec, b: int, s: int, dtype: str, device: torch.device, cfg: TimingConfig,
                     blocks: int = 2) -> list[WrapperSample]:
    """Every rank of the default group calls this together; the samples are the same on all (each
    figure the median over the ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    blocks = max(1, min(blocks, spec.num_layers))
    units = blocks + 1
    bare = _model(spec, blocks, device, dtype)
    on_cpu = device.type == "cpu"
    bare_s, bare_cpu = _pass_times(bare, b, s, spec, device, cfg)
    bare_opt = _optimizer_time(bare, device, cfg)
    samples = []
    for engine in ENGINES:
        zero = ENGINE_ZERO[engine]
        dist.barrier()
        model = _model(spec, blocks, device, dtype, mesh, zero=zero)
        accumulate, acc_cpu = _pass_times(model, b, s, spec, device, cfg, sync=False, zero=zero)
        synced = _pass_time(model, b, s, spec, device, cfg, sync=True, zero=zero)
        opt = _optimizer_time(model, device, cfg, executors=True)
        share = 1.0 / world if zero >= 1 else 1.0  # sharded: each rank steps 1/world of the parameters
        hook = _hook_seconds(bare_s, accumulate, bare_cpu, acc_cpu, units, cpu_bound=on_cpu and zero <= 2)
        hook, sync = _rank_median([hook, max(0.0, synced - accumulate)], device)
        samples.append(WrapperSample(engine, world, b, s, wrapped_unit_params(spec, blocks), hook_s=hook,
                                     sync_s=sync, optimizer_ratio=opt / max(bare_opt * share, 1e-12)))
    return samples


def _rank_median(values: list[float], device: torch.device) -> list[float]:
    """Each value's median over the ranks of the default group (every rank calls this together)."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [median([float(g[i]) for g in gathered]) for i in range(len(values))]


def _split_extra(model, b: int, s: int, spec: ModelSpec, device: torch.device, cfg: TimingConfig) -> float:
    """Seconds the split backward (input-grad, then weight-grad, as a zero-bubble schedule runs a stage)
    adds to the whole backward of the cut's blocks and head (+ loss), fed the embedding's output as a
    stage input that needs its gradient. torch walks the autograd graph in Python to split it: on small
    layers this is of the order of the backward itself."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)
    targets = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)
    with torch.no_grad():
        x0 = model.embedding(tokens)
    params = [p for name, p in model.named_parameters() if not name.startswith("embedding.")]
    if model.head is not None:  # a tied head's weight is the embedding's
        params += [p for p in model.head.parameters() if all(p is not q for q in params)]

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.detach().requires_grad_(True)
        h = x
        for block in model.blocks.values():
            h = block(h)
        return x, loss_fn(model.head(h), targets)

    def split() -> None:
        x, loss = body()
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        stage_backward_weight(iter(params), groups)

    whole = typical_time(lambda: body()[1].backward(), device, cfg.warmup, cfg.repeats)
    return max(0.0, typical_time(split, device, cfg.warmup, cfg.repeats) - whole)


def chain_pass_times(spec: ModelSpec, sizes: list[int], s: int, dtype: str, device: torch.device,
                     cfg: TimingConfig, blocks: int = 2, tp_mesh=None, lockstep: bool = False) -> list[float]:
    """One round of the cut model's (embedding, `blocks` blocks, head + loss) forward + backward seconds, per
    micro-batch size; with `tp_mesh` tensor-parallel across it (every rank of the mesh calls this). With
    `lockstep` every rank of the default group calls this and they start each size together."""
    model = _model(spec, max(1, min(blocks, spec.num_layers)), device, dtype, tp_mesh=tp_mesh)
    return _chain_round(model, spec, sizes, s, device, cfg, tp_mesh, lockstep)


def _chain_round(model, spec: ModelSpec, sizes: list[int], s: int, device: torch.device, cfg: TimingConfig,
                 tp_mesh, lockstep: bool) -> list[float]:
    times = []
    for b in sizes:
        if lockstep:
            dist.barrier()
        times.append(_pass_time(model, b, s, spec, device, cfg, tp_mesh=tp_mesh))
    return times


def measure_chains(spec: ModelSpec, sizes: list[int], s: int, dtype: str, device: torch.device, cfg: TimingConfig,
                   blocks: int = 2, tp_mesh=None, lockstep: bool = False,
                   earlier: list[list[float]] = ()) -> list[ChainSample]:
    """The cut model run bare as one module, per micro-batch size, and what splitting its backward adds;
    with `tp_mesh` tensor-parallel across it (the split backward is not measured there). Every layer's
    time in the plan is scaled by this one measurement, so `earlier` rounds of `chain_pass_times` (taken
    at other moments of the profile) join this one and each size keeps the median: one short round can
    land on a transient of a shared machine (two profiles with equal per-layer samples can time the chain
    a factor of two apart), and that one figure would then move every prediction."""
    blocks = max(1, min(blocks, spec.num_layers))
    model = _model(spec, blocks, device, dtype, tp_mesh=tp_mesh)
    rounds = [*earlier, _chain_round(model, spec, sizes, s, device, cfg, tp_mesh, lockstep)]
    seconds = [median([r[i] for r in rounds]) for i in range(len(sizes))]
    if tp_mesh is not None:
        ratio = _tp_optimizer_ratio(model, device, cfg)  # after the passes: the gradients' real placements
        return [ChainSample(b, s, blocks, t, tp=tp_mesh.size(), optimizer_ratio=ratio) for b, t in zip(sizes, seconds)]
    return [ChainSample(b, s, blocks, t, _split_extra(model, b, s, spec, device, cfg)) for b, t in zip(sizes, seconds)]
