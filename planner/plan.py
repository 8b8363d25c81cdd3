"""Plan JSON, schema_version 2 (DESIGN.md §3): the only thing the executor reads.

`load_plan` validates everything the executor relies on and rejects a bad file with a message that
names the field; `save_plan` writes atomically. Version 1 files (mesh [pp, dp, tp]) still load, as
cp = ep = 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.errors import InputError
from meshplan.planner.fields import Fields
from meshplan.planner.jsonio import read_json, write_atomic
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.stage_split import SPLITS

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
CP_MODES = ("ring", "all-gather", "all-to-all")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("fp32", "bf16", "fp16")
# FP8 Linears inside bf16 training (profiler/roofline.FP8): Transformer Engine's delayed or current scaling
FP8_RECIPES = ("none", "delayed", "current")
FP8_CHOICES = FP8_RECIPES[1:]  # what --fp8 takes (off: leave it out)
MESH_DIMS = ["pp", "dp", "cp", "tp"]


def ep_fits(ep: int, dp: int, cp: int, tp: int, spans_tp: bool) -> bool:
    """Whether EP groups of `ep` ranks tile the mesh: carved out of dp·cp, a divisor of it; spanning the TP
    ranks too (ParallelConfig.experts_span_tp), tp times a divisor of it (whole TP groups)."""
    if spans_tp:
        return ep % tp == 0 and (dp * cp) % (ep // tp) == 0
    return (dp * cp) % ep == 0


@dataclass
class ParallelConfig:
    dp: int
    tp: int
    pp: int
    virtual_stages: int
    zero: int
    schedule: str
    micro_batch_size: int
    num_micro_batches: int
    global_batch_size: int
    seq_len: int
    recompute: str
    dtype: str
    sequence_parallel: bool = False
    cp: int = 1
    cp_mode: str = "ring"
    ep: int = 1
    expert_tp: int = 1
    fp8: str = "none"  # FP8_RECIPES

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def experts_span_tp(self) -> bool:
        """EP folded over tensor parallelism (Megatron-Core's MoE parallel folding; torchtitan with
        expert_tp 1): with expert_tp = 1 under sequence parallelism each TP rank routes its own sequence
        shard, so an EP group is ep consecutive ranks of the flattened dp × cp × tp and the experts are not
        replicated over TP. Otherwise EP is carved out of dp·cp at each TP position (DESIGN.md §3)."""
        return self.ep > 1 and self.tp > 1 and self.expert_tp == 1 and self.sequence_parallel

    @property
    def expert_dp(self) -> int:
        """Ranks that hold the same experts (`experts_span_tp`: of the dp·cp·tp, else of the dp·cp)."""
        return self.dp * self.cp * (self.tp if self.experts_span_tp else 1) // self.ep

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @classmethod
    def from_dict(cls, data: dict, path: str = "plan.parallel") -> ParallelConfig:
        f = Fields(data, path)
        cfg = cls(
            dp=f.int("dp", min=1), tp=f.int("tp", min=1), pp=f.int("pp", min=1),
            virtual_stages=f.int("virtual_stages", min=1), zero=f.int("zero", min=0),
            schedule=f.str("schedule", choices=SCHEDULES), micro_batch_size=f.int("micro_batch_size", min=1),
            num_micro_batches=f.int("num_micro_batches", min=1), global_batch_size=f.int("global_batch_size", min=1),
            seq_len=f.int("seq_len", min=1), recompute=f.str("recompute", choices=RECOMPUTE),
            dtype=f.str("dtype", choices=DTYPES), sequence_parallel=f.bool("sequence_parallel", default=False),
            cp=f.int("cp", min=1, default=1), cp_mode=f.str("cp_mode", choices=CP_MODES, default="ring"),
            ep=f.int("ep", min=1, default=1), expert_tp=f.int("expert_tp", min=1, default=1),
            fp8=f.str("fp8", choices=FP8_RECIPES, default="none"),
        )
        if cfg.fp8 != "none" and cfg.dtype != "bf16":
            raise f.fail("fp8", f"'none' with dtype {cfg.dtype} (FP8 Linears run inside bf16 training)", cfg.fp8)
        if not ep_fits(cfg.ep, cfg.dp, cfg.cp, cfg.tp, cfg.experts_span_tp):
            raise f.fail("ep", f"tp = {cfg.tp} times a divisor of dp x cp = {cfg.dp * cfg.cp} (expert_tp 1 under "
                         "sequence parallelism: EP groups span the TP ranks)" if cfg.experts_span_tp
                         else f"a divisor of dp x cp = {cfg.dp * cfg.cp}", cfg.ep)
        if cfg.expert_tp not in (1, cfg.tp):
            raise f.fail("expert_tp", f"1 or tp = {cfg.tp}", cfg.expert_tp)
        if cfg.zero > 3:
            raise f.fail("zero", "0, 1, 2 or 3", cfg.zero)
        if cfg.dp * cfg.micro_batch_size * cfg.num_micro_batches != cfg.global_batch_size:
            raise f.fail("global_batch_size", f"dp x micro_batch_size x num_micro_batches = "
                         f"{cfg.dp * cfg.micro_batch_size * cfg.num_micro_batches}", cfg.global_batch_size)
        if cfg.virtual_stages > 1 and cfg.schedule not in ("interleaved-1f1b", "zero-bubble"):
            raise f.fail("virtual_stages", f"1 with schedule '{cfg.schedule}'", cfg.virtual_stages)
        if cfg.schedule == "interleaved-1f1b" and cfg.num_micro_batches % cfg.pp:
            raise f.fail("num_micro_batches", f"a multiple of pp={cfg.pp} for interleaved-1f1b", cfg.num_micro_batches)
        return cfg


@dataclass
class MeshSpec:
    dim_names: list[str]
    shape: list[int]

    @classmethod
    def from_dict(cls, data: dict, path: str = "plan.mesh") -> MeshSpec:
        f = Fields(data, path)
        names = f.list("dim_names")
        if names != MESH_DIMS:
            raise f.fail("dim_names", str(MESH_DIMS), names)
        shape = f.list("shape")
        if len(shape) != 4 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
            raise f.fail("shape", "four positive integers", shape)
        return cls(names, shape)


@dataclass
class StagePlan:
    """One pipeline stage: layers [start, end) of the model, run on pipeline rank `pp_rank`.
    With v virtual stages, stage k runs on pp rank k % pp (looped placement, as torch.distributed.pipelining
    expects for interleaved schedules). `predicted_time_s` is seconds per iteration on the stage (its
    num_micro_batches micro-batches, no bubble); `predicted_memory_bytes` is per device of its rank."""

    stage: int
    pp_rank: int
    layers: list[int]
    recompute_layers: int = 0
    predicted_time_s: dict[str, float] = field(default_factory=dict)
    predicted_memory_bytes: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict, path: str) -> StagePlan:
        f = Fields(data, path)
        layers = f.list("layers")
        if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers) \
                or not 0 <= layers[0] < layers[1]:
            raise f.fail("layers", "a half-open range [start, end) with 0 <= start < end", layers)
        return cls(stage=f.int("stage", min=0), pp_rank=f.int("pp_rank", min=0), layers=layers,
                   recompute_layers=f.int("recompute_layers", min=0, default=0),
                   predicted_time_s=f.number_map("predicted_time_s", default={}),
                   predicted_memory_bytes=f.number_map("predicted_memory_bytes", default={}))


@dataclass
class Predicted:
    iteration_time_s: float
    tokens_per_s: float
    bubble_fraction: float
    peak_memory_bytes: float
    mfu: float
    # Seconds per iteration that each communication term adds to the critical path (not hidden behind
    # compute), keyed by term: "tp", "pp", "dp", "fsdp_gather", "cp", "ep".
    exposed_communication_s: dict[str, float] = field(default_factory=dict)
    # What a device's allocator may use: its memory less the CUDA context, NCCL's buffers and the margin
    # (planner/memory_reserve.py); 0: not recorded (plans written before it)
    usable_memory_bytes: float = 0.0

    @classmethod
    def from_dict(cls, data: dict, path: str) -> Predicted:
        f = Fields(data, path)
        return cls(**{k: f.float(k, min=0.0) for k in
                      ("iteration_time_s", "tokens_per_s", "bubble_fraction", "peak_memory_bytes", "mfu")},
                   exposed_communication_s=f.number_map("exposed_communication_s", default={}),
                   usable_memory_bytes=f.float("usable_memory_bytes", min=0.0, default=0.0))


@dataclass
class Alternative:
    parallel: ParallelConfig
    predicted: Predicted
    note: str = ""

    @classmethod
    def from_dict(cls, data: dict, path: str) -> Alternative:
        f = Fields(data, path)
        return cls(ParallelConfig.from_dict(f.obj("parallel").data, f"{path}.parallel"),
                   Predicted.from_dict(f.obj("predicted").data, f"{path}.predicted"), f.str("note", default=""))


@dataclass
class SearchStats:
    candidates: int = 0
    feasible: int = 0
    seconds: float = 0.0
    solver: str = ""
    # the training software GPU presets charged the predictions to (plan --software); "" for a measured
    # profile, which times what ran, and for plans written before the field
    software: str = ""
    # how the layers were cut into stages (planner/stage_split.py): "free" (the planner's boundaries), or the
    # engine's or --stage-split's fixed split; "free" for plans written before the field
    stage_split: str = "free"

    @classmethod
    def from_dict(cls, data: dict, path: str) -> SearchStats:
        f = Fields(data, path)
        return cls(f.int("candidates", min=0), f.int("feasible", min=0), f.float("seconds", min=0.0),
                   f.str("solver"), f.str("software", default=""),
                   f.str("stage_split", choices=SPLITS, default="free"))


@dataclass
class Placement:
    """Optional: which global rank holds each mesh position. `ranks[i][j][c][k]` is the rank at pp index i,
    dp index j, cp index c, tp index k (build the mesh with `DeviceMesh(device_type, ranks,
    mesh_dim_names=MESH_DIMS)`); `order` names the dimensions from outermost (slowest links) to innermost.
    Absent: `init_device_mesh` order, i.e. ranks laid out row-major over [pp, dp, cp, tp]."""

    order: list[str]
    ranks: list

    @classmethod
    def from_dict(cls, data: dict, shape: list[int], path: str = "plan.placement") -> Placement:
        f = Fields(data, path)
        order = f.list("order")
        if sorted(order) != sorted(MESH_DIMS):
            raise f.fail("order", f"a permutation of {MESH_DIMS}", order)
        ranks = f.list("ranks")
        flat: list = []

        def walk(node: object, depth: int) -> bool:
            if depth == len(shape):
                flat.append(node if isinstance(node, int) and not isinstance(node, bool) else -1)
                return True
            return isinstance(node, list) and len(node) == shape[depth] and all(walk(x, depth + 1) for x in node)

        world = math.prod(shape)
        if not walk(ranks, 0) or sorted(flat) != list(range(world)):
            raise f.fail("ranks", f"a {shape} nested list holding each rank 0..{world - 1} once", "another value")
        return cls(order, ranks)


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelConfig
    stages: list[StagePlan]
    predicted: Predicted
    alternatives: list[Alternative] = field(default_factory=list)
    search: SearchStats = field(default_factory=SearchStats)
    schema_version: int = SCHEMA_VERSION
    placement: Placement | None = None  # optional rank placement; None: row-major [pp, dp, tp]

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def mesh(self) -> MeshSpec:
        p = self.parallel
        return MeshSpec(list(MESH_DIMS), [p.pp, p.dp, p.cp, p.tp])

    def to_dict(self) -> dict:
        data = {
            "schema_version": self.schema_version,
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "world_size": self.world_size,
            "parallel": asdict(self.parallel),
            "mesh": asdict(self.mesh),
            "stages": [asdict(s) for s in self.stages],
            "predicted": asdict(self.predicted),
            "alternatives": [asdict(a) for a in self.alternatives],
            "search": asdict(self.search),
        }
        if self.placement is not None:
            data["placement"] = asdict(self.placement)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict, path: str = "plan") -> Plan:
        f = Fields(data, path)
        version = f.int("schema_version")
        if version not in READABLE_VERSIONS:
            raise f.fail("schema_version", f"one of {list(READABLE_VERSIONS)} (this meshplan's plan formats)",
                         version)
        if version == 1:
            data = _upgrade_v1(data)
            f = Fields(data, path)
        model = ModelSpec.from_dict(f.obj("model").data, f"{path}.model")
        cluster = ClusterSpec.from_dict(f.obj("cluster").data, f"{path}.cluster")
        parallel = ParallelConfig.from_dict(f.obj("parallel").data, f"{path}.parallel")
        stages = [StagePlan.from_dict(s, f"{path}.stages[{i}]") for i, s in enumerate(f.list("stages"))]
        plan = cls(model=model, cluster=cluster, parallel=parallel, stages=stages,
                   predicted=Predicted.from_dict(f.obj("predicted").data, f"{path}.predicted"),
                   alternatives=[Alternative.from_dict(a, f"{path}.alternatives[{i}]")
                                 for i, a in enumerate(f.list("alternatives", default=[]))],
                   search=SearchStats.from_dict(f.obj("search", default={"solver": ""}).data, f"{path}.search"))
        if f.int("world_size", min=1) != parallel.world_size:
            raise f.fail("world_size", f"pp x dp x cp x tp = {parallel.world_size}", data["world_size"])
        if parallel.world_size > cluster.world_size:
            raise f.fail("world_size", f"at most the cluster's {cluster.world_size} devices", parallel.world_size)
        mesh = MeshSpec.from_dict(f.obj("mesh").data, f"{path}.mesh")
        if mesh.shape != plan.mesh.shape:
            raise InputError(f"{path}.mesh.shape: expected [pp, dp, cp, tp] = {plan.mesh.shape}, got {mesh.shape}")
        if "placement" in data:
            plan.placement = Placement.from_dict(f.obj("placement").data, plan.mesh.shape, f"{path}.placement")
        _check_stages(plan, path)
        return plan


def _upgrade_v1(data: dict) -> dict:
    """A schema-1 plan in schema 2's shape: mesh [pp, dp, tp] gains cp = 1 before tp."""
    data = dict(data, schema_version=SCHEMA_VERSION)
    mesh = data.get("mesh")
    if isinstance(mesh, dict) and isinstance(mesh.get("shape"), list) and len(mesh["shape"]) == 3:
        data["mesh"] = {"dim_names": list(MESH_DIMS), "shape": [*mesh["shape"][:2], 1, mesh["shape"][2]]}
    placement = data.get("placement")
    if isinstance(placement, dict) and isinstance(placement.get("order"), list) and "cp" not in placement["order"]:
        order = list(placement["order"])
        order.insert(order.index("tp") if "tp" in order else len(order), "cp")
        ranks = placement.get("ranks")
        if isinstance(ranks, list):
            ranks = [[[col] for col in row] if isinstance(row, list) else row for row in ranks]
        data["placement"] = {"order": order, "ranks": ranks}
    return data


