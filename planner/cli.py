"""The `plan` command line (DESIGN.md §2). Every user error is one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from meshplan.planner.errors import InputError, MeshplanError
from meshplan.planner.plan import CP_MODES, DTYPES, FP8_CHOICES, RECOMPUTE, SCHEDULES
from meshplan.planner.stage_split import SPLITS

SUBCOMMANDS = ("profile", "show", "export", "calibrate")
# A default sequence longer than this (a long-context model's maximum) is pointed out: pretraining runs
# shorter ones (Llama 3: 8K, then long-context stages).
LONG_DEFAULT_SEQ = 8192

MAIN_EPILOG = """\
subcommands:
  plan profile MODEL --cluster CLUSTER [-o profile.json] [--force]
                           measure per-layer compute and memory and the links between devices
  plan show PLAN.json [--timeline out.png]
                           human summary of a plan and its pipeline timeline
  plan export PLAN.json --format megatron|torchtitan|deepspeed
                           the plan as arguments/config of another training engine
  plan calibrate METRICS.jsonl... --profile P.json
                           fold measured step times back into a profile
  Run `plan SUBCOMMAND --help` for each one's options.

MODEL:   a built-in name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama2-7b, llama2-13b, llama2-70b,
         llama3.2-1b, llama3-8b, llama3-70b, llama3.1-405b, gpt3-175b, gpt-20m, tiny; mixture of experts:
         mixtral-8x7b, mixtral-8x22b, qwen3-30b-a3b, tiny-moe), a Hugging Face config.json path
         (gpt2, llama, mistral, qwen2, qwen3, gpt_neox, opt, falcon, starcoder2, phi3, gemma, bloom;
         mixtral, qwen2_moe, qwen3_moe), or package.module:factory returning an nn.Module.
CLUSTER: GxTYPE or NxGxTYPE with TYPE one of a100-40gb, a100-80gb, h100-80gb, h200-141gb,
         b200-180gb, b300-288gb, gb200-186gb, gb300-288gb (NVL72: 72-GPU NVLink domains, e.g.
         18x4xgb200-186gb; other counts spread over the fewest racks, e.g. 32x4: 2 racks of 64), cpu;
         Nxcpu (N processes on this host); local (this machine as it is); or a YAML/JSON cluster file
         (`base: 2x8xh100-80gb` plus any field to override, e.g. topology: {nodes_per_leaf: 16,
         oversubscription: 2}).

profiles: predictions for this host's own hardware use its measured profile, cached by `plan profile`
         ($MESHPLAN_CACHE, else ~/.cache/meshplan). For Nxcpu / local on a CPU-only host with nothing cached,
         plan measures a small model (up to about gpt-20m) itself first, once; MESHPLAN_AUTO_PROFILE=0 skips
         that. Otherwise the prediction comes from presets, and stderr says how to measure.

exit codes: 0 plan found, 2 bad input (the message names the field), 3 no plan fits in memory.

