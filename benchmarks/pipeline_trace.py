"""Time every pipeline action of a real executor run: where a pipelined step's time goes.

    torchrun --nproc-per-node 4 benchmarks/pipeline_trace.py PLAN.json --steps 12 --trace /tmp/tr
    python benchmarks/pipeline_trace.py --report /tmp/tr

The first runs `python -m meshplan.executor PLAN.json ...` (every executor flag passes through) with each
stage's forward, backward and weight-gradient action and each wait on point-to-point transfers timed in
wall and process CPU time (torch.distributed.pipelining's own methods, wrapped); each rank writes
TRACE.RANK.json. The second prints, per rank, the median action times over the second half of the steps
and how a step's span splits into actions, waits and the rest (posting sends, schedule bookkeeping),
and the executor's whole training steps: wall and CPU time per rank, and the cores all ranks kept busy.
CPU time over wall time below 1 inside an action means the rank shared its core.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time

KINDS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

Event = tuple[str, int, float, float, float]  # kind, micro-batch (-1: a wait), start, end, CPU seconds


def _install(events: list[Event]) -> None:
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    def timed(fn, kind: str):
        def wrapper(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                mb = args[1] if len(args) > 1 else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                events.append((kind, mb if kind in KINDS.values() else -1, t0, time.perf_counter(),
                               time.process_time() - c0))
        return wrapper

    for name, kind in KINDS.items():
        setattr(stage._PipelineStageBase, name, timed(getattr(stage._PipelineStageBase, name), kind))
    from meshplan.executor.train import Trainer  # the whole training step (schedule, clip, AdamW, loss reduction)

    Trainer.train_step = timed(Trainer.train_step, "step")
    if hasattr(schedules, "_wait_batch_p2p"):  # private in torch 2.8-2.13; without it no waits are timed
        schedules._wait_batch_p2p = timed(schedules._wait_batch_p2p, "wait")


def trace(argv: list[str]) -> int:
    at = argv.index("--trace")
    out, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    events: list[Event] = []
    _install(events)
    from meshplan.executor.cli import main, parse_args

    steps = parse_args(rest).steps  # a fresh run (no --resume) runs this many steps
    code = main(rest)
    with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as fh:
        json.dump({"steps": steps, "events": events}, fh)
    return code


def summarise(events: dict[int, list[Event]], steps: int) -> list[str]:
    """Per rank: median wall and CPU ms of each action kind, and per step the span from its first to
    its last action split into actions, waits and the rest; over the second half of the steps."""
    lines = []
    for rank in sorted(events):
        actions = [e for e in events[rank] if e[0] in KINDS.values()]
        per_step = len(actions) // steps if steps else 0
        if per_step == 0:
            continue
        first = steps // 2
        cells = []
        for kind in "FBW":
            xs = [e for e in actions[first * per_step:] if e[0] == kind]
            if xs:
                cells.append(f"{kind} {statistics.median(e[3] - e[2] for e in xs) * 1e3:.2f} ms "
                             f"(CPU {statistics.median(e[4] for e in xs) * 1e3:.2f})")
        spans, busy, waits = [], [], []
        for s in range(first, steps):
            acts = actions[s * per_step:(s + 1) * per_step]
            start, end = acts[0][2], acts[-1][3]
            spans.append(end - start)
            busy.append(sum(e[3] - e[2] for e in acts))
            waits.append(sum(e[3] - e[2] for e in events[rank] if e[0] == "wait" and start <= e[2] < end))
        span, act, wait = (statistics.median(x) * 1e3 for x in (spans, busy, waits))
        lines.append(f"rank {rank}: {', '.join(cells)}; step span {span:.1f} ms = actions {act:.1f} + waits "
                     f"{wait:.1f} + rest {span - act - wait:.1f}")
    return lines + _steps(events, steps)


def _steps(events: dict[int, list[Event]], steps: int) -> list[str]:
    """The executor's training steps over the second half: median wall and CPU ms per rank, and the
    cores all ranks kept busy (their CPU seconds over the slowest rank's wall, summed over those steps)."""
    per_rank = {r: [e for e in evs if e[0] == "step"][steps // 2:] for r, evs in events.items()}
    per_rank = {r: xs for r, xs in per_rank.items() if xs}
    if not per_rank:
        return []
    cells = [f"rank {r} {statistics.median(e[3] - e[2] for e in xs) * 1e3:.1f} ms "
             f"(CPU {statistics.median(e[4] for e in xs) * 1e3:.1f})" for r, xs in sorted(per_rank.items())]
    wall = max(sum(e[3] - e[2] for e in xs) for xs in per_rank.values())
    cpu = sum(e[4] for xs in per_rank.values() for e in xs)
    return [f"training step: {', '.join(cells)}; {cpu / wall:.2f} cores busy" if wall > 0 else
            f"training step: {', '.join(cells)}"]


def report(prefix: str) -> int:
    files = sorted(glob.glob(f"{prefix}.*.json"))
    if not files:
        print(f"pipeline_trace: --report: no {prefix}.RANK.json files", file=sys.stderr)
        return 2
    data = {int(f.rsplit(".", 2)[1]): json.load(open(f)) for f in files}
    events = {rank: [tuple(e) for e in d["events"]] for rank, d in data.items()}
    for line in summarise(events, data[min(data)]["steps"]):
        print(line)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report"]:
        if len(argv) != 2:
            print("pipeline_trace: --report: expected one PREFIX (the --trace of the run)", file=sys.stderr)
            return 2
        return report(argv[1])
    if "--trace" not in argv or argv.index("--trace") + 1 >= len(argv):
        print("pipeline_trace: --trace: expected PREFIX (torchrun ... pipeline_trace.py PLAN.json [executor flags] "
              "--trace PREFIX, or pipeline_trace.py --report PREFIX)", file=sys.stderr)
        return 2
    return trace(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
