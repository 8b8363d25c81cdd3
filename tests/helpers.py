"""Hand-built plans for tests that must not depend on the search."""

from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import ParallelConfig, Plan, Predicted, StagePlan, stage_rank


def even_stages(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def make_plan(model: str = "tiny", cluster: str = "4xcpu", dp: int = 1, tp: int = 1, pp: int = 1,
              virtual_stages: int = 1, schedule: str = "1f1b", zero: int = 0, micro_batch_size: int = 2,
              num_micro_batches: int = 2, seq_len: int = 16, recompute: str = "none", dtype: str = "fp32",
              sequence_parallel: bool = False, cp: int = 1, cp_mode: str = "ring") -> Plan:
    spec = builtin_model(model)
    parallel = ParallelConfig(
        dp=dp, tp=tp, pp=pp, virtual_stages=virtual_stages, zero=zero, schedule=schedule,
        micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches,
        global_batch_size=dp * micro_batch_size * num_micro_batches, seq_len=seq_len, recompute=recompute,
        dtype=dtype, sequence_parallel=sequence_parallel, cp=cp, cp_mode=cp_mode,
    )
    stages = [
        StagePlan(stage=i, pp_rank=stage_rank(i, pp, schedule, virtual_stages), layers=[a, b],
                  recompute_layers=(b - a) if recompute == "full" else 0,
                  predicted_time_s={"forward": 0.001, "backward": 0.002, "total": 0.003},
                  predicted_memory_bytes={"parameters": 1000, "total": 4000})
        for i, (a, b) in enumerate(even_stages(len(spec.layers), pp * virtual_stages))
    ]
    predicted = Predicted(iteration_time_s=0.01, tokens_per_s=1000.0, bubble_fraction=0.1,
                          peak_memory_bytes=4000, mfu=0.01)
    return Plan(model=spec, cluster=parse_cluster(cluster), parallel=parallel, stages=stages, predicted=predicted)
