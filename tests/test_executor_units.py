"""Executor pieces that need no process group: data streams, LR schedule, gradient-norm weights."""

import numpy as np
import pytest
import torch

from executor.data import Shard, SyntheticData, TokenFile
from executor.metrics import warmup_steps
from executor.train import TrainConfig, grad_norm_sq, local_grads, lr_multiplier
from planner.errors import InputError


def test_synthetic_stream_is_deterministic_and_split_by_rows():
    a, b = SyntheticData(256, 16, 8, seed=1), SyntheticData(256, 16, 8, seed=1)
    assert torch.equal(a.batch(3), b.batch(3)) and not torch.equal(a.batch(3), a.batch(4))
    assert a.batch(0).shape == (8, 17) and int(a.batch(0).max()) < 256
    halves = [Shard(a, r, 4).inputs_targets(2) for r in (0, 1)]
    full = a.batch(2)
    assert torch.equal(torch.cat([h[0] for h in halves]), full[:, :-1])
    assert torch.equal(torch.cat([h[1] for h in halves]), full[:, 1:])


def test_token_file(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint32).tofile(path)
    data = TokenFile(str(path), "uint32", vocab_size=2000, seq_len=10, global_batch=4)
    batch = data.batch(1)
    assert batch[0, 0] == 40 and batch.shape == (4, 11)
    assert torch.equal(batch[0], torch.arange(40, 51))
    assert data.position(1) == 40
    with pytest.raises(InputError, match="--data"):
        TokenFile(str(tmp_path / "none.bin"), "uint16", 10, 4, 1)
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(InputError, match="fewer than seq_len"):
        TokenFile(str(tmp_path / "short.bin"), "uint16", 10, 8, 1)


def test_lr_warmup_then_cosine():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert lr_multiplier(55, cfg) == pytest.approx(0.55)
    assert lr_multiplier(100, cfg) == pytest.approx(0.1)
    assert warmup_steps(1) == 0 and warmup_steps(5) == 1 and warmup_steps(100) == 10


def test_grad_norm_weights_replicas_and_excludes_copies():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((2,), 1.0)
    groups = local_grads([a, b], replicas=2)
    assert float(grad_norm_sq(groups)) == pytest.approx((12 + 2) / 2)  # each rank counts half
    groups = local_grads([a, b], replicas=1, exclude=frozenset({id(b)}))
    assert float(grad_norm_sq(groups)) == pytest.approx(12)
