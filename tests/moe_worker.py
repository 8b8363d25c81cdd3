"""Like executor_worker.py, but each step also reports the global gradient norm before clipping, which,
unlike the losses under AdamW (invariant to a gradient's scale), checks the scale of every gradient:
`torchrun --nproc-per-node N tests/moe_worker.py SPEC.json OUT.json`; OUT (rank 0): {"name": [[loss, norm],
...]} or {"name": "error: ..."}."""


import torch
from meshplan.executor.train import TrainConfig
from meshplan.planner.plan import load_plan


def main() -> None:
    from tests.executor_worker import main as serve

    serve(lambda trainer, cfg: [list(trainer.train_step(step)) for step in range(cfg.steps)])


def reference(plan_path: str, steps: int, seed: int) -> list[tuple[float, float]]:
    """A plain single-process loop over the full model and the same global batches: (loss, gradient norm
    before clipping) of each step."""
    from meshplan.executor.data import SyntheticData
    from meshplan.executor.model import Transformer, init_weights, loss_fn
    from meshplan.executor.train import lr_multiplier, make_optimizer

    plan = load_plan(plan_path)
    p, cfg = plan.parallel, TrainConfig(steps=steps, seed=seed)
    model = Transformer(plan.model)
    init_weights(model, seed)
    opt = make_optimizer(model, cfg)
    data = SyntheticData(plan.model.vocab_size, p.seq_len, p.global_batch_size, seed)
    out = []
    for step in range(steps):
        batch = data.batch(step)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_multiplier(step, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), float(norm)))
    return out


if __name__ == "__main__":
    main()
