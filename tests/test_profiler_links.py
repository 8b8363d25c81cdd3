"""The α-β link fit recovers α and β from synthetic timings; real gloo timings on 2 processes."""

import os
import random

import pytest
import torch
import torch.distributed as dist
from meshplan.profiler.links import LinkTiming, fit_link, fit_relative, fit_timings, message_sizes, time_ops
from meshplan.profiler.profile import LINK_OPS, LinkFit, collective_factors

from tests.executor_worker import free_port, spawn_ranks


def synthetic(op: str, n: int, alpha: float, beta: float, noise: float, seed: int = 0):
    rng = random.Random(seed)
    steps, factor = collective_factors(op, n)
    sizes = message_sizes()
    return sizes, [(alpha * steps + beta * factor * m) * (1 + rng.uniform(-noise, noise)) for m in sizes]


@pytest.mark.parametrize("op", LINK_OPS)
@pytest.mark.parametrize("n", [2, 8])
def test_fit_recovers_alpha_beta(op, n):
    alpha, beta = 25e-6, 1 / 12e9  # 25 us, 12 GB/s
    sizes, times = synthetic(op, n, alpha, beta, noise=0.03)
    fit = fit_link(op, n, sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.05)
    assert fit.measured_group_size == n and fit.fit_error < 0.06


def test_fit_exact_without_noise_and_through_timings():
    sizes, times = synthetic("all_reduce", 4, 5e-6, 1 / 300e9, noise=0.0)
    rows = [LinkTiming("all_reduce", 4, m, [t * 0.99, t, t * 1.01]) for m, t in zip(sizes, times)]
    fit = fit_timings(rows)["all_reduce"]
    assert fit.alpha_s == pytest.approx(5e-6, rel=1e-6) and fit.beta_s_per_byte == pytest.approx(1 / 300e9, rel=1e-6)
    assert fit.spread == pytest.approx(0.016, rel=0.01)


def test_fit_never_negative():
    assert fit_relative([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])[1] == 0.0  # no bandwidth term when time falls
    a, c = fit_relative([1.0, 1000.0], [0.5, 1000.0])
    assert a >= 0 and c >= 0


def test_message_sizes():
    sizes = message_sizes()
    assert sizes[0] == 4 * 1024 and sizes[-1] == 256 * 1024**2 and len(sizes) == 9




def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = time_ops(dist.group.WORLD, list(range(world)), torch.device("cpu"), message_sizes(4096, 1024**2),
                        budget_s=0.05, max_repeats=3)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        fits = fit_timings(rows)
        with open(os.path.join(out_dir, "fits.txt"), "w") as fh:
            for op, f in fits.items():
                fh.write(f"{op} {f.alpha_s} {f.beta_s_per_byte} {f.measured_group_size} {len(rows)}\n")


@pytest.mark.slow
def test_gloo_collectives_on_two_processes(tmp_path):
    spawn_ranks(_worker, 2, free_port(), str(tmp_path))
    lines = (tmp_path / "fits.txt").read_text().split("\n")
    fits = {op: LinkFit(float(a), float(b), int(n)) for op, a, b, n, _ in (ln.split() for ln in lines if ln)}
    assert set(fits) == set(LINK_OPS)
    for f in fits.values():
        assert f.measured_group_size == 2
        assert f.alpha_s + f.beta_s_per_byte > 0


def _mean_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from meshplan.profiler.measure import _mean_over_ranks
    from meshplan.profiler.profile import ChainSample, ComputeSample

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        k = rank + 1  # rank r measured everything (r + 1) times as long
        compute = [ComputeSample("block", 1, 8, 1, 1.0 * k, 2.0 * k, backward_full_s=3.0 * k)]
        chains = [ChainSample(1, 8, 2, 4.0 * k, 0.5 * k)]
        compute, chains, opt = _mean_over_ranks(compute, chains, 1e-9 * k)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        c, ch = compute[0], chains[0]
        with open(os.path.join(out_dir, "mean.txt"), "w") as fh:
            fh.write(f"{c.forward_s} {c.backward_s} {c.backward_full_s} {ch.seconds} {ch.split_extra_s} {opt}")


def test_cpu_ranks_keep_the_mean_of_what_each_measured(tmp_path):
    spawn_ranks(_mean_worker, 2, free_port(), str(tmp_path))
    values = [float(v) for v in (tmp_path / "mean.txt").read_text().split()]
    assert values == pytest.approx([1.5, 3.0, 4.5, 6.0, 0.75, 1.5e-9])
