"""Predicted against published: GPU training runs pinned to their published layouts.

    python benchmarks/published_runs.py [--source KEY ...] [--no-free]

Rows come from benchmarks/data/published_rows.json (each with its source, table and the quoted row). The
planner is pinned to the row's layout (tp, pp, dp, virtual stages, micro-batch, ZeRO, recompute) on a
preset cluster of the row's GPUs, 8 per node, and its predicted iteration time is set against the
published one: the iteration time where the source gives it, else the time its published TFLOP/s per
GPU imply under the source's own FLOP formula. Nothing in the cost model is fitted to these rows.
Rows whose layout is incomplete in the source (micro-batch, batch) are pinned where known; the planner
picks the rest. The last columns give the planner's free choice for the same model, cluster and batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from meshplan.planner.cluster_spec import DEVICE_PRESETS, LinkSpec, parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.errors import InfeasibleError, InputError
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.model_spec import ModelSpec, MoESpec
from meshplan.planner.search import find_plan
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.software import SOFTWARE as ENGINES
from meshplan.profiler.software import engine_limits, software_settings
from rich.console import Console
from rich.table import Table

ROWS = Path(__file__).with_name("data") / "published_rows.json"
# Sources whose rows carry a full dense layout and a bf16/fp16 time; the FSDP-only MPT table and the fp8
# pages are left to --source.
DEFAULT_SOURCES = ("megatron_sc21", "korthikanti_2022", "llama3_herd_2024", "bloom_bigscience", "mt_nlg_2022",
                   "dgxc_benchmarking", "nemotron4_2024")
# How each source's software ran (facts about the runs, not fitted values): a named software of
# profiler/software.py (its docstring has the sources), one with changes, or settings of its own.
# - SC'21's artifact (examples/sc21/run_table_1.sh) runs Megatron-LM in fp16 with DDP=local from 39B up and
#   DDP=torch (PyTorch's DDP, all-reducing bucket by bucket during the backward) below: the rows' `ddp_impl`;
#   Korthikanti et al. 2022 ran Megatron-LM with gradient accumulation fusion (83b1e42f30, 2022-02); BLOOM ran
#   Megatron-DeepSpeed with the BF16_Optimizer; Megatron-Core's 2024 table is Megatron-Core.
# - MT-NLG ran Megatron-DeepSpeed on DeepSpeed's pipeline engine (megatron-deepspeed-2022) before the
#   BF16_Optimizer: autograd adds each micro-batch into the 16-bit .grad (6 bytes), and the gradients are
#   reduce-scattered, not all-reduced whole.
# - Llama 3 (2024) ran flash attention and kept sequence-parallel activations as shards: it trained this
#   layout at 8K without activation checkpointing (§3.3.2), which needs them; fp32 gradients (§3.3.4). Its
#   FSDP "shards the optimizer states and gradients" (§3.3.2): each micro-batch's gradients are
#   reduce-scattered as the pipeline produces them (`sharded_accumulation`).
# - llm-foundry MPT under FSDP1: FlashAttention-1 (scripts/train/benchmarking at b2a43a147: sweep.sh passes
#   no --attn_impl, submit_benchmarks.py defaults it to 'triton', LLM Foundry's Triton port of
#   FlashAttention-1, and installs '.[gpu]', whose flash-attn is 1.0.9; FlashAttention-2 was the opt-in
#   'gpu-flash2' extra). FSDP1 gathers into its flat parameter and casts and pre-divides the gradient on its
#   post-backward stream, beside the compute (torch/distributed/fsdp/_runtime_utils.py _post_backward_hook,
#   _reduce_grad): no copies charged. Its PURE mixed precision reduces in bf16 (`software`). Its default loss
#   is fused ('fused_crossentropy': flash-attn's CrossEntropyLoss, llmfoundry/models/mpt/modeling_mpt.py).
# - torchtitan: its rows say which selective AC policy they ran (`selective_ac`) and which RMSNorm their
#   config chose (`norm_type`: "fused_rmsnorm", Triton; "rmsnorm", eager in fp32).
_NO_COPIES = dict(fsdp_copies=False)
SOFTWARE: dict[str, str | dict] = {
    "megatron_sc21": "megatron-2021",
    "korthikanti_2022": "megatron-2022",
    "bloom_bigscience": "megatron-deepspeed-2022",
    "mt_nlg_2022": software_settings("megatron-deepspeed-2022") | dict(grad_reduce="reduce_scatter",
                                                                       grad_accum_bytes=6),
    "llama3_herd_2024": dict(attention="flash", activations="sharded", sharded_accumulation=True, **_NO_COPIES),
    "megatron_readme_h100_2024": "megatron",
    # NeMo 24.07 and Megatron-Bridge run Megatron-Core with Transformer Engine; their rows are FP8 (`fp8`)
    "nemo_perf_summary": "megatron",
    "megatron_bridge_perf_summary": "megatron-bridge",  # its performance recipes: bf16 gradients
    "nemo_perf_summary_moe": "megatron-bridge",  # NeMo 2's performance scripts, Mixtral (MoE)
    # NVIDIA's DGX Cloud benchmarking recipes run NeMo 24.09/24.11 (Megatron-Core); their rows are BF16
    "dgxc_benchmarking": "megatron",
    # Nemotron-4 15B and 340B's pretraining runs (NVIDIA, 2024): Megatron tensor parallelism with the distributed
    # optimizer, BF16
    "nemotron4_2024": "megatron",
    "dgxc_benchmarking_fp8": "megatron",  # the same recipes' FP8 tables (Transformer Engine, delayed scaling)
    # NeMo 25.04.01's performance scripts on GB200 NVL72 and on DGX H100: NeMo 2's performance recipes, bf16
    # gradients and Transformer Engine's fused cross-entropy (NeMo v2.3.1 scripts/performance/utils.py
    # set_primary_perf_configs; profiler/software.py)
    "dgxc_benchmarking_gb200": "megatron-bridge",
    "dgxc_benchmarking_2505_h100": "megatron-bridge",
    "dgxc_benchmarking_moe": "megatron",  # Grok-1 (MoE): all-to-all token dispatcher, experts padded to capacity
    "llm_foundry_mpt": dict(attention="flash1", loss="fused", **_NO_COPIES),
    "torchtitan": "torchtitan",
    # OLMo-core's FSDP2 training (blocks compiled, torch SDPA): the executor's stack; its rows say which loss
    # ran (`fused_loss`)
    "olmo_core_readme": "torchtitan",
    # GPT-NeoX-20B: DeepSpeed's pipeline engine (DeeperSpeed 0.3.15) with its fp16 optimizer under ZeRO-1
    # ("reduce_scatter": true in configs/20B.yml), Megatron's fused softmax, fp16 gradients added up in autograd
    "gpt_neox_20b": software_settings("megatron-deepspeed-2022", "fp16") | dict(grad_reduce="reduce_scatter"),
    # OPT-175B: FairScale FSDP (flat parameters gathered in place: no copies) around Megatron TP without sequence
    # parallelism, fp16 gradients reduce-scattered during the backward, Megatron's fused softmax and fp32 loss
    "opt_175b": dict(attention="unfused", grad_overlap=True, grad_bytes=2, loss="megatron",
                     **_NO_COPIES),
    # BloombergGPT: SageMaker's ZeRO-3 (MiCS), bf16 with fp32 master weights, a fused masked-causal softmax
    # (no flash attention), the loss's softmax in fp32
    "bloomberggpt": dict(attention="unfused", grad_overlap=True, loss="megatron", **_NO_COPIES),
}



def named_software(row: dict) -> str | dict:
    """The row's software: a name of profiler/software.py, or settings of its own; `costed_as` (set by
    `--software NAME`): that engine instead of the source's, as a user who does not say gets it."""
    return row.get("costed_as") or SOFTWARE.get(row["source_key"], {})


