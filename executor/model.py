"""The reference decoder-only transformer built from a ModelSpec (gpt2 and llama architectures).

One module per ModelSpec layer — `embedding`, `blocks.<i>`, `head` — so that pipeline stages cut
exactly where the planner cut, and the profiler measures exactly what the executor runs. Attention
and MLP projections are separate Linears (wq/wk/wv/wo, w1/w2/w3) so tensor parallelism shards them
column-/row-wise as torchtitan does; head counts are read from the (possibly sharded) weights.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache, partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from meshplan.executor.activation import activation
from meshplan.executor.moe import MoE
from meshplan.planner.model_spec import ModelSpec, is_sparse_block
from torch.utils.checkpoint import checkpoint


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
    return nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None,
           dim: int | None = None) -> torch.Tensor:
    """Rotary position embedding on x [b, s, heads, head_dim], computed on the fly (no buffers, so
    meta-device construction and any sharding need no special handling). `positions`: the global
    positions of x's s tokens (context parallelism holds a chunk of the sequence); default 0..s-1.
    `dim`: rotate only each head's first `dim` dimensions (GPT-NeoX's rotary_pct); default all."""
    _, s, _, d = x.shape
    if dim is not None and dim < d:
        return torch.cat((rotary(x[..., :dim], theta, positions), x[..., dim:]), dim=-1)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=x.device) if positions is None else positions.to(x.device)
    angles = torch.outer(pos.to(torch.float32), inv)  # [s, d/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's head slopes (Press et al. 2022): the geometric sequence 2^(-8i/n) over the largest power of two
    n <= heads, and for the rest every other term of the sequence over 2n (as BLOOM builds them)."""
    closest = 2 ** math.floor(math.log2(heads))
    slopes = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    return slopes + [2 ** (-4 * (2 * i + 1) / closest) for i in range(min(closest, heads - closest))]