def _check_stages(plan: Plan, path: str) -> None:
    """Stages must tile the model's layers in order, one per (pp rank, virtual stage)."""
    p = plan.parallel
    if len(plan.stages) != p.num_stages:
        raise InputError(f"{path}.stages: expected pp x virtual_stages = {p.num_stages} stages, got {len(plan.stages)}")
    expected_start = 0
    for i, stage in enumerate(plan.stages):
        where = f"{path}.stages[{i}]"
        if stage.stage != i:
            raise InputError(f"{where}.stage: expected {i}, got {stage.stage}")
        if stage.pp_rank != stage_rank(i, p.pp, p.schedule, p.virtual_stages):
            raise InputError(f"{where}.pp_rank: expected {stage_rank(i, p.pp, p.schedule, p.virtual_stages)}, "
                             f"got {stage.pp_rank}")
        if stage.layers[0] != expected_start:
            raise InputError(f"{where}.layers: expected to start at layer {expected_start}, got {stage.layers[0]}")
        if stage.recompute_layers > stage.layers[1] - stage.layers[0]:
            raise InputError(f"{where}.recompute_layers: expected at most the stage's "
                             f"{stage.layers[1] - stage.layers[0]} layers, got {stage.recompute_layers}")
        expected_start = stage.layers[1]
    if expected_start != len(plan.model.layers):
        raise InputError(f"{path}.stages: expected the last stage to end at layer {len(plan.model.layers)}, "
                         f"got {expected_start}")


def stage_rank(stage: int, pp: int, schedule: str, virtual_stages: int) -> int:
    """Pipeline rank of a stage: looped (k % pp) for interleaved schedules, V-shaped for zero-bubble
    with 2 virtual stages (ZBV: ranks 0..pp-1 then pp-1..0), as torch.distributed.pipelining expects."""
    if schedule == "zero-bubble" and virtual_stages == 2:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def load_plan(path: str) -> Plan:
    return Plan.from_dict(read_json(path, "PLAN"))


def save_plan(plan: Plan, path: str) -> None:
    """Write atomically: a reader never sees half a plan."""
    write_atomic(path, plan.to_json() + "\n")