# Context parallelism as each source ran it: Llama 3 all-gathers K and V before attention ("our CP
# implementation is all-gather based", arXiv:2407.21783 §3.3.2).
CP_MODE = {"llama3_herd_2024": "all-gather"}


# Stage splits other than the software's own (planner/stage_split.py):
# - BLOOM ran --pp-partition-method 'type:transformer|embedding', its tied embedding counted as a block at each end
#   (bigscience-workshop/bigscience train/tr11-176B-ml/README.md: "pp rank 0: [embed | 5 transformer blocks] ...
#   pp rank 11: [5 transformer blocks | embed]").
# - Llama 3 took one block off its first and its last stage for the embedding and the head (arXiv:2407.21783 §3.3.2).
# - Nemotron-4's pretraining (2024, before its June report) ran Megatron-Core before uneven stages existed
#   (Megatron-LM fa8bb5921b "Uneven Pipeline Parallelism", 2024-09-05, first released in core_r0.9.0): the
#   blocks split evenly.
# - Megatron-LM's README H100 table came with Megatron-Core r0.8.0 (f2e5db402c, 2024-07-15), before uneven stages.
# - NVIDIA's recipes (NeMo 24.07's and the DGX Cloud ones of NeMo 24.09-24.11, NeMo 1 YAML; NeMo 2 and
#   Megatron-Bridge) set no uneven first or last stage: Megatron-Core splits the blocks evenly. Their Llama 3.1
#   405B recipes count the embedding and the loss as a layer each: those rows say so (`layout.stage_split`).
STAGE_SPLIT = {"bloom_bigscience": "even-ends", "llama3_herd_2024": "even-ends", "nemotron4_2024": "even",
               "megatron_readme_h100_2024": "even", "nemo_perf_summary": "even", "dgxc_benchmarking": "even",
               "dgxc_benchmarking_fp8": "even", "dgxc_benchmarking_moe": "even", "dgxc_benchmarking_gb200": "even",
               "dgxc_benchmarking_2505_h100": "even", "megatron_bridge_perf_summary": "even",
               "nemo_perf_summary_moe": "even"}