@lru_cache(maxsize=4)
def alibi_bias(s: int, heads: int, first: int, local: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[local, s, s] additive scores of heads first..first+local-1 of `heads`: slope·(j − i) on and below the
    diagonal, −inf above (causal). One tensor per shape and device, shared by every layer."""
    slopes = torch.tensor(alibi_slopes(heads)[first:first + local], device=device, dtype=torch.float32)
    i = torch.arange(s, device=device)
    offset = (i[None, :] - i[:, None]).to(torch.float32)  # j − i
    bias = slopes[:, None, None] * offset
    return bias.masked_fill(offset > 0, float("-inf")).to(dtype)


@lru_cache(maxsize=4)
def sliding_window_mask(s: int, window: int, device: torch.device) -> torch.Tensor:
    """[s, s] boolean: query i attends to keys i − window < j ≤ i (Mistral's window, the query itself included).
    One tensor per (s, window, device), shared by every layer (s² bytes: 1 GiB at 32K tokens)."""
    i = torch.arange(s, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset < window)


class Attention(nn.Module):
    """`recompute_core`: selective recompute (Korthikanti et al. 2022 §4.2.2) — the attention core
    softmax(QKᵀ)V is checkpointed, so only its inputs q, k, v are kept and it runs again in backward."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.recompute_core = False
        # context parallelism (executor/context_parallel.py): global positions of this rank's tokens and the
        # wrapper that runs the attention core across the CP group; None without CP
        self.positions: torch.Tensor | None = None
        self.cp_attention = None
        h, hd = spec.hidden_size, spec.head_dim
        q_dim, kv_dim = spec.num_heads * hd, spec.num_kv_heads * hd
        qkv_bias = spec.linear_bias or spec.qkv_bias
        self.head_dim = hd
        self.window = spec.sliding_window
        self.alibi_heads = spec.num_heads if spec.position == "alibi" else 0
        self.head_offset = 0  # the first of this rank's heads (tensor parallelism: executor/parallelize.apply_tp)
        self.rotary_dim = spec.rotated_dims
        self.rope_theta = spec.rope_theta if spec.position == "rope" else None
        self.wq = nn.Linear(h, q_dim, bias=qkv_bias)
        self.wk = nn.Linear(h, kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(h, kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(q_dim, h, bias=spec.linear_bias)
        # Qwen3: RMSNorm over each head's q and k before RoPE
        self.q_norm = nn.RMSNorm(hd, eps=spec.norm_eps) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=spec.norm_eps) if spec.qk_norm else None

    def attention_mask(self, s: int, heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """What the core adds to plain causal attention over s tokens (None: nothing; no CP, ModelSpec.cp_obstacle):
        a sliding window's band, and ALiBi's bias for this rank's `heads` heads, causal."""
        window = sliding_window_mask(s, self.window, device) if 0 < self.window < s else None
        if not self.alibi_heads:
            return window
        bias = alibi_bias(s, self.alibi_heads, self.head_offset, heads, device, dtype)
        return bias if window is None else bias.masked_fill(~window, float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # -1: local heads under tensor parallelism
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            q = rotary(q, self.rope_theta, self.positions, self.rotary_dim)
            k = rotary(k, self.rope_theta, self.positions, self.rotary_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = self.attention_mask(s, q.shape[1], q.dtype, x.device)
        core = partial(F.scaled_dot_product_attention, attn_mask=mask, is_causal=mask is None,
                       enable_gqa=k.shape[1] != q.shape[1])
        if self.recompute_core and torch.is_grad_enabled():
            core = partial(checkpoint, core, use_reentrant=False, preserve_rng_state=False)
        out = core(q, k, v) if self.cp_attention is None else self.cp_attention(core, q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _Gated(torch.autograd.Function):
    """act(a) · b keeping only a and b for backward, where autograd would also keep act(a) and the product's
    other factor: backward computes act(a) again (Megatron-Core's fused SwiGLU/GeGLU save their input only,
    megatron/core/fusions/fused_bias_swiglu.py). The product is w2's input, which w2 keeps."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, act) -> torch.Tensor:
        ctx.act = act
        ctx.save_for_backward(a, b)
        return act(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            a = a.detach().requires_grad_(True)
            gate = ctx.act(a)
        (grad_a,) = torch.autograd.grad(gate, a, grad * b)
        return grad_a, grad * gate.detach(), None


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.act = activation(spec)
        self.w1 = nn.Linear(h, f, bias=spec.linear_bias)
        self.w2 = nn.Linear(f, h, bias=spec.linear_bias)
        self.w3 = nn.Linear(h, f, bias=spec.linear_bias) if spec.gated_mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(_Gated.apply(self.w1(x), self.w3(x), self.act))
        return self.w2(self.act(self.w1(x)))


class Block(nn.Module):
    """Attention + feed-forward; block `index` of a MoE model is sparse per ModelSpec.moe (executor/moe.py).
    With `parallel_residual` both read the block input (GPT-NeoX, Falcon), else the MLP reads x + attention."""

    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.parallel_residual = spec.parallel_residual
        self.attention_norm = _norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = MoE(spec) if is_sparse_block(spec, index) else MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            return x + self.attention(self.attention_norm(x)) + self.feed_forward(self.ffn_norm(x))
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.norm = _norm(spec) if spec.embedding_norm else None  # BLOOM's word_embeddings_layernorm
        self.pos = nn.Embedding(spec.max_seq_len, spec.hidden_size) if spec.position == "learned" else None
        self.positions: torch.Tensor | None = None  # context parallelism: global positions of the local tokens
        self.scale = spec.hidden_size ** 0.5 if spec.embedding_scale else None  # Gemma

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.scale is not None:
            x = x * self.scale
        if self.norm is not None:
            x = self.norm(x)
        if self.pos is not None:
            pos = torch.arange(tokens.shape[1]) if self.positions is None else self.positions
            x = x + self.pos(pos.to(tokens.device))
        return x


class Head(nn.Module):
    """Final norm + LM head; returns logits (the loss is the pipeline's `loss_fn`)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm = _norm(spec)
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Transformer(nn.Module):
    """embedding -> blocks -> head. Pipeline stages keep a slice and set the rest to None (torchtitan)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.arch not in ("gpt2", "llama"):
            raise ValueError(f"executor.model builds gpt2/llama architectures, not '{spec.arch}'")
        self.spec = spec
        self.embedding: nn.Module | None = Embedding(spec)
        self.blocks = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.num_layers)})
        self.head: nn.Module | None = Head(spec)
        if spec.tied_embeddings:
            self.head.output.weight = self.embedding.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def keep_layers(self, start: int, end: int) -> "Transformer":
        """Keep ModelSpec layers [start, end) (0 = embedding, 1..L = blocks, L+1 = head)."""
        last = self.spec.num_layers + 1
        if start > 0:
            self.embedding = None
        if end <= last:
            self.head = None
        for i in list(self.blocks.keys()):
            if not start <= int(i) + 1 < end:
                del self.blocks[i]
        return self


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def _seed_for(name: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(name: str, shape: torch.Size, spec: ModelSpec, seed: int) -> torch.Tensor:
    """Full (unsharded) initial value of parameter `name`, a function of (seed, name) alone, so every
    plan — any sharding, any stage cut — starts from the same model. GPT-2 init: N(0, 0.02), output
    projections N(0, 0.02 / sqrt(2L)), norms 1, biases 0."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = 0.02
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std = 0.02 / math.sqrt(2 * spec.num_layers)
    gen = torch.Generator().manual_seed(_seed_for(name.replace("head.output.weight", "embedding.tok.weight")
                                                  if spec.tied_embeddings else name, seed))
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Initialise a materialised (non-meta, unsharded) model deterministically."""
    for name, p in model.named_parameters():
        p.copy_(init_value(name, p.shape, model.spec, seed))
