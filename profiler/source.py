"""Where the planner's Profile comes from when no --profile is given: the cache of measurements made on
this machine for the cluster's device; for this host's CPUs and a small model, a short measurement that
`plan` makes by itself (then cached); else presets, which serve hardware that is not present (a laptop
plans for 1024 GPUs) but are far off for this host's CPUs, so `plan` says so (`preset_note`)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
from meshplan.planner.cluster_spec import ClusterSpec, gpu_preset_type
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.analytic import layer_forward_flops
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.profile import LINK_OPS, LinkFit, Profile
from meshplan.profiler.software import software_settings

# `plan MODEL --cluster Nxcpu|local` on a CPU-only host measures a profile by itself when none is cached and
# the model is small (`small_enough`): the CPU presets are nominal figures and can be an order of magnitude
# off this host, where a short measurement puts the prediction within a small factor. Setting
# MESHPLAN_AUTO_PROFILE=0 turns it off (a test suite, or planning many variants without waiting): presets
# then, and a note on stderr.
AUTO_PROFILE_ENV = "MESHPLAN_AUTO_PROFILE"
# Largest measurement `plan` makes by itself: forward FLOPs of the whole model (embedding, blocks, head) at
# b=2 and the longest sequence measured, times ranks per core when there are more ranks than cores. The
# quick measurement's time grows with these FLOPs, and the bound keeps it to a couple of minutes on a small
# shared host: tiny (5.0e7) always, gpt-20m (2.25e10) while there are no more ranks than cores, gpt2
# (5.8e11) never (`plan profile gpt2 ...` measures it when asked).
AUTO_PROFILE_MAX_FLOPS = 3e10


def local_device(cluster: ClusterSpec) -> tuple[str, int] | None:
    """(device kind, ranks on this host) when the cluster's devices are this machine's, else None."""
    if cluster.device.kind == "cpu":
        return ("cpu", cluster.devices_per_node) if cluster.num_nodes == 1 else None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if cluster.device.type in (props.name, gpu_preset_type(props.name, props.total_memory)):
        return "cuda", min(cluster.devices_per_node, torch.cuda.device_count())
    return None


def with_cluster_links(profile: Profile, cluster: ClusterSpec) -> Profile:
    """Links that were not measured (no such link on the measuring host) take this cluster's figures."""
    links = {}
    for name, spec in (("intra_node", cluster.intra_node), ("inter_node", cluster.inter_node)):
        measured = {op: f for op, f in profile.links.get(name, {}).items() if f.measured_group_size > 0}
        links[name] = {op: measured.get(op) or LinkFit(spec.latency_s, 1.0 / spec.bandwidth_Bps) for op in LINK_OPS}
    return replace(profile, links=links)


def auto_profile_enabled() -> bool:
    return os.environ.get(AUTO_PROFILE_ENV, "1") != "0"


def measured_seq_len(model: ModelSpec, seq_len: int | None) -> int:
    """The longest sequence a measurement covers: the planned one, else the model's maximum up to 2048
    (`plan profile`'s default)."""
    return seq_len or min(model.max_seq_len, 2048)


def small_enough(model: ModelSpec, seq_len: int | None = None, ranks: int = 1) -> bool:
    """Whether `plan` may measure this model by itself (AUTO_PROFILE_MAX_FLOPS)."""
    if model.arch not in ("gpt2", "llama"):
        return False
    s = measured_seq_len(model, seq_len)
    flops = sum(layer_forward_flops(model, kind, 2, s) for kind in ("embedding", "head"))
    flops += model.num_layers * layer_forward_flops(model, "block", 2, s)
    return flops * max(1.0, ranks / (os.cpu_count() or 1)) <= AUTO_PROFILE_MAX_FLOPS


def profile_for(model: ModelSpec, cluster: ClusterSpec, dtype: str, *, auto_measure: bool = False,
                seq_len: int | None = None, software: str = "meshplan", fp8: str = "none") -> Profile:
    """The profile `plan` uses when no --profile is given: the cached measurement of this machine, else
    (auto_measure: `plan` itself, for this host's CPUs and a small model) a quick measurement, cached;
    else presets of the named training software (profiler/software.py), with FP8 Linears if `fp8`
    (presets only: nothing here measures FP8)."""
    where = local_device(cluster) if fp8 == "none" else None
    if where is not None:
        from meshplan.profiler.cache import load_cached, store
        from meshplan.profiler.measure import default_config, device_name, measure_profile

        kind, ranks = where
        concurrent = ranks if kind == "cpu" else 1
        cached = load_cached(model, device_name(kind), dtype, concurrent)
        if cached is not None:
            return with_cluster_links(cached, cluster)
        if auto_measure and kind == "cpu" and auto_profile_enabled() and small_enough(model, seq_len, ranks):
            print(f"plan: measuring {model.name} on this host ({ranks} CPU rank{'s' * (ranks > 1)}), once: then cached",
                  file=sys.stderr, flush=True)
            cfg = default_config(model, cluster, dtype, seq_len=measured_seq_len(model, seq_len), quick=True,
                                 show_progress=sys.stderr.isatty())
            try:
                profile = measure_profile(cfg)
            except Exception as exc:  # the plan still comes out, from presets (and preset_note says how to retry)
                first = (str(exc).strip().splitlines() or [""])[0]
                print(f"plan: measuring failed ({type(exc).__name__}: {first[:200]})", file=sys.stderr)
                return preset_profile(model, cluster, dtype, **software_settings(software, dtype))
            store(profile)
            return with_cluster_links(profile, cluster)
    return preset_profile(model, cluster, dtype, **software_settings(software, dtype), fp8=fp8)


def measure_command(model_arg: str, cluster_arg: str, dtype: str = "bf16", seq_len: int | None = None) -> str:
    """The `plan profile` command that measures what `plan` with these inputs would then use."""
    import shlex

    cmd = f"plan profile {shlex.quote(model_arg)} --cluster {shlex.quote(cluster_arg)}"
    if dtype != "bf16":
        cmd += f" --dtype {dtype}"
    if seq_len:
        cmd += f" --seq-len {seq_len}"
    return cmd


def preset_note(profile: Profile, cluster: ClusterSpec, model_arg: str, cluster_arg: str, dtype: str = "bf16",
                seq_len: int | None = None) -> str | None:
    """One line for stderr when this machine's own hardware was predicted from presets, else None
    (presets are the point when planning for hardware that is not here)."""
    if profile.source != "preset" or local_device(cluster) is None:
        return None
    return f"plan: prediction from presets; measure with `{measure_command(model_arg, cluster_arg, dtype, seq_len)}`"