# Interconnects that differ from the preset's DGX fabric, as the source documents them: BLOOM's Jean Zay nodes
# had 4 x 100 Gb/s Omni-Path links per node of 8 A100s (BLOOM paper, arXiv:2211.05100 §3.4.1), 6.25 GB/s
# per GPU, nominal (no measured bus bandwidth published).
# GPT-NeoX-20B's nodes had four ConnectX-6 HCAs (HDR, 200 Gb/s) for 8 A100s (arXiv:2204.06745 §2.3), 12.5 GB/s
# per GPU at the preset HDR's nccl-tests share (24 of 25). BloombergGPT's p4d.24xlarge have EFA at 400 Gb/s per node
# (arXiv:2303.17564 §3.3), 6.25 GB/s per GPU, nominal.
INTER_NODE = {"bloom_bigscience": LinkSpec(4 * 100e9 / 8 / 8, 4.0e-6),
              "gpt_neox_20b": LinkSpec(4 * 200e9 / 8 / 8, 4.0e-6, 24 / 25),
              "bloomberggpt": LinkSpec(4 * 100e9 / 8 / 8, 4.0e-6)}


def cluster_of(row: dict):
    per = row.get("gpus_per_node") or 8  # GB200: 4 GPUs per compute tray
    text = f"{row['num_gpus'] // per}x{per}x{row['gpu']}" if row["num_gpus"] > per else f"{per}x{row['gpu']}"
    cluster = parse_cluster(text)
    link = INTER_NODE.get(row["source_key"])
    return replace(cluster, inter_node=link) if link is not None else cluster


