"""The MLP's elementwise function, one rule for dense MLPs and experts."""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from meshplan.planner.model_spec import ModelSpec


def activation(spec: ModelSpec):
    """SiLU gates SwiGLU; otherwise GELU (tanh approximation: GPT-2's, and GeGLU's gate in Gemma) or ReLU (OPT)."""
    if spec.mlp == "swiglu":
        return F.silu
    return F.relu if spec.mlp == "relu" else partial(F.gelu, approximate="tanh")
