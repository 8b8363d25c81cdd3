"""Like executor_worker.py, but each step also reports the global gradient norm before clipping, which,
unlike the losses under AdamW (invariant to a gradient's scale), checks the scale of every gradient:
`torchrun --nproc-per-node N tests/moe_worker.py SPEC.json OUT.json`; OUT (rank 0): {"name": [[loss, norm],
...]} or {"name": "error: ..."}."""



def main() -> None:
    from tests.executor_worker import main as serve

    serve(lambda trainer, cfg: [list(trainer.train_step(step)) for step in range(cfg.steps)])


if __name__ == "__main__":
    main()
