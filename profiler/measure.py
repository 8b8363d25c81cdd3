"""Run a whole measurement: compute on every rank at once (CPU ranks share cores), links between the
ranks that exist, memory in the parent process, assembled into a measured Profile.

Ranks come from `torchrun` when the profiler runs under it (several nodes: intra- and inter-node
groups), else from torch.multiprocessing with a free port on this host (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.compute import Stopwatch, TimingConfig, grid, measure_sample, median, typical, typical_time
from meshplan.profiler.layers import build_case
from meshplan.profiler.links import LinkTiming, fit_timings, message_sizes, time_ops
from meshplan.profiler.memory import measure_activations, measure_state
from meshplan.profiler.pipeline_insitu import measure_pipeline_overheads
from meshplan.profiler.profile import (
    LINK_OPS,
    RECOMPUTE_MODES,
    ChainSample,
    ComputeSample,
    LinkFit,
    MemorySample,
    PipelineSample,
    Profile,
    StateSample,
    WrapperSample,
)
from meshplan.profiler.progress import Reporter
from meshplan.profiler.wrappers import chain_pass_times, measure_chains, measure_wrappers

# On GPU the other ranks wait in a barrier while rank 0 measures compute, which can take long for a big
# model: longer than NCCL's default 10-minute watchdog.
RANK_TIMEOUT = timedelta(minutes=60)
CHAIN_ROUNDS = 3  # moments of a CPU profile at which the whole-model chains are measured


@dataclass
class MeasureConfig:
    model: ModelSpec
    cluster: ClusterSpec
    dtype: str
    device_kind: str  # "cpu" or "cuda"
    nprocs: int  # ranks on this host
    micro_batch_sizes: list[int]
    seq_lens: list[int]
    tps: list[int]
    timing: TimingConfig = field(default_factory=TimingConfig)
    min_message_bytes: int = 4 * 1024
    max_message_bytes: int = 256 * 1024**2
    threads_per_rank: int = 0  # 0: cores // ranks (CPU)
    show_progress: bool = True

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"], d["cluster"] = self.model.to_dict(), self.cluster.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MeasureConfig":
        d = dict(d)
        d["model"] = ModelSpec.from_dict(d["model"])
        d["cluster"] = ClusterSpec.from_dict(d["cluster"])
        d["timing"] = TimingConfig(**d["timing"])
        return cls(**d)


def device_name(kind: str) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask: containers often show the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads(nprocs: int) -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, cpu_cores() // nprocs)


def measure_optimizer(spec: ModelSpec, dtype: str, device: torch.device, timing: TimingConfig) -> float:
    """Seconds per parameter of the executor's optimizer step (fp32 master weights, as mixed precision steps
    them): the global-norm clip (executor.train: foreach norms, then scaling every gradient) and AdamW."""
    from meshplan.executor.train import grad_norm_sq, local_grads

    params = [p.detach().float().clone().requires_grad_(True)
              for p in build_case(spec, "block", 1, 1, 1, dtype, device).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step() -> None:
        groups = local_grads(params, replicas=1)
        grad_norm_sq(groups)
        for grads in groups.values():
            torch._foreach_mul_(grads, 0.999)  # a clipping coefficient (1.0 skips the scaling)
        opt.step()
    return typical_time(step, device, timing.warmup, timing.repeats) / sum(p.numel() for p in params)


def tp_meshes(cfg: MeasureConfig, world: int, local_world: int) -> dict:
    """A (groups, tp) DeviceMesh's "tp" dimension for each TP degree that the ranks of one node can form
    (consecutive ranks, as the executor's placement puts TP innermost); every rank must call this."""
    from torch.distributed.device_mesh import init_device_mesh

    return {tp: init_device_mesh(cfg.device_kind, (world // tp, tp), mesh_dim_names=("groups", "tp"))["tp"]
            for tp in joint_tps(cfg, world, local_world)}


def joint_tps(cfg: MeasureConfig, world: int, local_world: int) -> list[int]:
    return [tp for tp in cfg.tps if world > 1 and 1 < tp <= local_world and local_world % tp == 0
            and world % tp == 0 and all(s % tp == 0 for s in cfg.seq_lens)]


@dataclass
class _EarlyRounds:
    """Earlier rounds of the whole-model chains and the optimizer step (see chain_round_positions)."""

    bare: list[list[float]] = field(default_factory=list)
    tp: dict[int, list[list[float]]] = field(default_factory=dict)
    optimizer: list[float] = field(default_factory=list)

    def run(self, cfg: MeasureConfig, device: torch.device, meshes: dict, measuring: bool, distributed: bool
            ) -> None:
        s, sizes = max(cfg.seq_lens), cfg.micro_batch_sizes
        if measuring:
            if distributed:
                dist.barrier()
            self.bare.append(chain_pass_times(cfg.model, sizes, s, cfg.dtype, device, cfg.timing,
                                              lockstep=lockstep(cfg, distributed)))
            if distributed:
                dist.barrier()
            self.optimizer.append(measure_optimizer(cfg.model, cfg.dtype, device, cfg.timing))
        for tp, mesh in meshes.items():  # early rounds run on CPU only, where every TP group measures
            dist.barrier()
            self.tp.setdefault(tp, []).append(chain_pass_times(cfg.model, sizes, s, cfg.dtype, device, cfg.timing,
                                                               tp_mesh=mesh))


def _compute_phase(cfg: MeasureConfig, rank: int, world: int, local_world: int, device: torch.device,
                   reporter: Reporter | None, distributed: bool
                   ) -> tuple[list[ComputeSample], list[ChainSample], float]:
    """Every CPU rank measures the same points at once (they start each point together); on GPU only
    rank 0 measures (GPUs do not share compute) while the others wait. TP degrees the ranks can form are
    timed for real across a TP group (collectives and DTensor dispatch included, which on CPU cost many
    times the bare link fit); others as one rank's shard shapes."""
    measuring = cfg.device_kind == "cpu" or rank == 0
    meshes = tp_meshes(cfg, world, local_world) if distributed else {}
    s = max(cfg.seq_lens)
    points = grid(cfg.micro_batch_sizes, cfg.seq_lens, cfg.tps, embedding_tps=bool(meshes))
    early, rounds = chain_round_positions(cfg.device_kind, len(points)), _EarlyRounds()
    samples = []
    for i, point in enumerate(points):
        if i in early:
            if reporter is not None:
                reporter.step(f"whole-model chain, round {len(rounds.optimizer) + 1}")
            rounds.run(cfg, device, meshes, measuring, distributed)
        if reporter is not None:
            reporter.step(f"compute {point.label()}")
        gc.collect(1)  # collection is paused while timing (run_rank); the previous point's garbage goes here
        if distributed:
            dist.barrier()
        mesh = meshes.get(point.tp)
        if point.tp > 1 and mesh is not None:  # CPU: every TP group at once; GPU: the first group
            if cfg.device_kind == "cpu" or rank < point.tp:
                samples.append(measure_sample(cfg.model, point.kind, point.b, point.s, point.tp, cfg.dtype,
                                              device, cfg.timing, tp_mesh=mesh))
        elif measuring and (point.kind != "embedding" or point.tp == 1):
            samples.append(measure_sample(cfg.model, point.kind, point.b, point.s, point.tp, cfg.dtype, device,
                                          cfg.timing))
    if reporter is not None:
        reporter.step("whole-model chain")
    if distributed:
        dist.barrier()
    chains = measure_chains(cfg.model, cfg.micro_batch_sizes, s, cfg.dtype, device, cfg.timing,
                            lockstep=lockstep(cfg, distributed), earlier=rounds.bare) if measuring else []
    for tp, mesh in meshes.items():  # CPU: every TP group at once; GPU: the first group
        if reporter is not None:
            reporter.step(f"whole-model chain, tp={tp}")
        dist.barrier()
        if cfg.device_kind == "cpu" or rank < tp:
            chains += measure_chains(cfg.model, cfg.micro_batch_sizes, s, cfg.dtype, device, cfg.timing,
                                     tp_mesh=mesh, earlier=rounds.tp.get(tp, []))
    if reporter is not None:
        reporter.step("optimizer step")
    if distributed:
        dist.barrier()
    opt = measure_optimizer(cfg.model, cfg.dtype, device, cfg.timing) if measuring else 0.0
    return samples, chains, median(rounds.optimizer + [opt]) if measuring else 0.0


def lockstep(cfg: MeasureConfig, distributed: bool) -> bool:
    """Whether the ranks start each chain size together: CPU ranks all measure at once and share the cores."""
    return distributed and cfg.device_kind == "cpu"


def chain_round_positions(device_kind: str, points: int) -> set[int]:
    """Grid positions before which an earlier round of the whole-model chains (and the optimizer step)
    runs: on CPU two, at the start and half-way, so with the round after the grid each is the median of
    three moments of the profile: the chain and the optimizer step scale every prediction, and one short
    round on a shared CPU can land on a fast or a slow minute (two one-round profiles back to back can
    differ by a factor of two). On GPU none: CUDA events time the kernels, which the host's other
    processes do not slow."""
    rounds = CHAIN_ROUNDS if device_kind == "cpu" else 1
    return {k * points // (rounds - 1) for k in range(rounds - 1)} if rounds > 1 and points else set()


_COMPUTE_TIMES = ("forward_s", "backward_s", "spread", "backward_full_s", "backward_selective_s", "forward_full_s",
                  "forward_selective_s")
_CHAIN_TIMES = ("seconds", "split_extra_s")


def _mean_over_ranks(compute: list[ComputeSample], chains: list[ChainSample], opt: float
                     ) -> tuple[list[ComputeSample], list[ChainSample], float]:
    """CPU: every rank measured the same points at once; keep their mean. Time-slicing gives each rank its
    own share of the cores, so ranks differ, and a training step waits for all of them."""
    rows = [(c, _COMPUTE_TIMES) for c in compute] + [(c, _CHAIN_TIMES) for c in chains]
    flat = torch.tensor([getattr(obj, f) for obj, fields in rows for f in fields] + [opt], dtype=torch.float64)
    dist.all_reduce(flat)
    values = iter((flat / dist.get_world_size()).tolist())
    for obj, fields in rows:
        for f in fields:
            setattr(obj, f, next(values))
    return compute, chains, next(values)


def _link_phase(cfg: MeasureConfig, world: int, local_world: int, device: torch.device,
                reporter: Reporter | None) -> dict[str, list[LinkTiming]]:
    """Intra-node: the ranks of node 0; inter-node: one rank per node (each op crosses the fabric)."""
    nodes = world // local_world
    groups = {}
    if local_world >= 2:
        ranks = list(range(local_world))
        groups["intra_node"] = (dist.new_group(ranks) if nodes > 1 else dist.group.WORLD, ranks)
    if nodes >= 2:
        ranks = [k * local_world for k in range(nodes)]
        groups["inter_node"] = (dist.new_group(ranks), ranks)
    sizes = message_sizes(cfg.min_message_bytes, cfg.max_message_bytes)
    progress = reporter.step if reporter is not None else None
    return {name: time_ops(group, ranks, device, sizes, LINK_OPS, progress=progress)
            for name, (group, ranks) in groups.items()}


def scalar_all_reduce_time(device: torch.device, timing: TimingConfig) -> float:
    """Typical seconds of one all-reduce of a scalar over every rank, the ranks starting together: what
    the executor's step pays twice, for the global gradient norm and the logged loss. Every rank calls it."""
    t = torch.zeros(1, dtype=torch.float64, device=device)
    watch = Stopwatch(device)
    times = []
    for i in range(timing.warmup + 4 * timing.repeats):  # ~0.5 ms each on CPU: many, for a steady mean
        dist.barrier()  # outside the timing, as profiler.links.time_ops times each op
        _, seconds = watch.time(lambda: dist.all_reduce(t))
        if i >= timing.warmup:
            times.append(seconds)
    return typical(times, device)


def in_situ_phases(world: int) -> tuple[bool, bool]:
    """(data-parallel engines, pipeline schedule): whether these ranks can measure them in situ
    (the pipeline runs on pairs of ranks)."""
    return world > 1, world > 1 and world % 2 == 0


def _steps(cfg: MeasureConfig, world: int, local_world: int) -> int:
    links = (local_world >= 2) + (world // local_world >= 2)
    joint = joint_tps(cfg, world, local_world)  # TP degrees timed across ranks: each also runs the chain
    in_situ = sum(in_situ_phases(world))
    points = len(grid(cfg.micro_batch_sizes, cfg.seq_lens, cfg.tps, bool(joint)))
    early = len(chain_round_positions(cfg.device_kind, points))
    return points + early + 3 + len(joint) + in_situ + \
        links * len(LINK_OPS) * len(message_sizes(cfg.min_message_bytes, cfg.max_message_bytes))


def run_rank(cfg: MeasureConfig, rank: int, world: int, local_rank: int, local_world: int) -> dict | None:
    """The per-rank body (process group already initialised when world > 1); rank 0 returns the results."""
    from meshplan.executor.train import collection_paused

    threads = torch.get_num_threads()
    try:
        with collection_paused(True):  # the executor trains without automatic collections; time it alike
            return _run_rank(cfg, rank, world, local_rank, local_world)
    finally:
        torch.set_num_threads(threads)  # in-process (one rank): leave the caller's threads as they were


def _run_rank(cfg: MeasureConfig, rank: int, world: int, local_rank: int, local_world: int) -> dict | None:
    device = torch.device("cuda", local_rank) if cfg.device_kind == "cuda" else torch.device("cpu")
    if cfg.device_kind == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cfg.threads_per_rank or default_threads(local_world))
    reporter = Reporter(_steps(cfg, world, local_world), enabled=cfg.show_progress) if rank == 0 else None
    try:
        compute, chains, opt = _compute_phase(cfg, rank, world, local_world, device, reporter, world > 1)
        if world > 1 and cfg.device_kind == "cpu":
            compute, chains, opt = _mean_over_ranks(compute, chains, opt)
        engines, pipelines = in_situ_phases(world)
        wrappers = []
        if engines:
            if reporter is not None:
                reporter.step("data-parallel engines in situ")
            dist.barrier()
            wrappers = measure_wrappers(cfg.model, min(cfg.micro_batch_sizes), max(cfg.seq_lens), cfg.dtype,
                                        device, cfg.timing)
        pipeline: list[PipelineSample] = []
        if pipelines:  # the smallest and the largest micro-batch size: the P2P message grows with b
            if reporter is not None:
                reporter.step("pipeline schedules in situ")
            for b in sorted({min(cfg.micro_batch_sizes), max(cfg.micro_batch_sizes)}):
                dist.barrier()
                pipeline.append(PipelineSample(b, measure_pipeline_overheads(
                    cfg.model, b, max(cfg.seq_lens), cfg.dtype, device, cfg.timing)))
        timings = _link_phase(cfg, world, local_world, device, reporter) if world > 1 else {}
        step_sync = scalar_all_reduce_time(device, cfg.timing) if world > 1 else 0.0
    finally:
        if reporter is not None:
            reporter.close()
    if rank != 0:
        return None
    if reporter is not None:
        reporter.step("activation and model-state memory")
    memory, state = measure_memory(cfg, device)  # rank 0 alone: bytes do not depend on contention
    return {"compute": [asdict(c) for c in compute], "chains": [asdict(c) for c in chains],
            "optimizer_s_per_param": opt, "step_sync_s": step_sync,
            "memory": [asdict(m) for m in memory], "state": [asdict(x) for x in state],
            "threads_per_rank": torch.get_num_threads() if cfg.device_kind == "cpu" else 0,
            "cpu_cores": cpu_cores() if cfg.device_kind == "cpu" else 0,
            "links": {k: [asdict(t) for t in v] for k, v in timings.items()},
            "wrappers": [asdict(w) for w in wrappers], "pipeline_samples": [asdict(p) for p in pipeline]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned(rank: int, world: int, port: int, cfg_dict: dict, result_path: str) -> None:
    """torch.multiprocessing entry point: one rank on this host."""
    cfg = MeasureConfig.from_dict(cfg_dict)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cfg.device_kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cfg.device_kind == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=RANK_TIMEOUT)
    try:
        result = run_rank(cfg, rank, world, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if result is not None:
        with open(result_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    exit_spawned_rank()


def exit_spawned_rank() -> None:
    """End a torch.multiprocessing rank whose work is done without interpreter finalization: gloo's
    worker threads can abort it ("terminate called without an active exception", SIGABRT) after the
    process group is destroyed, which would fail the finished spawn (seen in 1 of 6-9 runs of two
    spawned tests on a 2-core machine; pytorch/pytorch#179291 describes the race)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_ranks(cfg: MeasureConfig) -> dict:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # launched by torchrun
        dist.init_process_group("nccl" if cfg.device_kind == "cuda" else "gloo", timeout=RANK_TIMEOUT)
    if dist.is_available() and dist.is_initialized():  # under torchrun: every rank runs this
        world, rank = dist.get_world_size(), dist.get_rank()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        result = run_rank(cfg, rank, world, local_rank, local_world)
        obj = [result]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]
    if cfg.nprocs == 1:
        result = run_rank(cfg, 0, 1, 0, 1)
        assert result is not None
        return result
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="meshplan-profile-") as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_spawned, args=(cfg.nprocs, _free_port(), cfg.to_dict(), path), nprocs=cfg.nprocs, join=True)
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)


def measure_memory(cfg: MeasureConfig, device: torch.device) -> tuple[list[MemorySample], list[StateSample]]:
    memory, state = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # byte counts do not depend on threads; a loaded host makes many threads slow
    try:
        _memory_points(cfg, device, memory, state)
    finally:
        torch.set_num_threads(threads)
    return memory, state


def _memory_points(cfg: MeasureConfig, device: torch.device, memory: list, state: list) -> None:
    for point in grid(cfg.micro_batch_sizes, cfg.seq_lens, cfg.tps):
        modes = RECOMPUTE_MODES if point.kind == "block" else ("none",)
        for mode in modes:
            memory.append(measure_activations(cfg.model, point.kind, point.b, point.s, point.tp, cfg.dtype,
                                              device, mode))
    for kind in ("embedding", "block", "head"):
        for tp in cfg.tps if kind != "embedding" else [1]:
            state.append(measure_state(cfg.model, kind, tp, cfg.dtype, device))


def measure_profile(cfg: MeasureConfig) -> Profile:
    start = time.perf_counter()
    result = _run_ranks(cfg)
    measured = {name: fit_timings([LinkTiming(**t) for t in rows]) for name, rows in result["links"].items()}
    links: dict[str, dict[str, LinkFit]] = {}
    for name, spec in (("intra_node", cfg.cluster.intra_node), ("inter_node", cfg.cluster.inter_node)):
        preset = {op: LinkFit(alpha_s=spec.latency_s, beta_s_per_byte=1.0 / spec.bandwidth_Bps) for op in LINK_OPS}
        links[name] = preset | measured.get(name, {})  # links this host does not have: the cluster's figures
    concurrent = cfg.nprocs if cfg.device_kind == "cpu" else 1
    t = cfg.timing
    samples = [PipelineSample(p["micro_batch_size"], p["overheads"]) for p in result.get("pipeline_samples", [])]
    return Profile(
        model=cfg.model, dtype=cfg.dtype, source="measured", device_kind=cfg.device_kind,
        device_name=device_name(cfg.device_kind), torch_version=torch.__version__,
        compute=[ComputeSample(**c) for c in result["compute"]], links=links,
        memory=[MemorySample(**m) for m in result["memory"]],
        optimizer_s_per_param=result["optimizer_s_per_param"], concurrent_ranks=concurrent,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        state=[StateSample(**x) for x in result["state"]],
        wrappers=[WrapperSample(**w) for w in result.get("wrappers", [])],
        pipeline_overheads=samples[0].overheads if samples else {}, pipeline_samples=samples,
        chains=[ChainSample(**c) for c in result.get("chains", [])], step_sync_s=result.get("step_sync_s", 0.0),
        threads_per_rank=result["threads_per_rank"], cpu_cores=result.get("cpu_cores", 0),
        settings={"warmup": t.warmup, "repeats": t.repeats, "max_repeats": t.max_repeats, "budget_s": t.budget_s,
                  "ranks": cfg.nprocs,
                  "min_message_bytes": cfg.min_message_bytes, "max_message_bytes": cfg.max_message_bytes,
                  "seconds": round(time.perf_counter() - start, 2)},
    )



def default_config(model: ModelSpec, cluster: ClusterSpec, dtype: str, *, seq_len: int | None = None,
                   micro_batch_sizes: list[int] | None = None, tps: list[int] | None = None,
                   quick: bool = False, **overrides) -> MeasureConfig:
    """Enough (b, s, t) points for the planner's fit (time = overhead + FLOPs x rate per kind): b in
    {1, 2, 4}, the sequence length and its half, every power-of-two t up to the node size (max 8) that
    divides the heads. `quick` (plan's own measurement) trims repeats and the largest messages."""
    from meshplan.profiler.layers import check_buildable, tp_degrees

    check_buildable(model)
    kind = cluster.device.kind
    nprocs = cluster.devices_per_node if kind == "cpu" else min(cluster.devices_per_node, torch.cuda.device_count())
    s = seq_len or min(model.max_seq_len, 2048)
    cfg = MeasureConfig(
        model=model, cluster=cluster, dtype=dtype, device_kind=kind, nprocs=max(1, nprocs),
        micro_batch_sizes=micro_batch_sizes or ([1, 2] if quick else [1, 2, 4]),
        seq_lens=sorted({max(1, s // 2), s}),
        tps=tps or tp_degrees(model, min(cluster.devices_per_node, 8)),
        timing=TimingConfig(warmup=1, repeats=3, budget_s=0.05) if quick else TimingConfig(),
        max_message_bytes=(16 if quick else 256) * 1024**2,
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg
