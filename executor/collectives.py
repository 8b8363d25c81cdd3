"""torch's functional collectives as the executor uses them: the renamed autograd all-gather and
reduce-scatter (…_tensor → …_single in torch 2.13, the old names deprecated; torch >= 2.8 has the old ones),
and a wait that leaves an already materialised tensor alone."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
ALL_GATHER_AUTOGRAD = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
REDUCE_SCATTER_AUTOGRAD = (getattr(funcol, "reduce_scatter_single_autograd", None)
                           or funcol.reduce_scatter_tensor_autograd)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The collective's result (functional collectives may return an AsyncCollectiveTensor)."""
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t
