"""`plan profile MODEL --cluster CLUSTER [-o profile.json] [--force]`: measure on this machine."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from meshplan.planner.cli import _Parser, positive_int
from meshplan.planner.errors import InputError
from meshplan.planner.plan import DTYPES, FP8_CHOICES
from meshplan.profiler.software import SOFTWARE

_SIZE_RE = re.compile(r"^(\d+)\s*(B|KiB|MiB|GiB)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def byte_size(text: str) -> int:
    m = _SIZE_RE.match(text.strip())
    if not m or int(m[1]) < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 64KiB or 256MiB, got '{text}'")
    return int(m[1]) * _UNITS[(m[2] or "b").lower()]


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan profile",
                description="Measure per-layer forward/backward time, activation and model-state memory, and "
                            "collective latency/bandwidth on this machine, for the planner.")
    p.add_argument("model", metavar="MODEL", help="built-in name, config.json path (gpt2/llama architectures)")
    p.add_argument("--cluster", required=True, metavar="CLUSTER",
                   help="Nxcpu (N processes share this host's cores), local, or GxTYPE matching this machine's GPUs")
    p.add_argument("-o", "--output", metavar="PATH", help="also write the profile JSON to PATH")
    p.add_argument("--force", action="store_true", help="re-measure even if a cached profile exists")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="precision to measure in (default: bf16)")
    p.add_argument("--seq-len", type=positive_int, metavar="S",
                   help="longest sequence measured, S/2 too (default: the model's maximum, at most 2048)")
    # `plan`'s --micro-batch-size and --tp name the same inputs: one value or several to measure
    p.add_argument("--micro-batch-sizes", "--micro-batch-size", type=positive_int, nargs="+", metavar="B",
                   help="default: 1 2 4")
    p.add_argument("--tp-degrees", "--tp", type=positive_int, nargs="+", metavar="T",
                   help="shard shapes to measure (default: powers of two up to the node size that divide the heads)")
    p.add_argument("--warmup", type=int, default=10, metavar="N", help="untimed passes per point (default: 10)")
    p.add_argument("--repeats", type=positive_int, default=15, metavar="N",
                   help="timed passes per point at least (default: 15; cheap points repeat up to 25 within 0.2 s)")
    p.add_argument("--max-message-size", type=byte_size, default=256 * 1024**2, metavar="SIZE",
                   help="largest collective message (default: 256MiB; sizes from 4KiB by factors of 4)")
    p.add_argument("--threads-per-rank", type=positive_int, metavar="N",
                   help="torch threads of each CPU rank (default: $OMP_NUM_THREADS, else cores / ranks)")
    p.add_argument("--preset", action="store_true",
                   help="write the preset profile (documented peak x efficiency, link datasheets) without measuring")
    p.add_argument("--software", choices=list(SOFTWARE), default="meshplan",
                   help="with --preset: the training software the GPU preset charges (default: meshplan's executor)")
    p.add_argument("--fp8", choices=FP8_CHOICES,
                   help="with --preset: FP8 Linears (Transformer Engine's delayed or current scaling)")
    p.add_argument("--quiet", action="store_true", help="no progress and no tables")
    return p


def _check(args: argparse.Namespace, model, cluster) -> None:
    import torch
    from meshplan.planner.constraints import check_seq_len
    from meshplan.profiler.layers import check_buildable, shard_spec
    from meshplan.profiler.source import local_device

    check_buildable(model)
    if cluster.device.kind == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built for CPU only" if torch.version.cuda is None else "no CUDA device is visible"
            raise InputError(f"--cluster: '{cluster.name}' has CUDA devices but CUDA is not available here ({why}); "
                             f"profile on that machine, or use --preset for documented peak figures")
        if local_device(cluster) is None:
            raise InputError(f"--cluster: this machine's GPU is {torch.cuda.get_device_name(0)}, not "
                             f"{cluster.device.type}; use --cluster local, or --preset for documented figures")
    if args.seq_len:
        check_seq_len(model, args.seq_len)  # as `plan` checks it: only learned positions bound the sequence
    for t in args.tp_degrees or []:
        shard_spec(model, "block", t)
    if args.warmup < 0:
        raise InputError(f"--warmup: expected a non-negative integer, got {args.warmup}")


def main(argv: Sequence[str]) -> int:
    from meshplan.planner.cluster_spec import parse_cluster
    from meshplan.planner.model_sources import resolve_model
    from meshplan.profiler.profile import save_profile

    args = parser().parse_args(list(argv))
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank measures; rank 0 reports
        args.quiet, args.output = True, None
    model = resolve_model(args.model)
    cluster = parse_cluster(args.cluster)
    if args.preset:
        from meshplan.profiler.presets import preset_profile
        from meshplan.profiler.software import software_settings

        profile = preset_profile(model, cluster, args.dtype, **software_settings(args.software, args.dtype),
                                 fp8=args.fp8 or "none")
    else:
        _check(args, model, cluster)
        profile = _measure_or_cached(args, model, cluster)
    if args.output:
        save_profile(profile, args.output)
    if not args.quiet:
        from meshplan.profiler.report import print_profile

        print_profile(profile)
        if args.output:
            print(f"profile written to {args.output}")
    return 0


def covers(profile, cfg) -> bool:
    """Whether a cached profile holds every point this request would measure: each (micro-batch, sequence)
    size and TP degree, the whole-model chain (whole and split backward; tensor-parallel at each degree
    timed across ranks), and the in-situ engine and per-schedule pipeline measurements when several ranks
    run."""
    from meshplan.planner.model_spec import wrapped_unit_params
    from meshplan.planner.plan import SCHEDULES
    from meshplan.profiler.measure import in_situ_phases

    have = {(c.micro_batch_size, c.seq_len, c.tp) for c in profile.compute if c.kind == "block"}
    want = {(b, s, t) for b in cfg.micro_batch_sizes for s in cfg.seq_lens for t in cfg.tps}
    engines, pipelines = in_situ_phases(cfg.nprocs)
    # measured before unit_params counted a tied root right (and the bare cut model was untied): again
    units = all(w.unit_params == wrapped_unit_params(cfg.model, len(w.unit_params) - 1) for w in profile.wrappers)
    in_situ = not engines or (bool(profile.wrappers) and units)
    pipelines = not pipelines or (set(SCHEDULES) <= set(profile.pipeline_overheads) and max(cfg.micro_batch_sizes)
                                  in {p.micro_batch_size for p in profile.pipeline_samples})
    bare = [c for c in profile.chains if c.tp == 1]
    split = bool(bare) and all(c.split_extra_s > 0 for c in bare)
    joint = {c.tp for c in profile.compute if c.with_collectives}  # TP degrees run across ranks: chained too
    # measured before the checkpointed forward was timed (its cost was missing from recompute): again
    checkpointed = all(c.forward_full_s > 0 for c in profile.compute if c.kind == "block" and c.backward_full_s > 0)
    return (want <= have and in_situ and pipelines and split and joint <= {c.tp for c in profile.chains}
            and checkpointed)


def _measure_or_cached(args: argparse.Namespace, model, cluster):
    from meshplan.profiler.cache import load_cached, store
    from meshplan.profiler.compute import TimingConfig
    from meshplan.profiler.measure import default_config, device_name, measure_profile

    cfg = default_config(model, cluster, args.dtype, seq_len=args.seq_len, micro_batch_sizes=args.micro_batch_sizes,
                         tps=args.tp_degrees, timing=TimingConfig(args.warmup, args.repeats, max(args.repeats, 25)),
                         max_message_bytes=args.max_message_size, threads_per_rank=args.threads_per_rank or 0,
                         show_progress=not args.quiet)
    concurrent = cfg.nprocs if cfg.device_kind == "cpu" else 1
    # under torchrun every rank must take part in the measurement: a cache hit on one host only would hang
    if not args.force and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        cached = load_cached(model, device_name(cfg.device_kind), args.dtype, concurrent)
        if cached is not None and not covers(cached, cfg):
            if not args.quiet:
                print("the cached profile lacks some of the requested sizes or in-situ measurements: "
                      "measuring again", file=sys.stderr)
            cached = None
        if cached is not None:
            if not args.quiet:
                print(f"using the cached profile measured {cached.created} (--force re-measures)", file=sys.stderr)
            return cached
    profile = measure_profile(cfg)
    path = store(profile)
    if not args.quiet:
        print(f"profile cached in {path}", file=sys.stderr)
    return profile
