"""Activation bytes saved for backward (saved_tensors_hooks, shared storage counted once) and model state."""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.model_spec import ModelSpec, block_params
from meshplan.profiler.analytic import DTYPE_BYTES, layer_activation_bytes
from meshplan.profiler.layers import build_tp_case
from meshplan.profiler.memory import measure_activations, measure_state, saved_bytes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.executor_worker import free_port, spawn_ranks

CPU = torch.device("cpu")


def test_saved_bytes_exact_for_a_known_layer():
    """Linear -> GELU -> Linear (no bias) saves exactly: the input of the first Linear (b·s·h), the GELU
    input (b·s·f) and the second Linear's input (b·s·f); the weights are parameters, not activations."""
    b, s, h, f = 3, 5, 8, 16
    layer = nn.Sequential(nn.Linear(h, f, bias=False), nn.GELU(), nn.Linear(f, h, bias=False))
    x = torch.randn(b, s, h, requires_grad=True)
    counter, out = saved_bytes(lambda c: layer(x), list(layer.parameters()))
    assert counter.count == 3
    assert counter.bytes == 4 * b * s * (h + 2 * f)
    out.sum().backward()  # the graph is intact: the hook only observed


def test_shared_storage_counted_once():
    """x * x saves x twice, and a view of x shares its storage: one tensor, b·s·h values."""
    x = torch.randn(4, 6, requires_grad=True)
    counter, _ = saved_bytes(lambda c: (x * x) + x.t().sin().t(), [])
    assert counter.count == 1
    assert counter.bytes == 4 * 4 * 6


GPT_SMALL = ModelSpec(name="gpt-small", arch="gpt2", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=4, ffn_hidden_size=256, max_seq_len=128, norm="layernorm", mlp="gelu",
                      position="learned", linear_bias=True)


def ours_bytes(spec: ModelSpec, b: int, s: int, t: int, B: int, recompute: str) -> float:
    """Korthikanti et al. (2022) count s·b·h·(34 + 5·a·s/h) bytes per block in 16-bit (B = 2), with t-way TP
    s·b·h·(10 + 24/t + 5·a·s/(h·t)). Their block has dropout; the built-in transformer does not, so:
    - the two 1-byte hidden dropout masks go (sbh each): 34 -> 32, and 10 -> 8 under TP;
    - in attention, the 1-byte dropout mask (a·s²·b) and the 2-byte dropout output (2·a·s²·b, the input of
      softmax·V) go; softmax·V saves the softmax output itself: 5·a·s/h -> 2·a·s/h.
    So, in values of width B: s·b·h·(4 + 12/t + a·s/(h·t)) · B, plus what the formula ignores: each
    LayerNorm's fp32 mean and rstd (2 norms × 2 × s·b × 4 bytes). This holds with the math SDPA kernel; a
    flash kernel (CPU default) saves q, k, v, the output and the log-sum-exp instead of the softmax (no s²).
    Selective recompute keeps q, k, v for the attention core instead of scaled q, k and the softmax (the
    a·s/h term goes); full recompute keeps the block input, s·b·h·B."""
    h, a = spec.hidden_size, spec.num_heads
    sbh = s * b * h
    if recompute == "full":
        return sbh * B
    scores = 0.0 if recompute == "selective" else a * s / (h * t)
    return sbh * (4 + 12 / t + scores) * B + 2 * 2 * s * b * 4


def korthikanti_published(spec: ModelSpec, b: int, s: int, t: int) -> float:
    """Their Eq. 2/4 as published, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes in 16-bit, in fp32 bytes (×2)."""
    h, a = spec.hidden_size, spec.num_heads
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * 2


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_block_activations_match_korthikanti_without_dropout(t, recompute):
    """With the math SDPA kernel (unfused attention) the block saves what Korthikanti et al. count."""
    b, s = 2, 128
    with sdpa_kernel(SDPBackend.MATH):
        m = measure_activations(GPT_SMALL, "block", b, s, t, "fp32", CPU, recompute)
    expected = ours_bytes(GPT_SMALL, b, s, t, 4, recompute)
    assert m.activation_bytes == pytest.approx(expected, rel=0.10)
    if recompute == "none":
        # and the published formula is above ours by the dropout terms
        dropout = s * b * GPT_SMALL.hidden_size * (2 + 3 * GPT_SMALL.num_heads * s / (GPT_SMALL.hidden_size * t))
        assert korthikanti_published(GPT_SMALL, b, s, t) - m.activation_bytes == pytest.approx(dropout * 4 / 2,
                                                                                                rel=0.10)


# A llama shape as in llama3-70b: SwiGLU with f/h = 3.5, grouped-query attention (8 heads, 2 k/v heads).
LLAMA_SMALL = ModelSpec(name="llama-small", arch="llama", vocab_size=256, hidden_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=2, ffn_hidden_size=448, max_seq_len=256)


# GPT-NeoX's block (parallel residual, a quarter of each head rotated) and OPT's ReLU MLP.
NEOX_SMALL = replace(GPT_SMALL, name="neox-small", arch="llama", position="rope", parallel_residual=True,
                     rotary_dim=4, layers=())
OPT_SMALL = replace(GPT_SMALL, name="opt-small", mlp="relu", layers=())
GEMMA_SMALL = replace(LLAMA_SMALL, name="gemma-small", mlp="geglu", head_dim=32, layers=())


def cpu_rms_norm_extra(spec: ModelSpec, kind: str, b: int, s: int, B: int, recompute: str) -> float:
    """CPU has no fused RMSNorm kernel: the composite one keeps an fp32 copy of its input and the fp32
    normalised value (8 bytes per value) where the fused CUDA kernel, which the formula counts, keeps
    the input (B bytes)."""
    if spec.norm != "rmsnorm" or recompute == "full" or kind == "embedding":
        return 0.0
    norms = 2 if kind == "block" else 1
    return norms * s * b * spec.hidden_size * (8 - B)


