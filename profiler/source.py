"""Where the planner's Profile comes from: a given file, the cache, a measurement, or presets."""

from __future__ import annotations

from planner.cluster_spec import ClusterSpec
from planner.model_spec import ModelSpec
from profiler.presets import preset_profile
from profiler.profile import Profile


def profile_for(model: ModelSpec, cluster: ClusterSpec, dtype: str) -> Profile:
    """The profile `plan` uses when no --profile is given (presets until the profiler measures)."""
    return preset_profile(model, cluster, dtype)
