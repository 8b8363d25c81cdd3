"""Context parallelism as the sequence grows: predicted throughput per GPU against torchtitan's published
FSDP + CP table, each as a ratio to its 32K row (the trend), for every CP mode the planner costs.

    python benchmarks/cp_trend.py

Published: torchtitan docs/performance.md (commit d4c86e375, 2025-01-30), Table 2 "FSDP + CP +
torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1. Full activation checkpointing",
on Grand Teton H100s (96 GB HBM2e, 500 W power limit). Each row is pinned here to its layout: FSDP
(ZeRO-3) over 8/cp ranks, one sequence per FSDP rank, full recompute, on the 8xh100-80gb preset, costed as
torchtitan runs it with FP8 Linears under per-tensor current scaling (`plan --fp8 current`; torchao's
tensorwise Float8 of that table, whose casts torch.compile fuses, is charged Transformer Engine's). The
presets have no 500 W HBM2e H100, so only the ratios are comparable: FP8 speeds the per-token GEMMs and
not the attention, so throughput falls faster with the sequence than a bf16 run's.
"""

from __future__ import annotations

from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_cp import CP_MODES
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.search import find_plan
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.software import software_settings
from rich.console import Console
from rich.table import Table

# (cp, sequence length, published tokens/s per GPU): torchtitan Table 2 (module docstring)
PUBLISHED = [(1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548)]
GPUS = 8


def predicted_tps(cp: int, seq: int, mode: str | None) -> float:
    c = Constraints(global_batch_size=GPUS // cp, seq_len=seq, tp=1, pp=1, dp=GPUS // cp, cp=cp, cp_mode=mode,
                    zero=3, recompute="full", micro_batch_size=1)
    model, cluster = builtin_model("llama3-8b"), parse_cluster(f"{GPUS}xh100-80gb")
    profile = preset_profile(model, cluster, "bf16", **software_settings("torchtitan"), fp8="current")
    return find_plan(model, cluster, c, profile).predicted.tokens_per_s / GPUS


def main() -> None:
    modes = list(CP_MODES)
    table = Table(title="Llama 3.1 8B on 8 H100s, FSDP + CP: tokens/s per GPU (ratio to the 32K row)")
    for col in ["cp", "seq", "published (fp8)"] + [f"predicted {m}" for m in modes]:
        table.add_column(col, justify="right")
    first_pub, first = PUBLISHED[0][2], {}
    for cp, seq, pub in PUBLISHED:
        cells = [str(cp), f"{seq:,}", f"{pub:,} (x{pub / first_pub:.3f})"]
        for mode in modes:
            tps = predicted_tps(cp, seq, mode if cp > 1 else None)
            first.setdefault(mode, tps)
            cells.append(f"{tps:,.0f} (x{tps / first[mode]:.3f})")
        table.add_row(*cells)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
