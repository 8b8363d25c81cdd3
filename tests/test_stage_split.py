"""Engines' fixed stage splits (planner/stage_split.py) and the search under them."""

import json

import pytest
from meshplan.planner.cli import main
from meshplan.planner.stage_split import split_bounds, split_cuts


def kinds(blocks: int) -> list[str]:
    return ["embedding"] + ["block"] * blocks + ["head"]


def blocks_per_stage(bounds: list[int], n: int) -> list[int]:
    return [sum(1 for layer in range(a, b) if 0 < layer < n + 1) for a, b in zip(bounds, bounds[1:])]


def test_even_split_gives_every_stage_its_share_of_blocks():
    # MT-NLG: 105 blocks over 35 stages, 3 each, the embedding with the first and the head with the last
    bounds = split_bounds(kinds(105), 35, "even")
    assert bounds[:3] == [0, 4, 7] and bounds[-2:] == [103, 107]
    assert blocks_per_stage(bounds, 105) == [3] * 35
    # blocks that do not divide: the first stages take one more
    assert blocks_per_stage(split_bounds(kinds(10), 4, "even"), 10) == [3, 3, 2, 2]


def test_even_ends_counts_the_embedding_and_head_as_blocks():
    # BLOOM's 'type:transformer|embedding': [embed | 5 blocks], 6 blocks x 10, [5 blocks | embed]
    bounds = split_bounds(kinds(70), 12, "even-ends")
    assert blocks_per_stage(bounds, 70) == [5] + [6] * 10 + [5]
    assert bounds[0] == 0 and bounds[1] == 6 and bounds[-1] == 72


def test_no_fixed_split_where_it_cannot_cut():
    assert split_bounds(kinds(8), 4, "free") is None
    assert split_bounds(kinds(3), 4, "even") is None  # a stage without a block
    assert split_bounds(kinds(1), 4, "even-ends") is None  # a middle stage without a block
    assert split_bounds(kinds(2), 4, "even-ends") == [0, 1, 2, 3, 4]  # the ends alone in their stages
    assert split_bounds(["embedding", "block", "block"], 2, "even") is None  # not embedding, blocks, head
    assert split_bounds(kinds(8), 1, "even") is None


def test_split_cuts_leave_only_the_split():
    cuts = [True] * 10
    assert split_cuts(cuts, [0, 4, 7, 10]) == [True, False, False, False, True, False, False, True, False, False]
    assert split_cuts([True, True, False, True], [0, 2, 4]) == [True, False, False, False]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stage_blocks(plan: dict) -> list[int]:
    blocks = sum(1 for layer in plan["model"]["layers"] if layer["kind"] == "block")
    return blocks_per_stage([s["layers"][0] for s in plan["stages"]] + [plan["stages"][-1]["layers"][1]], blocks)


def test_search_keeps_to_the_split(capsys):
    """Unpinned, the planner balances the stages' work: llama3-8b on 4 A100s with pp 4 gives the last stage,
    which holds the 128K-row head, fewer blocks. --stage-split even and Megatron-LM of 2022 keep 8 blocks a
    stage, and cost that partition."""
    argv = ["llama3-8b", "--cluster", "4xa100-80gb", "--pp", "4", "--schedule", "1f1b", "--seq-len", "2048",
            "--global-batch-size", "16", "--recompute", "none", "--json"]
    code, out, _ = run(capsys, *argv)
    free = json.loads(out)
    assert code == 0 and stage_blocks(free) != [8, 8, 8, 8]
    assert free["search"]["stage_split"] == "free"
    for extra in (["--stage-split", "even"], ["--software", "megatron-2022"]):
        code, out, _ = run(capsys, *argv, *extra)
        even = json.loads(out)
        assert code == 0 and stage_blocks(even) == [8, 8, 8, 8], extra
        assert even["search"]["stage_split"] == "even"  # the plan says why its stages are even
        if extra[0] == "--stage-split":
            assert even["predicted"]["iteration_time_s"] > free["predicted"]["iteration_time_s"]


@pytest.mark.parametrize("argv, field", [
    (["--software", "megatron-2021", "--stage-split", "free"],
     "--stage-split: megatron-2021 does not run free (it runs: even)"),
    (["--software", "megatron-2022", "--pp", "8", "--virtual-stages", "3"],
     "--pp/--virtual-stages: megatron-2022 gives every stage the same number of blocks; 24 stages do not divide "
     "the model's 32"),
])
def test_splits_an_engine_cannot_run_are_refused(capsys, argv, field):
    code, out, err = run(capsys, "llama3-8b", "--cluster", "8xa100-80gb", *argv)
    assert code == 2 and out == "" and err.strip() == f"plan: error: {field}"


@pytest.mark.parametrize("case", range(5))
def test_a_fixed_split_solves_as_the_ilp_would(case):
    """With the engine's split the partition is given and only recompute counts are open: the direct solve
    (planner/ilp.solve_fixed) reaches the assignment ILP's optimum under the same cuts, on the search tests'
    cases where memory binds, and no more memory than the ILP's least for exit 3."""
    from dataclasses import replace

    from meshplan.planner.ilp import fixed_bounds, solve_assignment, solve_fixed
    from meshplan.planner.search import Search

    from tests.test_search import BINDING, _setup

    memory_bytes, cluster, blocks, pins = BINDING[case]
    model, cl, constraints, profile = _setup(memory_bytes, cluster, blocks, **pins)
    search = Search(model, cl, replace(constraints, stage_split="even"), profile)
    checked = 0
    for _, _, cand in search._queue():
        P = search.problem(cand)
        bounds = fixed_bounds(P)
        if cand.pp == 1:
            assert bounds is None
            continue
        assert bounds == split_bounds(P.kinds, P.num_stages, "even")
        direct, ilp = solve_fixed(P, bounds), solve_assignment(P)
        assert (direct is None) == (ilp is None), cand
        if direct is not None:
            assert direct.bounds == bounds and direct.objective == pytest.approx(ilp.objective, rel=1e-9), cand
            checked += 1
        least, least_ilp = solve_fixed(P, bounds, True), solve_assignment(P, min_memory=True)
        assert least.objective <= least_ilp.objective + 1.0, cand  # every block it may recomputed: the least
    assert checked > 0


def test_plans_written_before_the_split_read_as_free(tmp_path):
    """`search.stage_split` is optional in the plan JSON (free when absent); a value outside the splits is one
    line naming the field."""
    from meshplan.planner.errors import InputError
    from meshplan.planner.plan import load_plan, save_plan

    from tests.test_export import make_plan

    plan = make_plan(model="tiny", cluster="8xa100-80gb", pp=2, num_micro_batches=4)
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    data = json.loads(path.read_text())
    del data["search"]["stage_split"]
    path.write_text(json.dumps(data))
    assert load_plan(str(path)).search.stage_split == "free"
    data["search"]["stage_split"] = "uneven"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="search.stage_split"):
        load_plan(str(path))
