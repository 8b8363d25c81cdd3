"""Executor pieces that need no process group: data streams, LR schedule, gradient-norm weights."""

import numpy as np
import pytest
import torch
from meshplan.executor.data import Shard, SyntheticData, TokenFile
from meshplan.executor.metrics import Metrics, tensor_bytes, track_cpu_allocations, warmup_steps
from meshplan.executor.train import TrainConfig, grad_norm_sq, local_grads, lr_multiplier
from meshplan.planner.errors import InputError


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


def test_cpu_allocation_tracking_sees_the_peak_of_live_tensors():
    """The probe behind `peak_tensor_bytes`: 4 MB + 4 MB live, one freed, then 8 MB: the peak above the
    start is 12 MB (plus the few bytes torch allocates for scalars), not the 16 MB allocated in total."""
    before = torch.randn(1000, 1000)
    with track_cpu_allocations() as tracked:
        a = torch.randn(1000, 1000)
        b = a * 2
        del a
        c = torch.randn(2000, 1000)
        del before
    assert 12_000_000 <= tracked["peak"] < 12_100_000
    assert b.numel() + c.numel() == 3_000_000


def test_tensor_bytes_counts_each_storage_once():
    x = torch.zeros(100, dtype=torch.float32)
    assert tensor_bytes([x, x[:10], x.view(10, 10), torch.zeros(5, dtype=torch.float64)]) == 400 + 40


def test_instrumented_steps_are_left_out_of_the_median(tmp_path):
    m = Metrics(str(tmp_path / "m.jsonl"), True)
    for i, (t, timed) in enumerate([(9.0, True), (5.0, False), (1.0, True), (1.0, True)]):
        m.step(i + 1, 0.0, t, 10, 0, timed=timed)
    rec = m.summary(1.0, peak_tensor_bytes=123)
    assert rec["measured_iteration_time_s"] == 1.0 and rec["peak_tensor_bytes"] == 123


def test_sliding_window_mask_is_the_band():
    """Query i attends to keys i − w < j ≤ i: w keys, itself included (Mistral's window)."""
    from meshplan.executor.model import sliding_window_mask

    mask = sliding_window_mask(5, 2, torch.device("cpu")).int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_alibi_slopes_and_bias():
    """ALiBi (Press et al. 2022; BLOOM's build): 8 heads get 2^-1 .. 2^-8; 12 heads add every other term of the
    16-head sequence, 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5. The bias is slope·(j − i) on and below the diagonal and
    −inf above, for the rank's own heads."""
    from meshplan.executor.model import alibi_bias, alibi_slopes

    assert alibi_slopes(8) == pytest.approx([2.0 ** -k for k in range(1, 9)])
    assert alibi_slopes(12)[8:] == pytest.approx([2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5])
    bias = alibi_bias(3, 8, 2, 2, torch.device("cpu"), torch.float32)  # heads 2 and 3 of 8
    assert bias.shape == (2, 3, 3)
    assert bias[0].tolist() == [[0.0, float("-inf"), float("-inf")], [-0.125, 0.0, float("-inf")],
                                [-0.25, -0.125, 0.0]]
    assert bias[1, 2, 0].item() == -2 * 2.0 ** -4


def test_attention_mask_keeps_both_a_window_and_alibi():
    """A block with a sliding window and ALiBi attends inside the window with ALiBi's bias; either alone gives
    its own mask; neither, none (plain causal attention)."""
    from dataclasses import replace

    from meshplan.executor.model import Attention, alibi_bias, sliding_window_mask
    from meshplan.planner.model_sources import builtin_model

    tiny, cpu = builtin_model("tiny"), torch.device("cpu")
    both = Attention(replace(tiny, position="alibi", sliding_window=2, layers=()))
    mask = both.attention_mask(4, 4, torch.float32, cpu)
    window = sliding_window_mask(4, 2, cpu)
    assert torch.equal(mask[:, window], alibi_bias(4, 4, 0, 4, cpu, torch.float32)[:, window])
    assert torch.isinf(mask[:, ~window]).all()
    assert torch.equal(Attention(replace(tiny, sliding_window=2, layers=())).attention_mask(4, 4, torch.float32, cpu),
                       window)
    assert Attention(tiny).attention_mask(4, 4, torch.float32, cpu) is None
