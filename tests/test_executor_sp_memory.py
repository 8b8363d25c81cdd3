"""Sequence parallelism keeps the Linears' gathered inputs as sequence shards (executor.parallelize
.keep_input_shard, Korthikanti et al. 2022 Eq. 5): nothing saved for backward holds the gathered tensor,
backward gathers each again once, starting when the module's output gradient arrives, and the gradients
are those of keeping it whole."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from meshplan.planner.model_sources import builtin_model

from tests.executor_worker import spawn_ranks


def _worker(rank: int, world: int, store: str, model: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _check(world, model)
    finally:
        dist.destroy_process_group()


def _check(world: int, model: str) -> None:
    from meshplan.executor.regather import paused
    from meshplan.profiler.layers import build_tp_case
    from torch.distributed.device_mesh import init_device_mesh

    spec, mesh = builtin_model(model), init_device_mesh("cpu", (world,))
    for kind in ("block", "head"):
        case = build_tp_case(spec, kind, 2, 16, mesh, "fp32", torch.device("cpu"))
        layer = case.module
        modules = [m for name, m in layer.named_modules() if hasattr(m, "regathers")]
        assert len(modules) == (2 if kind == "block" else 1)  # attention and MLP; the head's output Linear
        gathered: list[weakref.ref] = []
        for m in modules:  # after apply_tp's hooks: sees the gathered input the forward gets; a weak
            # reference on its storage lives exactly as long as a tensor uses it
            m.register_forward_pre_hook(lambda mod, args: gathered.append(weakref.ref(
                (args[0]._local_tensor if hasattr(args[0], "_local_tensor") else args[0]).untyped_storage())))
        grads = []
        for keep in (True, False):
            gathered.clear()
            x = case.make_input()
            with paused() if not keep else torch.enable_grad():
                out = layer(x)
            alive = [r() is not None for r in gathered]
            assert alive == [not keep] * len(modules), (kind, keep, alive)
            before = [(m.regathers, m.prefetched) for m in modules]
            assert [len(m.sources) for m in modules] == [int(keep)] * len(modules)
            case.backward(out)
            # with the graph still referenced (`out`), nothing holds a shard or its gathered copy
            assert [len(m.sources) for m in modules] == [0] * len(modules)
            # one gather each, started when the output's gradient arrived
            assert [(m.regathers - r, m.prefetched - p) for m, (r, p) in zip(modules, before)] == \
                [(int(keep), int(keep))] * len(modules)
            grads.append([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                          for p in layer.parameters()] + [x.grad.clone()])
            layer.zero_grad(set_to_none=True)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


def test_sequence_parallel_keeps_linear_inputs_as_shards(tmp_path):
    # SwiGLU, grouped-query attention, a vocabulary-parallel head; GELU, learned positions, a replicated head
    for model in ("tiny", "gpt2"):
        spawn_ranks(_worker, 2, str(tmp_path / f"store-{model}"), model)  # exits without finalization
