"""Per-operation time of a layer on hardware that is not present (presets), from the device's sourced
figures (docs/sources/hardware_constants.md):

- GEMMs by shape (M, N, K): the largest-GEMM ceiling measured on the device (MAMF) times cuBLAS's tile
  and wave quantisation (NVIDIA Matrix Multiplication Background guide §3.1-3.2: 256x128 output tiles,
  the most efficient cuBLAS tile, §2.3; one wave = one tile per SM) and, where a K sweep is published
  (H100; A100's derived from it), the share of a tile's time its K loop takes (K/(K + K0)), bounded below
  by the bytes moved over HBM (roofline). Backward = the two GEMMs of dX and dW.
- Causal attention, fused (flash): FLOPs of the causal core (flash-attention's own count: half of
  4·b·s²·heads·head_dim forward, 2.5x that backward) at flash-attention-2's measured fwd+bwd rate for
  the device, sequence length and head size. Unfused (Megatron-LM before flash attention, with dropout
  on the probabilities, as Korthikanti et al. 2022 count it): QKᵀ and AV as batched GEMMs, the fused
  scale-mask-softmax and the dropout as bytes over HBM, on the full s x s matrix.
- Memory-bound ops (norms, activations, rotary, residuals and dropout, loss): bytes over HBM at the
  achievable fraction; backward moves about twice the forward's bytes (reads the gradient and the saved
  input, writes the input gradient).
- Gradient accumulation where the software adds each micro-batch's weight gradients in a pass of its own
  (no fusion into the wgrad GEMM): bytes per weight over HBM (`grad_accum_bytes`; 0 by default).
- Every kernel takes at least the launch floor.
The measured-profile path (profiler/measure.py) does not use this module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

from meshplan.planner.errors import InputError
from meshplan.planner.fields import Fields
from meshplan.planner.model_spec import ModelSpec, vocab_shard
from meshplan.planner.plan import FP8_RECIPES
from meshplan.profiler.moe_cost import block_ffn_time_correction

ATTENTION = ("flash", "unfused")
ACTIVATIONS = ("gathered", "sharded")
GRAD_REDUCE = ("reduce_scatter", "all_reduce")
# What "selective" recompute reruns, by software: "attention": the attention core (Korthikanti et al. 2022
# §4.2.2; Megatron-LM, the executor). torchtitan's selective AC (torchtitan/parallelisms/
# parallelize_llama.py at 1ea476e9f, 2024-04): "every-second-mm" is its 'op' policy, which saves the outputs
# of matmuls, SDPA and reduce-scatters "except every second mm" (counted per block in call order: wq, wk,
# wv, wo, w1, w3, w2) and reruns everything else; "every-second-block" is its layer policy with
# selective_ac_option '2', full recompute of every second block.
SELECTIVE = ("attention", "every-second-mm", "every-second-block")
# The loss, by the HBM passes its kernels make over the logits (bytes per logit, B = 2: the 16-bit logits):
# - "fp32", eager PyTorch as the executor and torchtitan run it, F.cross_entropy(logits.float()): the cast
#   (read B, write 4) and log_softmax (read 4, write 4, kept for backward); backward: nll_loss's zero-filled
#   gradient (write 4), log_softmax's backward (read 4 + 4, write 4), the cast back (read 4, write B).
# - "megatron", Megatron-LM's unfused vocab-parallel cross-entropy (logits.float(), then megatron/core/
#   tensor_parallel/cross_entropy.py; the same in Megatron-LM 2021-22 and Megatron-DeepSpeed's mpu, and
#   Megatron-Core's default, cross_entropy_loss_fusion off): the cast, a max (read 4), the max subtracted
#   (read 4, write 4), exp in place (read 4, write 4), a sum (read 4), the division in place (read 4,
#   write 4, kept as the softmax); backward: one in-place multiply (read 4, write 4), the cast back.
# - "fused", a fused cross-entropy kernel (flash-attn's losses/cross_entropy.py, llm-foundry's default
#   loss_fn 'fused_crossentropy'): it keeps the 16-bit logits and an fp32 log-sum-exp per token, reads the
#   logits once forward and once backward, and writes their 16-bit gradient.
LOSS = ("fp32", "fused", "megatron")
# The pipeline engine's point-to-point transfers. "overlapped": a stage pays one transfer per neighbour and
# micro-batch, of b·s·h/t values with tensor parallelism (torch.distributed.pipelining's asynchronous P2P;
# Megatron-LM's send-and-receive pairs with its scatter-gather of the stage output, Narayanan et al. SC'21
# §4.1). "blocking": DeepSpeed's pipeline engine (deepspeed/runtime/pipe/engine.py _exec_send_activations /
# _exec_send_grads, p2p.py send and recv: "Doesnt support async_op true") sends each stage output and
# input gradient whole from every tensor-parallel rank, in separate blocking calls: the stage waits out
# both transfers with each neighbour, b·s·h values each.
P2P = ("overlapped", "blocking")
# The norms' kernels. "fused": one kernel reads the input and writes the output (Apex / Transformer Engine
# LayerNorm, Triton RMSNorm, torch's native layer_norm). "eager-fp32": RMSNorm as separate eager ops on an
# fp32 copy, as torchtitan's "rmsnorm" (torchtitan/models/norms.py: self._norm(x.float()).type_as(x) *
# weight, _norm = x * rsqrt(x.pow(2).mean(-1) + eps)) and Hugging Face's LlamaRMSNorm write it: the cast
# (read B, write 4), pow (read 4, write 4), mean (read 4), the product with rsqrt (read 4, write 4), the
# cast back (read 4, write B), the weight (read B, write B): 28 + 4B bytes per element. (The fp32 tensors
# it saves for backward are not in the activation count.)
NORM = ("fused", "eager-fp32")
# FP8 linear layers (Transformer Engine's recipes, as Megatron-Core and NeMo run them; hybrid format, E4M3
# forward, E5M2 gradients): the blocks' Linear GEMMs (q/k/v, output projection, MLP) run on the FP8 tensor
# cores, the attention core, embedding and LM head stay 16-bit. "none": off. "delayed": delayed scaling, each
# cast's scale from an amax history, so the amax is taken in the cast kernel itself; "current": per-tensor
# current scaling (FP8-CS, torchao's tensorwise), an amax pass over the tensor before each cast.
# Transformer Engine's LayerNormLinear writes the norm's output in FP8 directly (the q/k/v and first MLP
# GEMMs' inputs); the output projection's and the last MLP GEMM's inputs (the attention core's and the
# activation's 16-bit outputs) are cast by their TE Linear, and in backward every Linear casts its output
# gradient. A cast reads the 16-bit tensor and writes it in FP8 and transposed in FP8 (Hopper's FP8 GEMMs
# take only the TN layout, so the wgrad GEMM needs the transposes): B + 2 bytes per element; current scaling
# reads it once more. The FP8 weights (and their transposes) are cast once per step and cached across
# micro-batches (TE's is_first_microbatch), so their cast is not charged per micro-batch.
FP8 = FP8_RECIPES
# How a mixture-of-experts layer meets expert tensor parallelism (expert_tp = tp > 1; planner/cost_ep.py).
# "sharded": Megatron-Core's alltoall token dispatcher (megatron/core/transformer/moe/token_dispatcher.py,
# MoEAlltoAllTokenDispatcher.dispatch_postprocess / combine_preprocess), and the executor's
# (executor/expert_parallel.py AllToAllDispatch), dispatch each TP rank's sequence shard over EP, then
# all-gather the received rows over the expert-TP group and reduce-scatter the experts' output before the
# combine; shared experts gather and reduce-scatter the sequence over TP on their own (Megatron-Core's
# shared_experts.py). "gathered": an engine that gathers the sequence as the dense MLP does before routing,
# so that every TP rank dispatches all of its tokens' rows and the block's output is reduce-scattered as the
# dense MLP's.
MOE_DISPATCH = ("gathered", "sharded")


def norm_bytes(norm: str, B: int) -> float:
    """Bytes a norm's forward moves over HBM per element (NORM)."""
    return 28.0 + 4 * B if norm == "eager-fp32" else 2.0 * B