@pytest.mark.parametrize("spec", [GPT_SMALL, LLAMA_SMALL, NEOX_SMALL, OPT_SMALL, GEMMA_SMALL],
                         ids=["gpt2", "llama-gqa-f3.5", "neox-parallel-residual", "opt-relu", "gemma-geglu-wide-heads"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_analytic_block_counts_what_the_executors_block_saves(spec, dtype, t, recompute):
    """The formula the presets use (profiler.analytic) against the saved-tensor count of the executor's
    block with the default SDPA kernel (flash on CPU): no s² term, a gated MLP's three f-wide tensors (its
    fused gate keeps its inputs only), GQA's narrower k and v. The 1 % covers CPU's 16-bit LayerNorm
    statistics (the formula counts fp32)."""
    b, s, B = 2, 64, DTYPE_BYTES[dtype]
    m = measure_activations(spec, "block", b, s, t, dtype, CPU, recompute)
    analytic = layer_activation_bytes(spec, "block", b, s, t, dtype, recompute, sharded_inputs=True)
    assert m.activation_bytes == pytest.approx(analytic + cpu_rms_norm_extra(spec, "block", b, s, B, recompute),
                                               rel=0.01)


@pytest.mark.parametrize("spec", [GPT_SMALL, LLAMA_SMALL], ids=["gpt2", "llama-gqa-f3.5"])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_analytic_head_counts_the_log_softmax_of_its_vocabulary_shard(spec, t):
    """The executor's loss is vocabulary-parallel: a TP rank keeps the fp32 log-softmax of its V/t logits
    (the whole V when t does not divide V: the head is replicated, t = 3 here)."""
    b, s = 2, 64
    m = measure_activations(spec, "head", b, s, t, "bf16", CPU)
    analytic = layer_activation_bytes(spec, "head", b, s, t, "bf16")
    assert m.activation_bytes == pytest.approx(analytic + cpu_rms_norm_extra(spec, "head", b, s, 2, "none"),
                                               rel=0.01)
    vocab = spec.vocab_size if t == 3 else spec.vocab_size // t
    assert b * s * vocab * 4 < analytic < b * s * (vocab * 4 + 3 * spec.hidden_size * 2)


def test_selective_recompute_saves_only_the_log_sum_exp_under_fused_attention():
    """Checkpointing the attention core drops its log-sum-exp only: its output is still wo's input."""
    none = layer_activation_bytes(LLAMA_SMALL, "block", 1, 8192, 1, "bf16", "none")
    selective = layer_activation_bytes(LLAMA_SMALL, "block", 1, 8192, 1, "bf16", "selective")
    assert none - selective == 8192 * LLAMA_SMALL.num_heads * 4


def test_flash_kernel_saves_no_attention_scores():
    """The CPU default SDPA kernel keeps no s² tensor: activations grow linearly in s (per token constant)."""
    spec = builtin_model("tiny")
    per_token = [measure_activations(spec, "block", 1, s, 1, "fp32", CPU).activation_bytes / s for s in (32, 64)]
    assert per_token[1] == pytest.approx(per_token[0], rel=0.02)


@pytest.mark.parametrize("dtype,opt_per_param", [("fp32", 8), ("bf16", 12)])
def test_model_state_bytes(dtype, opt_per_param):
    """Parameters and gradients in the dtype; AdamW: two fp32 moments, plus the fp32 master copy in mixed
    precision (2 + 2 + 12 bytes per parameter, ZeRO's count), plus one step counter per tensor."""
    spec = builtin_model("tiny")
    st = measure_state(spec, "block", 1, dtype, CPU)
    assert st.parameters == block_params(spec)
    width = 4 if dtype == "fp32" else 2
    assert st.parameter_bytes == st.gradient_bytes == width * st.parameters
    assert opt_per_param * st.parameters <= st.optimizer_bytes <= opt_per_param * st.parameters + 8 * 16
    shard = measure_state(spec, "block", 2, dtype, CPU)
    assert shard.parameters == block_params(replace(spec, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                                                    layers=()))


def test_embedding_and_head_activations():
    spec = builtin_model("tiny")
    emb = measure_activations(spec, "embedding", 2, 16, 1, "fp32", CPU)
    assert emb.activation_bytes == 8 * 2 * 16  # the int64 token ids
    head = measure_activations(spec, "head", 2, 16, 2, "fp32", CPU)
    assert head.activation_bytes > 2 * 16 * (spec.vocab_size // 2) * 4  # at least the logits shard
    # BLOOM's embedding LayerNorm keeps its input and fp32 mean and rstd: the analytic count is what it saves
    bloom = replace(GPT_SMALL, name="bloom-small", position="alibi", embedding_norm=True, layers=())
    emb = measure_activations(bloom, "embedding", 2, 16, 1, "fp32", CPU)
    assert emb.activation_bytes == layer_activation_bytes(bloom, "embedding", 2, 16, 1, "fp32") \
        == 2 * 16 * (8 + bloom.hidden_size * 4 + 8)


def _sequence_parallel_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = []
        for name, spec in (("gpt2", GPT_SMALL), ("llama", LLAMA_SMALL)):
            for kind in ("block", "head"):
                case = build_tp_case(spec, kind, 2, 64, mesh, "bf16", CPU)
                params = [p._local_tensor if isinstance(p, DTensor) else p for p in case.parameters()]
                x = case.make_input()
                counter, out = saved_bytes(lambda c: case.module(x), params)
                rows.append(f"{name} {kind} {counter.bytes}")
                del out
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "saved.txt"), "w") as fh:
            fh.write("\n".join(rows))


@pytest.mark.slow
def test_analytic_sequence_parallel_counts_the_executors_sharded_norm_outputs(tmp_path):
    """The executor's own TP + sequence parallelism on 2 gloo ranks (profiler.layers.build_tp_case runs
    executor.parallelize.apply_tp and its vocabulary-parallel loss): the norms keep their sequence shard,
    and so do the q/k/v and w1/w3 Linears and the head's output Linear for their all-gathered inputs, as
    in Megatron-LM's sequence parallelism (Korthikanti Eq. 5); the head keeps the log-softmax of its
    vocabulary shard."""
    spawn_ranks(_sequence_parallel_worker, 2, free_port(), str(tmp_path))
    specs = {"gpt2": GPT_SMALL, "llama": LLAMA_SMALL}
    for line in (tmp_path / "saved.txt").read_text().split("\n"):
        name, kind, measured = line.split()
        spec = specs[name]
        analytic = layer_activation_bytes(spec, kind, 2, 64, 2, "bf16", "none", sequence_parallel=True,
                                          sharded_inputs=True)
        extra = cpu_rms_norm_extra(spec, kind, 2, 64, 2, "none") / 2  # the norms run on a sequence shard
        assert float(measured) == pytest.approx(analytic + extra, rel=0.01), line
        whole = layer_activation_bytes(spec, kind, 2, 64, 2, "bf16", "none", sequence_parallel=True)
        shards = 2 * 64 * spec.hidden_size * 2 / 2 * (2 if kind == "block" else 1)  # norm outputs kept / tp
        gated = 2 * 64 * spec.ffn_hidden_size // 2 * 2 if kind == "block" and spec.gated_mlp else 0
        assert whole - analytic == pytest.approx(shards + gated)
