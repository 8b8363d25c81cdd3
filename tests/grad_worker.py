"""Like executor_worker.py, but runs one global batch's forward and backward of every plan and saves every
gradient whole (after the reductions the executor does before clipping), one file per plan and rank:
`torchrun --nproc-per-node N tests/grad_worker.py SPEC.json OUT.json`. Unlike the losses under AdamW (which
is invariant to a gradient's scale), the gradients show any reduction that is missing, doubled or misplaced."""

import os

import torch


def gradients(trainer, out_dir: str, name: str) -> str:
    """This rank's parameters' gradients, whole, saved under `out_dir`; returns "ok"."""
    import torch.distributed as dist
    from meshplan.executor.train import reduce_partial_grads
    from torch.distributed.tensor import DTensor

    trainer.forward_backward(0)
    reduce_partial_grads(trainer.params)
    trainer._sync_tied()
    grads = {}
    for module in trainer.modules:
        for pname, p in module.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.full_tensor()
            grads[pname] = None if g is None else g.detach().float().clone()
    torch.save(grads, os.path.join(out_dir, f"{name}.{dist.get_rank()}.pt"))
    return "ok"


def main() -> None:
    import sys

    from tests.executor_worker import main as serve

    out_dir = os.path.dirname(os.path.abspath(sys.argv[2]))
    serve(lambda trainer, cfg, name: gradients(trainer, out_dir, name), named=True)


if __name__ == "__main__":
    main()