def software(row: dict) -> dict:
    """The row's software settings; sequence parallelism as the row's layout says (on when not given)."""
    lay = row["layout"]
    sp = lay.get("sequence_parallel") is not False
    # llm-foundry's PURE FSDP and NeMo's grad_sync_dtype bf16 (dgxc) keep and reduce gradients in bf16
    pure = "PURE" in (lay.get("dtype") or "") or lay.get("grad_dtype") == "bf16"
    selective = lay.get("selective_ac")  # torchtitan's selective AC policy (profiler/roofline.py)
    named = named_software(row)
    dtype = "fp16" if lay.get("dtype") == "fp16" else "bf16"
    base = software_settings(named, dtype) if isinstance(named, str) else named
    torch_ddp = lay.get("ddp_impl") == "torch"  # SC'21 below 39B: torch's DDP, overlapped buckets
    eager_norm = lay.get("norm_type") == "rmsnorm"  # torchtitan's eager RMSNorm (profiler/roofline.NORM)
    fused_loss = lay.get("fused_loss")  # OLMo-core's Triton cross-entropy (profiler/roofline.LOSS)
    return (base | {"sequence_parallel": sp} | ({"grad_bytes": 2} if pure else {})
            | ({"selective": selective} if selective else {}) | ({"grad_overlap": True} if torch_ddp else {})
            | ({"norm": "eager-fp32"} if eager_norm else {}) | ({"loss": "fused"} if fused_loss else {})
            | ({"fp8": fp8_recipe(row)} if row.get("fp8") else {})
            | ({"fp8_params": lay["fp8_params"]} if "fp8_params" in lay else {})
            | ({"opt_bytes": lay["optimizer_state_bytes"]} if "optimizer_state_bytes" in lay else {}))


def fp8_recipe(row: dict) -> str:
    """Transformer Engine's scaling as the row names it: current scaling ("FP8-CS"), else delayed (TE's default
    recipe, and NeMo 24.07's)."""
    return "current" if "current" in (row["layout"].get("dtype") or "") else "delayed"


def model_of(row: dict) -> ModelSpec:
    m = row["model"]
    base = builtin_model("llama3-70b" if m["arch"] == "llama" else "gpt3-175b")
    moe = MoESpec(**m["moe"]) if m.get("moe") else None
    return replace(base, name=row["id"], hidden_size=m["hidden_size"], num_layers=m["num_layers"],
                   num_heads=m["num_heads"], num_kv_heads=m.get("num_kv_heads") or m["num_heads"],
                   ffn_hidden_size=m.get("ffn_hidden_size") or 4 * m["hidden_size"], head_dim=0,
                   vocab_size=m["vocab_size"], max_seq_len=max(base.max_seq_len, m["seq_len"]),
                   position=m.get("position", base.position), embedding_norm=m.get("embedding_norm", False),
                   mlp=m.get("mlp", base.mlp), moe=moe, layers=(),
                   **{k: m[k] for k in ("tied_embeddings", "linear_bias", "rotary_dim", "parallel_residual", "qk_norm")
                      if k in m})


def megatron_flops(row: dict, batch: int, recompute: bool) -> float:
    """Narayanan et al. SC'21 Eq. 3: 96·B·s·l·h²(1 + s/6h + V/16lh) with full recompute; 72·B·s·l·h²(1 + s/6h +
    V/12lh) without (Korthikanti et al. 2022, the model FLOPs of its MFU)."""
    m = row["model"]
    s, L, h, V = m["seq_len"], m["num_layers"], m["hidden_size"], m["vocab_size"]
    if recompute:
        return 96.0 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72.0 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def published_time(row: dict, model: ModelSpec) -> float | None:
    """Seconds per iteration as published, or as the published TFLOP/s per GPU (or MFU) imply."""
    pub, lay, n = row["published"], row["layout"], row["num_gpus"]
    if pub.get("iteration_time_s"):
        return float(pub["iteration_time_s"])
    batch = lay.get("global_batch_size")
    if not batch:
        return None
    if pub.get("tokens_per_s_per_gpu"):  # measured throughput: no FLOP formula needed
        return batch * row["model"]["seq_len"] / (pub["tokens_per_s_per_gpu"] * n)
    if row["source_key"] == "megatron_readme_h100_2024" and pub.get("tflops_per_gpu"):
        return megatron_flops(row, batch, False) / (pub["tflops_per_gpu"] * 1e12 * n)
    if row["source_key"] in ("megatron_sc21", "mt_nlg_2022", "opt_175b") and pub.get("tflops_per_gpu"):
        return megatron_flops(row, batch, True) / (pub["tflops_per_gpu"] * 1e12 * n)
    if row["source_key"] == "gpt_neox_20b" and pub.get("tflops_per_gpu"):  # its logger's count (megatron/logging.py)
        m = row["model"]
        per_token = 6 * m["num_parameters"] + 60 * m["seq_len"] * m["hidden_size"] * m["num_layers"]
        return batch * m["seq_len"] * per_token / (pub["tflops_per_gpu"] * 1e12 * n)
    if pub.get("tflops_per_gpu"):  # model FLOPs (6·N·D plus attention), as Llama 3 reports them
        from meshplan.planner.cost_compute import model_flops_per_iteration

        flops = model_flops_per_iteration(model, batch, row["model"]["seq_len"])
        return flops / (pub["tflops_per_gpu"] * 1e12 * n)
    return None


