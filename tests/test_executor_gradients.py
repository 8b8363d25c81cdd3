"""Every plan shape of tests/test_executor_equivalence.py computes the single process's gradients: after one
global batch's forward and backward and the executor's reductions, each parameter's gradient, gathered whole
on every rank that holds it, equals a 1-process loop's (fp32, gloo, 4 processes). The losses alone do not show
a gradient reduced over the wrong ranks: AdamW's step does not depend on a gradient's scale."""

import glob

import pytest
import torch

from tests import test_executor_cp, test_executor_equivalence, test_executor_moe
from tests.executor_worker import run_plans

# the fp32 plans of the equivalence, context-parallel and mixture-of-experts tests
PLANS = {f"{prefix}{name}": (module.build, kwargs)
         for prefix, module in (("", test_executor_equivalence), ("cp-", test_executor_cp),
                                ("moe-", test_executor_moe))
         for name, kwargs in module.PLANS.items() if kwargs.get("dtype", "fp32") == "fp32"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grads")
    plans = {name: build(**kwargs) for name, (build, kwargs) in PLANS.items()}
    out, paths = run_plans(tmp, plans, "grad_worker.py", 1, 3, timeout=600)
    return tmp, out, paths


def reference_gradients(plan_path: str, seed: int) -> dict[str, torch.Tensor]:
    from meshplan.executor.data import SyntheticData
    from meshplan.executor.model import Transformer, init_weights, loss_fn
    from meshplan.planner.plan import load_plan

    plan = load_plan(plan_path)
    p = plan.parallel
    torch.manual_seed(0)
    model = Transformer(plan.model)
    init_weights(model, seed)
    batch = SyntheticData(plan.model.vocab_size, p.seq_len, p.global_batch_size, seed).batch(0)
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    return {n: q.grad for n, q in model.named_parameters()}


def canonical(name: str, params: dict) -> str:
    """A stage module's parameter name as the whole model names it: activation checkpointing's wrapper left
    out; a tied head's own copy on the last stage is the embedding (their gradients are summed)."""
    name = name.replace("._checkpoint_wrapped_module", "")
    if name == "head.output.weight" and name not in params:
        return "embedding.tok.weight"
    return name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_gradients_match_single_process(results, name):
    tmp, out, paths = results
    assert out[name] == "ok", out[name]
    want = reference_gradients(paths[name], 3)
    seen = set()
    for path in sorted(glob.glob(str(tmp / f"{name}.*.pt"))):
        for raw, g in torch.load(path).items():
            pname = canonical(raw, want)
            assert pname in want, f"{name}: {pname} is not a parameter of the model"
            assert g is not None, f"{name}: {pname} has no gradient on {path}"
            scale = want[pname].abs().max().item()
            torch.testing.assert_close(g, want[pname], rtol=1e-4, atol=1e-5 * scale + 1e-9,
                                       msg=lambda m, p=pname, f=path: f"{name} {p} ({f}): {m}")
            seen.add(pname)
    assert seen == set(want), f"{name}: no rank holds {sorted(set(want) - seen)[:4]}"
