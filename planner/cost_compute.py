"""Compute terms: a layer's forward and backward, the forward rerun by recomputation, and the model FLOPs
that MFU divides by."""

from __future__ import annotations

from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.analytic import layer_forward_flops


def compute_time(profile, kind: str, b: int, s: int, tp: int) -> tuple[float, float]:
    """(forward, backward) s of one layer per micro-batch — measured by the profiler, or FLOPs /
    (peak × efficiency) for presets (Narayanan et al. SC'21: backward ≈ 2× forward)."""
    fwd, bwd = profile.layer_time(kind, b, s, tp)
    k = profile.correction("compute")
    return fwd * k, bwd * k


def recompute_time(profile, kind: str, b: int, s: int, tp: int, mode: str) -> float:
    """Extra forward work in backward: full = one forward (Chen et al. 2016; Narayanan et al. SC'21),
    selective = the attention core only (Korthikanti et al. 2022, §5)."""
    return profile.recompute_time(kind, b, s, tp, mode) * profile.correction("compute")


def model_flops_per_iteration(model: ModelSpec, global_batch: int, s: int) -> float:
    """3 × forward FLOPs (forward + 2× backward), no recompute: the MFU numerator (Chowdhery et al. 2022)."""
    return 3.0 * sum(layer_forward_flops(model, layer.kind, global_batch, s, 1) for layer in model.layers)