def constraints_of(row: dict, pinned: bool) -> Constraints:
    lay, m = row["layout"], row["model"]
    c = Constraints(global_batch_size=lay["global_batch_size"], seq_len=m["seq_len"], top_k=1,
                    dtype="fp16" if lay.get("dtype") == "fp16" else "bf16")
    # the free choice, and what a pinned row does not publish (schedule, ZeRO, recompute), keep to what the
    # row's software runs
    named = named_software(row)
    engine = named if isinstance(named, str) else named.get("software")  # settings made from a named one
    c = replace(c, **engine_limits(engine)) if engine else c
    if not row.get("costed_as"):
        c = replace(c, stage_split=row["layout"].get("stage_split") or STAGE_SPLIT.get(row["source_key"]))
    if "moe_imbalance" in lay:  # how unevenly the source's router loads the experts: the workload's, not a layout's
        c = replace(c, moe_imbalance=lay["moe_imbalance"])
    if not pinned:
        return c
    v = lay.get("virtual_stages") or 1
    schedule = "interleaved-1f1b" if v > 1 else ("1f1b" if lay["pp"] > 1 else None)
    if lay.get("virtual_stages") is None:  # not published: the planner picks the schedule
        schedule = None
    cp = lay.get("cp") or 1
    if lay.get("ep"):  # mixture of experts: EP and the experts' TP
        c = replace(c, ep=lay["ep"], expert_tp=lay.get("expert_tp"))
    return replace(c, tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], micro_batch_size=lay.get("micro_batch_size"),
                   virtual_stages=v if v > 1 else None, schedule=schedule, recompute=lay.get("recompute"),
                   zero=lay.get("zero"), cp=cp, cp_mode=CP_MODE.get(row["source_key"], "ring") if cp > 1 else None)