def loss_bytes(loss: str, B: int) -> tuple[float, float]:
    """(forward, backward) bytes the loss moves over HBM per logit (LOSS)."""
    if loss == "fused":
        return B, 2 * B
    if loss == "megatron":
        return B + 4 + 4 + 8 + 8 + 4 + 8, 8 + 4 + B
    return B + 4 + 8, 4 + 12 + 4 + B
TILE_M, TILE_N = 256, 128  # cuBLAS's most efficient tile (Matrix Multiplication Background guide §2.3)


# Mixed-precision optimizer state per parameter by default: an fp32 master copy and two fp32 Adam moments
OPT_BYTES = 12.0


@dataclass(frozen=True)
class Roofline:
    """Device rates for one dtype, and the attention kernel the training software runs."""

    peak_flops: float  # dense tensor-core peak (datasheet)
    gemm_fraction: float  # MAMF / peak: largest GEMM throughput measured on the device
    sm_count: int
    hbm_Bps: float  # datasheet HBM bandwidth
    hbm_fraction: float  # achievable share of it for streaming kernels
    attention_flops: dict[str, list[list[float]]]  # "hd64"/"hd128": [[seq_len, FLOP/s fwd+bwd causal], ...]
    launch_s: float  # floor per kernel
    # The training software, for presets: the executor's by default. "unfused": Megatron-LM 2021-22,
    # softmax and dropout materialised. activations "sharded": with sequence parallelism a column-parallel
    # Linear keeps its input's sequence shard and gathers it again in backward, behind other backward work
    # (Megatron-LM, Korthikanti et al. 2022 Eq. 5: behind the input-gradient GEMM; the executor,
    # executor/parallelize.keep_input_shard: behind the module's last layers), and a gated MLP keeps its
    # activation's inputs only (Megatron-Core's fused SwiGLU, the executor's model._Gated); "gathered": the
    # Linear keeps the gathered input, the gated MLP its activation's output too (torch's SequenceParallel
    # as torchtitan runs it).
    # grad_overlap False: the data-parallel reduction starts after the whole backward (Megatron-LM's local
    # DDP of 2021-22), else bucket by bucket during it.
    # sequence_parallel False: norms and dropout run on the whole sequence on every TP rank (Megatron-LM
    # before Korthikanti et al. 2022); the executor always shards them when tp > 1.
    attention: str = "flash"
    activations: str = "sharded"
    grad_overlap: bool = True
    sequence_parallel: bool = True
    dtype_bytes: int = 2
    # Share of one device's measured rates a synchronous group runs at: every collective waits for its
    # slowest GPU, and GPUs of one model differ by "5% and higher ... on an 8-gpu node" (stas00/
    # ml-engineering compute/accelerator/README.md, "Not all accelerators are created equal"). 1: one GPU.
    pace: float = 1.0
    comm_sms: int = 0  # SMs an overlapped NCCL collective occupies (planner/cost_collectives.overlap_tax)
    # Gradients held and reduced over data parallelism: 4 bytes (fp32) as the executor, Megatron-LM in bf16,
    # DeepSpeed's BF16_Optimizer and Llama 3 run them (planner/cost_memory.py); 2 for Megatron-LM in fp16
    # (its default, accumulate_allreduce_grads_in_fp32 off). grad_reduce "all_reduce": ZeRO-1 that
    # all-reduces whole gradients and updates its optimizer shard (DeepSpeed's BF16_Optimizer), else a
    # reduce-scatter.
    grad_bytes: int = 4
    grad_reduce: str = "reduce_scatter"
    # GEMM tile fixed cost in units of K, and the K of the MAMF shape (planner/cluster_spec.py); 0: none
    gemm_k0: float = 0.0
    gemm_k_ref: float = 0.0
    # Bytes per parameter a separate pass moves each micro-batch to add the weight gradients into the
    # accumulator (read the new gradient, read and write the accumulator). 0: none, as where the wgrad GEMM
    # accumulates into it itself (Megatron-LM's gradient accumulation fusion, since 2022).
    grad_accum_bytes: float = 0.0
    selective: str = "attention"  # what selective recompute reruns (SELECTIVE)
    # The data-parallel engine copies parameters out of its all-gather buffer and gradients into its
    # reduce buffer (FSDP2: the executor, torchtitan; planner/cost_collectives.engine_copy_time). False for
    # engines whose buffers are the parameters' and gradients' own storage (Megatron-LM's DDP and
    # distributed optimizer), or whose copies are not modelled.
    fsdp_copies: bool = True
    loss: str = "fp32"  # LOSS
    p2p: str = "overlapped"  # P2P
    # A pipelined ZeRO-2/3 plan keeps its gradients sharded through gradient accumulation, reduce-scattering
    # each micro-batch's (Llama 3's FSDP "shards the optimizer states and gradients", arXiv:2407.21783
    # §3.3.2). False: full gradients are accumulated and reduced after the last micro-batch, as
    # torch.distributed.pipelining (the executor, torchtitan) and Megatron's distributed optimizer do.
    sharded_accumulation: bool = False
    norm: str = "fused"  # NORM
    software: str = "meshplan"  # the name these settings were made from (profiler/software.py), for reports
    fp8: str = "none"  # FP8
    moe_dispatch: str = "sharded"  # MOE_DISPATCH
    # Under an FP8 recipe, the blocks' Linear weights kept in FP8 with no 16-bit copy (Megatron-Core's
    # --fp8-param-gather; planner/cost_memory.py), not cast from 16-bit parameters each step (the executor).
    fp8_params: bool = False
    # Optimizer state per parameter in mixed precision: an fp32 master copy and two fp32 Adam moments, 12 bytes,
    # as the executor's AdamW, Megatron's distributed optimizer and DeepSpeed keep them. Apex's
    # DistributedFusedAdam as NeMo 1 sets it up (nemo/collections/nlp/models/language_modeling/
    # megatron_base_model.py setup_optimization, megatron_amp_O2 in bf16): with its default fp32 state it keeps
    # only the low 16 bits of the master copy (store_param_remainders: 2 + 4 + 4 = 10); with optim.dtype bf16
    # the bf16 parameters are the master copy (store_params off) and the moments are bf16 (2 + 2 = 4); with
    # FP8 parameters it stores a master copy in that dtype (3 × its bytes). planner/cost_memory.py holds it.
    opt_bytes: float = OPT_BYTES
    # The device's FP8 tensor-core rates (0: none): dense peak, MAMF / peak, and the K of the MAMF shape
    fp8_peak_flops: float = 0.0
    fp8_gemm_fraction: float = 0.0
    fp8_gemm_k_ref: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, path: str) -> Roofline:
        f = Fields(data, path)
        table = f.obj("attention_flops").data
        if not isinstance(table, dict) or not table:
            raise InputError(f"{path}.attention_flops: expected an object of [seq_len, FLOP/s] lists")
        pace = f.float("pace", min=0.0, default=1.0)
        if not 0.0 < pace <= 1.0:
            raise f.fail("pace", "a number in (0, 1]", pace)
        return cls(f.float("peak_flops", min=1.0), f.float("gemm_fraction", min=0.0), f.int("sm_count", min=1),
                   f.float("hbm_Bps", min=1.0), f.float("hbm_fraction", min=0.0),
                   {k: [[float(a), float(b)] for a, b in v] for k, v in table.items()}, f.float("launch_s", min=0.0),
                   f.str("attention", choices=ATTENTION, default="flash"),
                   f.str("activations", choices=ACTIVATIONS, default="gathered"),
                   f.bool("grad_overlap", default=True), f.bool("sequence_parallel", default=True),
                   f.int("dtype_bytes", min=1, default=2), pace,
                   f.int("comm_sms", min=0, default=0), f.int("grad_bytes", min=1, default=4),
                   f.str("grad_reduce", choices=GRAD_REDUCE, default="reduce_scatter"),
                   f.float("gemm_k0", min=0.0, default=0.0), f.float("gemm_k_ref", min=0.0, default=0.0),
                   f.float("grad_accum_bytes", min=0.0, default=0.0),
                   f.str("selective", choices=SELECTIVE, default="attention"),
                   f.bool("fsdp_copies", default=True), f.str("loss", choices=LOSS, default="fp32"),
                   f.str("p2p", choices=P2P, default="overlapped"),
                   f.bool("sharded_accumulation", default=False), f.str("norm", choices=NORM, default="fused"),
                   f.str("software", default="meshplan"), fp8=f.str("fp8", choices=FP8, default="none"),
                   moe_dispatch=f.str("moe_dispatch", choices=MOE_DISPATCH, default="sharded"),
                   fp8_params=f.bool("fp8_params", default=False),
                   opt_bytes=f.float("opt_bytes", min=0.0, default=OPT_BYTES),
                   fp8_peak_flops=f.float("fp8_peak_flops", min=0.0, default=0.0),
                   fp8_gemm_fraction=f.float("fp8_gemm_fraction", min=0.0, default=0.0),
                   fp8_gemm_k_ref=f.float("fp8_gemm_k_ref", min=0.0, default=0.0))

    # ---- primitives ----

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of `batch` GEMMs [m, k] x [k, n] in this dtype."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N) * batch
        waves = math.ceil(tiles / self.sm_count)
        # useful share of the launched tiles (tile quantisation) and of the SM slots (wave quantisation)
        used = m * n * batch / (waves * self.sm_count * TILE_M * TILE_N)
        compute = 2.0 * m * n * k * batch / (self.peak_flops * self.gemm_fraction * self.pace * min(1.0, used)
                                              * self.k_efficiency(k))
        memory = self.bytes_time((m * k + k * n + m * n) * batch * self.dtype_bytes)
        return max(compute, memory, self.launch_s)

    @functools.cached_property
    def linear(self) -> Roofline:
        """The rates the blocks' Linear GEMMs run at: FP8's under an FP8 recipe (its peak and measured MAMF,
        1-byte operands), else these. The tile's fixed cost is the same time at twice the K rate: K0 x 2
        (derived, as A100's in planner/cluster_spec.py)."""
        if self.fp8 == "none":
            return self
        return replace(self, peak_flops=self.fp8_peak_flops, gemm_fraction=self.fp8_gemm_fraction,
                       gemm_k0=2 * self.gemm_k0, gemm_k_ref=self.fp8_gemm_k_ref, dtype_bytes=1, fp8="none")

    @property
    def fp8_cast_bytes(self) -> float:
        """Bytes an FP8 cast moves per element (FP8): it reads the 16-bit tensor and writes it in FP8 and
        transposed; current scaling reads it once more for the amax. 0 without a recipe."""
        if self.fp8 == "none":
            return 0.0
        return self.dtype_bytes + 2 + (self.dtype_bytes if self.fp8 == "current" else 0)

    def k_efficiency(self, k: float) -> float:
        """Each output tile pays a fixed prologue and epilogue besides its K loop: throughput ∝ K/(K + K0),
        relative to the MAMF shape's K (at most 1: MAMF is the measured ceiling)."""
        if self.gemm_k0 <= 0 or self.gemm_k_ref <= 0:
            return 1.0
        return min(1.0, k / (k + self.gemm_k0) * (self.gemm_k_ref + self.gemm_k0) / self.gemm_k_ref)

    def gemm_fwd_bwd(self, m: float, n: float, k: float) -> tuple[float, float]:
        """Y[m,n] = X[m,k] W[k,n]: forward, and backward dX = dY Wᵀ plus dW = Xᵀ dY."""
        return self.gemm(m, n, k), self.gemm(m, k, n) + self.gemm(k, n, m)

    def accumulate(self, params: float) -> float:
        """Seconds of adding one micro-batch's gradients of `params` weights into the accumulator."""
        return self.bytes_time(params * self.grad_accum_bytes) if self.grad_accum_bytes > 0 else 0.0

    def bytes_time(self, nbytes: float) -> float:
        return max(nbytes / (self.hbm_Bps * self.hbm_fraction), self.launch_s if nbytes > 0 else 0.0)

    def flash_rate(self, s: int, head_dim: int) -> float:
        """Flash-attention-2's measured causal fwd+bwd FLOP/s, interpolated over log2(seq_len) (clamped)
        and head size (the table's nearest: 64 or 128)."""
        key = "hd64" if head_dim <= 96 and "hd64" in self.attention_flops else "hd128"
        points = sorted(self.attention_flops.get(key) or next(iter(self.attention_flops.values())))
        if s <= points[0][0]:
            return points[0][1]
        for (s0, r0), (s1, r1) in zip(points, points[1:]):
            if s <= s1:
                w = (math.log2(s) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + w * (r1 - r0)
        return points[-1][1]

    # ---- layers ----

    def attention_core(self, spec: ModelSpec, b: int, s: int, tp: int) -> tuple[float, float]:
        """(forward, backward) of softmax(QKᵀ)V over this rank's heads."""
        heads = max(1, spec.num_heads // tp)
        d = spec.head_dim
        if self.attention == "flash":
            # flash-attention's benchmark count (causal is half of s²); a sliding window scores its band, at the
            # rate of a causal core as long as the window (flash-attention's local attention skips the blocks
            # outside it)
            causal = 4.0 * b * spec.attention_pairs(s) * heads * d
            rate = self.flash_rate(min(s, spec.sliding_window or s), d) * self.pace
            return max(causal / rate, self.launch_s), max(2.5 * causal / rate, self.launch_s)
        batch = b * heads
        scores = batch * s * s * self.dtype_bytes
        mask = batch * s * s  # dropout mask, one byte per element
        fwd = (self.gemm(s, s, d, batch) + self.bytes_time(2 * scores)  # QKᵀ; scale-mask-softmax in, out
               + self.bytes_time(2 * scores + mask) + self.gemm(s, d, s, batch))  # dropout; AV
        bwd = (self.gemm(s, s, d, batch) + self.gemm(s, d, s, batch)  # dP = dO Vᵀ, dV = Pᵀ dO
               + self.bytes_time(3 * scores + mask) + self.bytes_time(3 * scores)  # dropout, softmax backward
               + 2 * self.gemm(s, d, s, batch))  # dQ = dS K, dK = dSᵀ Q
        return fwd, bwd

    def mlp_activation_bytes(self, gated: bool) -> int:
        """Bytes an MLP's activation moves forward per element of its width: gated, SiLU or GELU of w1 x
        (read, write) and its product with w3 x (two reads, a write); else (bias-)GELU (read, write)."""
        return 5 * self.dtype_bytes if gated else 2 * self.dtype_bytes

    def elementwise(self, spec: ModelSpec, b: int, s: int, tp: int, sequence_parallel: bool) -> float:
        """Forward seconds of a block's memory-bound ops (bytes read + written per token)."""
        B = self.dtype_bytes
        h, f = spec.hidden_size, spec.ffn_hidden_size / tp
        q, kv = spec.num_heads * spec.head_dim / tp, spec.num_kv_heads * spec.head_dim / tp
        sp = tp if sequence_parallel else 1
        ops = [norm_bytes(self.norm, B) * h / sp] * 2  # two norms
        if self.attention == "unfused":  # Megatron: bias-dropout-add (2 reads, 1 write, a 1-byte mask), twice
            ops += [(3 * h * B + h) / sp] * 2
        else:  # residual adds
            ops += [3 * h * B / sp] * 2
        ops += [f * self.mlp_activation_bytes(spec.gated_mlp)]
        if spec.position == "rope":
            rotated = spec.rotated_dims / spec.head_dim  # GPT-NeoX rotates a part of each head
            ops += [2 * (q + kv) * rotated * 4 * 2]  # rotary on q and k, computed in fp32: read, write
        if spec.qk_norm:  # Qwen3, OLMo 2: a norm over each head of q and of k
            ops += [norm_bytes(self.norm, B) * (q + kv)]
        tokens = b * s
        return sum(self.bytes_time(tokens * o) for o in ops)

    def fp8_casts(self, spec: ModelSpec, b: int, s: int, tp: int, sequence_parallel: bool) -> tuple[float, float]:
        """(forward, backward) seconds of a block's FP8 casts under an FP8 recipe (FP8): forward, the inputs of
        the output projection and of the last MLP GEMM (with current scaling also an amax pass over the two
        norm outputs); backward, the output gradient of each Linear."""
        cast = self.fp8_cast_bytes
        if not cast:
            return 0.0, 0.0
        h, f = spec.hidden_size, spec.ffn_hidden_size / tp
        q, kv = spec.num_heads * spec.head_dim / tp, spec.num_kv_heads * spec.head_dim / tp
        sp = tp if sequence_parallel else 1
        amax = self.dtype_bytes if self.fp8 == "current" else 0
        gated = 2 if spec.gated_mlp else 1
        fwd = [q * cast, f * cast] + [h / sp * amax] * 2
        bwd = [(q + 2 * kv) * cast, h / sp * cast, gated * f * cast, h / sp * cast]
        tokens = b * s
        return (sum(self.bytes_time(tokens * o) for o in fwd if o > 0),
                sum(self.bytes_time(tokens * o) for o in bwd))

    def layer(self, spec: ModelSpec, kind: str, b: int, s: int, tp: int,
              sequence_parallel: bool | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of one layer for one micro-batch on one TP rank."""
        sp = (tp > 1 and self.sequence_parallel) if sequence_parallel is None else sequence_parallel
        T, h, B = b * s, spec.hidden_size, self.dtype_bytes
        if kind == "block":
            q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            f = spec.ffn_hidden_size
            shapes = [(T, (q + 2 * kv) / tp, h), (T, h, q / tp)]
            shapes += [(T, f / tp, h)] * (2 if spec.gated_mlp else 1) + [(T, h, f / tp)]
            fwd, bwd = self.fp8_casts(spec, b, s, tp, sp)
            for m, n, k in shapes:
                a, g = self.linear.gemm_fwd_bwd(m, n, k)
                fwd, bwd = fwd + a, bwd + g + self.accumulate(n * k)
            af, ab = self.attention_core(spec, b, s, tp)
            el = self.elementwise(spec, b, s, tp, sp)
            mf, mb = block_ffn_time_correction(self, spec, T, tp, sp)  # MoE feed-forward (profiler/moe_cost.py)
            return fwd + af + el + mf, bwd + ab + 2 * el + mb
        if kind == "head":
            V = vocab_shard(spec, tp)
            a, g = self.gemm_fwd_bwd(T, V, h)
            g += self.accumulate(V * h)
            norm = self.bytes_time(T * norm_bytes(self.norm, B) * h / (tp if sp else 1))
            fwd, bwd = loss_bytes(self.loss, B)
            return a + norm + self.bytes_time(T * V * fwd), g + 2 * norm + self.bytes_time(T * V * bwd)
        if kind == "embedding":  # the row gather reads and writes h values a token; Gemma's scaling, a pass more
            gather = self.bytes_time(T * ((4 if spec.embedding_scale else 2) * h * B + 8))
            norm = self.bytes_time(T * norm_bytes(self.norm, B) * h) if spec.embedding_norm else 0.0  # BLOOM
            return gather + norm, 2 * (gather + norm) + self.accumulate(vocab_shard(spec, tp) * h)
        raise ValueError(f"unknown layer kind {kind!r}")

    def recompute(self, spec: ModelSpec, b: int, s: int, tp: int, mode: str) -> float:
        """Forward work run again in backward: the whole block (full), or what the software's selective
        policy reruns (`selective`, SELECTIVE)."""
        if mode == "full" or (mode == "selective" and self.selective == "every-second-block"):
            return self.layer(spec, "block", b, s, tp)[0] * (1.0 if mode == "full" else 0.5)
        if mode == "selective" and self.selective == "every-second-mm":
            T, h, f = b * s, spec.hidden_size, spec.ffn_hidden_size / tp
            q, kv = spec.num_heads * spec.head_dim / tp, spec.num_kv_heads * spec.head_dim / tp
            calls = [(T, q, h), (T, kv, h), (T, kv, h), (T, h, q)]  # wq, wk, wv, wo: separate Linears
            calls += [(T, f, h), (T, f, h), (T, h, f)] if spec.gated_mlp else [(T, f, h), (T, h, f)]
            sp = tp > 1 and self.sequence_parallel
            return sum(self.linear.gemm(*c) for c in calls[1::2]) + self.elementwise(spec, b, s, tp, sp)
        if mode == "selective":
            return self.attention_core(spec, b, s, tp)[0]
        return 0.0