examples:
  plan llama3-8b --cluster 8xa100-80gb
  plan llama3-70b --cluster 8x8xh100-80gb --global-batch-size 512 --seq-len 8192 -o plan.json
  plan tiny --cluster 4xcpu --tp 2 --json
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump) through InputError."""

    def error(self, message: str):  # type: ignore[override]
        raise InputError(message)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got '{text}'") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got '{text}'")
    return value


def main_parser() -> argparse.ArgumentParser:
    from meshplan.profiler.software import SOFTWARE  # names only: the CLI layer reaches both parts

    p = _Parser(
        prog="plan",
        description="Choose data, tensor and pipeline parallelism, ZeRO level, micro-batching, pipeline "
                    "schedule, stage partition and recomputation for training MODEL on CLUSTER.",
        epilog=MAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="built-in name, config.json path or package.module:factory")
    p.add_argument("--cluster", required=True, metavar="CLUSTER",
                   help="e.g. 8xa100-80gb, 16x8xh100-80gb, 4xcpu, local, cluster.yaml")
    g = p.add_argument_group("workload")
    g.add_argument("--global-batch-size", type=positive_int, metavar="N",
                   help="sequences per optimizer step (default: 2 x world size, at least 8)")
    g.add_argument("--seq-len", type=positive_int, metavar="S",
                   help="tokens per sequence (default: the model's maximum)")
    g.add_argument("--dtype", choices=DTYPES, default="bf16", help="training precision (default: bf16)")
    g.add_argument("--fp8", choices=FP8_CHOICES,
                   help="FP8 Linears inside bf16 training, as Transformer Engine runs them (Megatron-Core, NeMo): "
                        "delayed or current (per-tensor) scaling; GPU presets with FP8 tensor cores (H100, H200, "
                        "B200, B300, GB200); costed as Megatron-Core runs it unless --software says otherwise. The "
                        "executor does not run FP8: export the plan (default: off)")
    g.add_argument("--software", choices=list(SOFTWARE),
                   help="the training software GPU presets charge and the search keeps to (default: a preset "
                        "--profile's, else meshplan's executor): torchtitan, "
                        "megatron (Megatron-Core), megatron-bridge (NVIDIA's Megatron-Bridge/NeMo performance "
                        "recipes: bf16 gradients, fused cross-entropy), megatron-2022 and megatron-2021 "
                        "(Megatron-LM of those papers), "
                        "megatron-deepspeed-2022; a measured profile times what it ran")
    c = p.add_argument_group("constraints (each pins one dimension; the planner chooses the rest)")
    c.add_argument("--micro-batch-size", type=positive_int, metavar="B")
    c.add_argument("--dp", type=positive_int, help="data-parallel degree")
    c.add_argument("--tp", type=positive_int, help="tensor-parallel degree (divides heads, stays in a node)")
    c.add_argument("--pp", type=positive_int, help="pipeline-parallel degree")
    c.add_argument("--cp", type=positive_int,
                   help="context-parallel degree: each rank holds seq_len/cp tokens of every sequence (the planner "
                        "tries cp > 1 itself from 8192 tokens on)")
    c.add_argument("--cp-mode", choices=CP_MODES,
                   help="context parallelism: ring (ring attention, load-balanced causal split; torch's "
                        "context_parallel, CUDA only), all-gather (K and V gathered before attention, as Llama 3 "
                        "and Megatron-LM's all_gather; CPU and GPU) or all-to-all (DeepSpeed-Ulysses head scatter; "
                        "CPU and GPU)")
    c.add_argument("--ep", type=positive_int,
                   help="expert-parallel degree of a mixture-of-experts model, carved out of dp x cp: each rank "
                        "holds num_experts/ep experts")
    c.add_argument("--expert-tp", type=positive_int, help="the experts' tensor-parallel degree: 1 or tp")
    c.add_argument("--moe-imbalance", type=float, default=1.25, metavar="F",
                   help="busiest expert-parallel rank's routed tokens over the mean (default 1.25, Switch "
                        "Transformer's capacity factor)")
    c.add_argument("--virtual-stages", type=positive_int, metavar="V", help="pipeline stages per rank (interleaved)")
    c.add_argument("--schedule", choices=SCHEDULES)
    c.add_argument("--recompute", choices=RECOMPUTE,
                   help="activation recomputation: selective checkpoints every block's attention core "
                        "(Korthikanti et al.; under fused attention it frees only the log-sum-exp); full, "
                        "whole blocks (the planner picks how many per stage)")
    c.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO / FSDP level for data parallelism")
    c.add_argument("--stage-split", choices=SPLITS,
                   help="how the layers are cut into pipeline stages: free (the planner places each boundary; "
                        "the default, except for --software engines that cannot), even (blocks spread evenly, "
                        "the embedding with the first stage and the head with the last, as Megatron-LM before "
                        "2024 and DeepSpeed's 'type:transformer' do) or even-ends (the embedding and the head "
                        "counted as a block each)")
    c.add_argument("--memory-margin", type=fraction, default=0.05, metavar="F",
                   help="share of a GPU's memory, after the CUDA context and NCCL buffers, kept free for the "
                        "allocator's fragmentation (default: 0.05; the executor runs with expandable segments)")
    o = p.add_argument_group("inputs and outputs")
    o.add_argument("--profile", metavar="PROFILE.json", help="use this profile instead of measuring or presets")
    o.add_argument("--top-k", type=positive_int, default=3, metavar="K", help="runner-up plans to keep (default: 3)")
    o.add_argument("--json", action="store_true", help="print the plan JSON to stdout")
    o.add_argument("-o", "--output", metavar="PATH", help="write the plan JSON to PATH")
    o.add_argument("--pareto", metavar="OUT.png",
                   help="draw predicted time vs memory of every candidate considered, the chosen one marked")
    return p


def run_main(argv: Sequence[str]) -> int:
    from meshplan.planner.cluster_spec import parse_cluster
    from meshplan.planner.constraints import Constraints
    from meshplan.planner.model_sources import resolve_model
    from meshplan.planner.plan import save_plan
    from meshplan.planner.search import find_plan
    from meshplan.profiler.software import engine_limits  # what the --software engine runs

    args = main_parser().parse_args(argv)
    model = resolve_model(args.model)
    cluster = parse_cluster(args.cluster)
    profile = None
    if args.profile:
        from meshplan.profiler.profile import load_profile

        profile = load_profile(args.profile, model=model)
    fp8 = args.fp8 or "none"
    if args.fp8 and profile is not None and getattr(getattr(profile, "roofline", None), "fp8", "none") != fp8:
        raise InputError(f"--fp8: {args.profile} was not made with --fp8 {args.fp8}; write a preset one with "
                         f"plan profile --preset --fp8 {args.fp8}, or plan without --profile")
    # the engine: --software, else the one a preset profile file was made for, else the executor
    file_software = getattr(getattr(profile, "roofline", None), "software", None)
    # FP8 Linears are Transformer Engine's: Megatron-Core's engine unless another is named
    software = args.software or file_software or ("megatron" if args.fp8 else "meshplan")
    constraints = Constraints(
        global_batch_size=args.global_batch_size or max(8, 2 * cluster.world_size), seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp,
        cp_mode=args.cp_mode, virtual_stages=args.virtual_stages, schedule=args.schedule, recompute=args.recompute,
        zero=args.zero, stage_split=args.stage_split, ep=args.ep, expert_tp=args.expert_tp,
        moe_imbalance=args.moe_imbalance,
        dtype=args.dtype, memory_margin=args.memory_margin, top_k=args.top_k, **engine_limits(software),
    )
    constraints.validate(model, cluster)
    if profile is None:
        from meshplan.profiler.source import profile_for

        # this host's CPUs with nothing measured: a small model is measured now (cached), else presets + a note
        profile = profile_for(model, cluster, constraints.dtype, auto_measure=True, seq_len=args.seq_len,
                              software=software, fp8=fp8)
    considered: list[tuple[float, float, str]] | None = [] if args.pareto else None
    with DelayedProgress("searching plans") as progress:
        plan = find_plan(model, cluster, constraints, profile, progress=progress, considered=considered)
    if args.output:
        save_plan(plan, args.output)
    if args.pareto:
        from meshplan.planner.pareto import plan_candidates, write_pareto

        _, chosen = plan_candidates(plan)
        write_pareto(considered, chosen, args.pareto, capacity_bytes=plan.cluster.device.memory_bytes,
                     title=f"{model.name} on {cluster.name}: {len(considered)} candidates\n"
                           "(solved: predicted; pruned: lower bounds)")
    if not args.profile:
        from meshplan.profiler.source import preset_note

        note = preset_note(profile, cluster, args.model, args.cluster, constraints.dtype, args.seq_len)
        if note:
            print(note, file=sys.stderr, flush=True)
    if args.seq_len is None and plan.parallel.seq_len > LONG_DEFAULT_SEQ:  # the config's maximum, e.g. 128K
        print(f"plan: seq {plan.parallel.seq_len} is {args.model}'s maximum, the default; --seq-len S plans the "
              f"length you train at", file=sys.stderr, flush=True)
    if args.software not in (None, "meshplan", file_software) \
            and (args.profile or getattr(profile, "roofline", None) is None):
        what = (f"{args.profile} as it is" if args.profile else "CPU presets" if profile.source == "preset"
                else "a measured profile, which times the software that ran")
        print(f"plan: --software {args.software} applies to GPU presets; this plan uses {what}", file=sys.stderr,
              flush=True)
    if args.json:
        print(plan.to_json())
    else:
        from meshplan.planner.report import print_plan

        print_plan(plan)
        if args.output:
            print(f"plan written to {args.output}")
        if args.pareto:
            print(f"time vs memory of {len(considered)} candidates written to {args.pareto}")
    return 0


class DelayedProgress:
    """A rich progress bar on stderr that appears only once the work has taken over a second (short
    searches print nothing extra; stdout stays clean for --json)."""

    def __init__(self, description: str, delay_s: float = 1.0):
        import time

        self.description, self.delay_s, self.clock = description, delay_s, time.perf_counter
        self.start = self.clock()
        self.bar = None
        self.task = None

    def __enter__(self) -> DelayedProgress:
        self.start = self.clock()
        return self

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if self.clock() - self.start < self.delay_s:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("candidates (best-first; stops at the bound)"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=total)
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _subcommand(name: str) -> Callable[[Sequence[str]], int]:
    """Each subcommand lives with its part: profile in profiler/, show/export/calibrate in planner/."""
    import importlib

    targets = {"profile": "meshplan.profiler.cli", "show": "meshplan.planner.show", "export": "meshplan.planner.export",
               "calibrate": "meshplan.planner.calibrate"}
    return importlib.import_module(targets[name]).main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            code = _subcommand(argv[0])(argv[1:])
        else:
            code = run_main(argv)
    except MeshplanError as exc:
        print(f"plan: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("plan: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
