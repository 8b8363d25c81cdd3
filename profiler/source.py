"""Where the planner's Profile comes from when no --profile is given: the cache of measurements made on
this machine for the cluster's device, a bounded measurement (opt-in), or presets for hardware that is
not present (so a laptop can plan for 1024 GPUs)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.analytic import layer_forward_flops
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.profile import LINK_OPS, LinkFit, Profile

# `plan` measures by itself only when asked: measuring takes tens of seconds and uses every core, which
# neither a test suite nor a user planning many variants wants by surprise.
AUTO_PROFILE_ENV = "MESHPLAN_AUTO_PROFILE"
# Largest block forward (FLOPs at b=2 and the longest sequence) that `plan` measures on its own.
AUTO_PROFILE_MAX_FLOPS = 2e9


def gpu_preset_type(name: str, total_memory: int) -> str:
    """The cluster preset a local GPU corresponds to (same rules as planner.cluster_spec.local_cluster)."""
    title = name.upper()
    if "B200" in title:
        return "b200-180gb"
    if "H200" in title:
        return "h200-141gb"
    if "H100" in title:
        return "h100-80gb"
    if "A100" in title:
        return "a100-80gb" if total_memory / 1024**3 > 50 else "a100-40gb"
    return name


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
    return os.environ.get(AUTO_PROFILE_ENV, "") == "1"


def small_enough(model: ModelSpec) -> bool:
    return model.arch in ("gpt2", "llama") and layer_forward_flops(
        model, "block", 2, min(model.max_seq_len, 2048)) <= AUTO_PROFILE_MAX_FLOPS


def profile_for(model: ModelSpec, cluster: ClusterSpec, dtype: str) -> Profile:
    """The profile `plan` uses when no --profile is given."""
    where = local_device(cluster)
    if where is not None:
        from meshplan.profiler.cache import load_cached, store
        from meshplan.profiler.measure import default_config, device_name, measure_profile

        kind, ranks = where
        concurrent = ranks if kind == "cpu" else 1
        cached = load_cached(model, device_name(kind), dtype, concurrent)
        if cached is not None:
            return with_cluster_links(cached, cluster)
        if auto_profile_enabled() and small_enough(model):
            print(f"plan: measuring {model.name} on {ranks} {kind} rank(s) ({AUTO_PROFILE_ENV}=1; "
                  f"cached for the next run)", file=sys.stderr)
            profile = measure_profile(default_config(model, cluster, dtype, quick=True))
            store(profile)
            return with_cluster_links(profile, cluster)
        if sys.stderr.isatty():
            print(f"plan: no measured profile of {model.name} on this {kind} yet; using presets. "
                  f"`plan profile {model.name} --cluster {cluster.name}` measures it.", file=sys.stderr)
    return preset_profile(model, cluster, dtype)