def usable(row: dict) -> bool:
    lay = row["layout"]
    dims = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len")
    complete = all(row["model"].get(k) for k in dims) and bool(lay.get("global_batch_size"))
    te_fp8 = not row.get("fp8") or "Transformer Engine" in row["layout"]["dtype"] or "FP8-CS" in row["layout"]["dtype"]
    gpu = row["gpu"] in DEVICE_PRESETS and row["gpu"] != "cpu"  # a GPU preset (not Meta's 96 GB H100)
    return complete and te_fp8 and gpu and row["num_gpus"] % (row.get("gpus_per_node") or 8) == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", nargs="*", default=list(DEFAULT_SOURCES), help="source_key values of the rows")
    ap.add_argument("--row", nargs="*", help="only these row ids (of the sources given)")
    ap.add_argument("--no-free", action="store_true", help="skip the planner's free choice (faster)")
    gpus = [d for d in DEVICE_PRESETS if d != "cpu"]
    ap.add_argument("--gpu", choices=gpus, help="cost the rows on this device preset instead, 8 per node, "
                    "against the same published times: compares two presets on one run (e.g. b200-180gb)")
    ap.add_argument("--software", choices=list(ENGINES), help="cost every row as this engine runs it (meshplan: the "
                    "planner's default) instead of the software it ran")
    args = ap.parse_args()
    rows = [r for r in json.loads(ROWS.read_text())["rows"] if r["source_key"] in args.source and usable(r)]
    unknown = sorted(set(args.row or ()) - {r["id"] for r in rows})
    if unknown:  # a typo, a row of another --source, or one this benchmark cannot cost (incomplete, fp8 engine)
        ap.error(f"argument --row: no usable row {', '.join(unknown)} in --source {' '.join(args.source)}")
    rows = [r for r in rows if not args.row or r["id"] in args.row]
    if args.gpu:
        rows = [{**r, "gpu": args.gpu, "gpus_per_node": 8} for r in rows]
    if args.software:
        rows = [{**r, "costed_as": args.software} for r in rows]
    table = Table(title=f"predicted vs published ({len(rows)} rows, preset profiles)")
    for col in ("row", "GPUs", "layout", "published s", "predicted s", "error", "free choice", "free s"):
        table.add_column(col, justify="right")
    errors, start = [], time.perf_counter()
    by_source: dict[str, list[float]] = {}
    for row in rows:
        model = model_of(row)
        cluster = cluster_of(row)
        profile = preset_profile(model, cluster, constraints_of(row, True).dtype, **software(row))
        lay = row["layout"]
        cp_tag = f" c{lay['cp']}" if (lay.get("cp") or 1) > 1 else ""
        cp_tag += f" e{lay['ep']}" if (lay.get("ep") or 1) > 1 else ""
        layout = f"t{lay['tp']}{cp_tag} p{lay['pp']} d{lay['dp']} v{lay.get('virtual_stages') or '?'} " \
                 f"b{lay.get('micro_batch_size') or '?'} {lay.get('recompute') or '?'}"
        target = published_time(row, model)
        try:
            plan = find_plan(model, cluster, constraints_of(row, True), profile)
            pred = plan.predicted.iteration_time_s
            cell = f"{pred:.2f}"
        except (InfeasibleError, InputError) as exc:
            pred, cell = None, "no fit" if isinstance(exc, InfeasibleError) else "bad pin"
        err = ""
        if pred is not None and target:
            e = pred / target - 1
            errors.append(e)
            by_source.setdefault(row["source_key"], []).append(e)
            err = f"{e:+.1%}"
        free, free_s = "", ""
        if not args.no_free:
            try:
                fp = find_plan(model, cluster, constraints_of(row, False), profile)
                p = fp.parallel
                cp_tag = (f" c{p.cp}" if p.cp > 1 else "") + (f" e{p.ep}" if p.ep > 1 else "")
                free = f"t{p.tp}{cp_tag} p{p.pp} d{p.dp} v{p.virtual_stages} z{p.zero} b{p.micro_batch_size} " \
                       f"{p.recompute}"
                free_s = f"{fp.predicted.iteration_time_s:.2f}"
            except (InfeasibleError, InputError):
                free = "none"
        table.add_row(row["id"], str(row["num_gpus"]), layout, f"{target:.2f}" if target else "?", cell, err, free,
                      free_s)
    console = Console(width=160)
    console.print(table)
    if len(by_source) > 1:  # where the errors lean, source by source
        for key, errs in by_source.items():
            console.print(f"  {key}: {summary(errs)}")
    if errors:
        console.print(f"{summary(errors)} ({time.perf_counter() - start:.0f} s)")


def summary(errors: list[float]) -> str:
    abs_err = [abs(e) for e in errors]
    return (f"median |error| {statistics.median(abs_err):.1%}, worst {max(abs_err):.1%}, within 15 %: "
            f"{sum(e <= 0.15 for e in abs_err)}/{len(abs_err)}, mean signed {statistics.mean(errors):+.1%}")


if __name__ == "__main__":
    main()
