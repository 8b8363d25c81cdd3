"""benchmarks/published_runs.py: each row is charged the software its source documents."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import published_runs  # noqa: E402

ROWS = json.loads((BENCH / "data" / "published_rows.json").read_text())["rows"]


def test_sc21_rows_reduce_as_their_script_ran():
    """SC'21's artifact (examples/sc21/run_table_1.sh) runs DDP=torch below 39B and DDP=local from 39B up:
    torch's DDP all-reduces bucket by bucket during the backward, Megatron's local DDP after it."""
    sc21 = [r for r in ROWS if r["source_key"] == "megatron_sc21"]
    assert len(sc21) == 10
    for row in sc21:
        ddp = re.search(r"DDP=(\w+)", row["quote"]).group(1)
        assert row["layout"]["ddp_impl"] == ddp
        settings = published_runs.software(row)
        assert settings.get("grad_overlap", True) is (ddp == "torch"), row["id"]
    assert sum(r["layout"]["ddp_impl"] == "torch" for r in sc21) == 4


def test_llama3_rows_keep_gradients_sharded():
    """Llama 3's FSDP shards gradients (arXiv:2407.21783 §3.3.2): every micro-batch's are reduce-scattered."""
    for row in (r for r in ROWS if r["source_key"] == "llama3_herd_2024"):
        assert published_runs.software(row)["sharded_accumulation"] is True
    other = next(r for r in ROWS if r["source_key"] == "korthikanti_2022")
    assert not published_runs.software(other).get("sharded_accumulation", False)


def test_torchtitan_rows_get_the_norm_their_config_chose():
    """torchtitan's llama3_8b.toml at 1ea476e9f chose the Triton "fused_rmsnorm", llama3_70b.toml the eager
    "rmsnorm" (fp32 upcast): the 70B row is charged the eager norm's bytes."""
    rows = {r["id"]: r for r in ROWS}
    assert published_runs.software(rows["torchtitan_a100_70b_full_64gpu"])["norm"] == "eager-fp32"
    assert "norm" not in published_runs.software(rows["torchtitan_a100_8b_sac_op_64gpu"])


def test_fp8_rows_run_transformer_engine_recipes():
    """NeMo 24.07's FP8 rows ran Transformer Engine's default delayed scaling, Megatron-Bridge's "FP8-CS" rows
    per-tensor current scaling, both on Megatron-Core; torchtitan's torchao float8 rows are not TE's and stay
    out of the benchmark."""
    recipes = {r["id"]: published_runs.software(r).get("fp8") for r in ROWS if r.get("fp8")}
    assert recipes["nemo2407_llama3-8b_8gpu_fp8"] == "delayed"
    assert recipes["mbridge2511_llama3_70b_64gpu_fp8cs"] == "current"
    nemo = next(r for r in ROWS if r["id"] == "nemo2407_llama3-8b_8gpu_fp8")
    assert published_runs.usable(nemo) and published_runs.SOFTWARE["nemo_perf_summary"] == "megatron"
    assert not any(published_runs.usable(r) for r in ROWS if r.get("fp8") and r["source_key"] == "torchtitan")


def test_dgxc_rows_are_consistent_and_reduce_in_bf16():
    """NVIDIA's DGX Cloud benchmarking rows: each published step time reproduces its published throughput
    (seq x GBS / step), the layout multiplies to the GPU count, and NeMo's optim.grad_sync_dtype bf16 is charged
    as 2-byte gradients."""
    rows = [r for r in ROWS if r["source_key"] == "dgxc_benchmarking"]
    assert len(rows) == 35 and "dgxc_benchmarking" in published_runs.DEFAULT_SOURCES
    for row in rows:
        lay, pub = row["layout"], row["published"]
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == row["num_gpus"], row["id"]
        tokens = row["model"]["seq_len"] * lay["global_batch_size"] / pub["iteration_time_s"]
        assert abs(tokens / pub["tokens_per_s"] - 1) < 0.005, row["id"]
        assert row["model"]["vocab_size"] % (128 * lay["tp"]) == 0  # Megatron's padding
        bf16_grads = lay.get("grad_dtype") == "bf16"  # all but Nemotron-4 15B's recipe set it
        assert (published_runs.software(row).get("grad_bytes") == 2) is bf16_grads and published_runs.usable(row)
    assert sum(r["layout"].get("grad_dtype") != "bf16" for r in rows) == 8


def test_grok_rows_pin_expert_parallelism():
    """The Grok-1 (MoE) rows build a mixture-of-experts model (8 experts, top 2, GeGLU, experts padded to
    capacity 1.0) and pin ep, the experts' TP and an imbalance of 1 (padded to capacity: every expert computes
    exactly its capacity); the table's DP column is dp / EP."""
    rows = [r for r in ROWS if r["source_key"] == "dgxc_benchmarking_moe"]
    assert len(rows) == 9 and "dgxc_benchmarking_moe" not in published_runs.DEFAULT_SOURCES
    for row in rows:
        model = published_runs.model_of(row)
        assert model.moe is not None and (model.moe.num_experts, model.moe.top_k) == (8, 2) and model.mlp == "geglu"
        c = published_runs.constraints_of(row, True)
        lay = row["layout"]
        assert (c.ep, c.expert_tp, c.moe_imbalance) == (lay["ep"], lay["tp"], 1.0)
        assert lay["dp"] % lay["ep"] == 0 and lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == row["num_gpus"]


def test_dgxc_fp8_rows_mirror_the_bf16_layouts():
    """The DGX Cloud FP8 rows run the BF16 rows' layouts under Transformer Engine's delayed scaling, with FP8
    parameters, which every recipe asks for."""
    rows = {r["id"]: r for r in ROWS if r["source_key"] in ("dgxc_benchmarking", "dgxc_benchmarking_fp8")}
    fp8 = [r for r in rows.values() if r["source_key"] == "dgxc_benchmarking_fp8"]
    assert len(fp8) == 35
    for row in fp8:
        twin = rows[row["id"].removesuffix("_fp8")]
        own = ("dtype", "fp8_params", "optimizer_state_bytes")
        assert {k: v for k, v in row["layout"].items() if k not in own} == \
               {k: v for k, v in twin["layout"].items() if k not in own}
        # configure.sh passes +model.fp8_params with FP8; GPT-3's YAML sets model.fp8_params: true itself
        assert row["layout"]["fp8_params"] is True
        assert row["fp8"] and published_runs.usable(row) and published_runs.fp8_recipe(row) == "delayed"
        assert row["published"]["iteration_time_s"] < twin["published"]["iteration_time_s"]


def test_olmo_core_rows_run_the_loss_their_script_chose():
    """OLMo-core's README throughput table (41400c46f): the 7B, 8B and 13B scripts set fused_loss=True (its Triton
    cross-entropy: 16-bit logits kept, "fused"), the 1B script does not (eager cross-entropy on logits.float()).
    Each row's time is its batch in tokens over the published tokens/s per device on one node of 8 GPUs."""
    rows = [r for r in ROWS if r["source_key"] == "olmo_core_readme"]
    assert len(rows) == 4
    for row in rows:
        fused = "fused_loss=True" in row["quote"]
        assert row["layout"]["fused_loss"] is fused
        assert published_runs.software(row).get("loss", "fp32") == ("fused" if fused else "fp32"), row["id"]
        lay, tps = row["layout"], row["published"]["tokens_per_s_per_gpu"]
        model = published_runs.model_of(row)
        assert published_runs.published_time(row, model) == lay["global_batch_size"] * 4096 / (tps * 8)
        assert f"rank_microbatch_size={lay['micro_batch_size']} * 4096" in row["quote"]
    assert sum(r["layout"]["fused_loss"] for r in rows) == 3
    # the OLMo configs norm q and k (TransformerConfig.olmo_*: qk_norm=True); Llama 3 8B's does not
    assert {r["id"]: published_runs.model_of(r).qk_norm for r in rows} == {
        "olmocore_1b_8gpu": True, "olmocore_7b_8gpu": True, "olmocore_8b_8gpu": False, "olmocore_13b_8gpu": True}


def test_2022_rows_time_by_their_own_flop_counts():
    """GPT-NeoX-20B's 117 TFLOP/s are its logger's count, B·s·(6N + 60·s·h·L) per step (megatron/logging.py at
    c560814b); OPT-175B's 147 Megatron's count with the recompute forward; BloombergGPT publishes its step (32.5 s,
    and 102 TFLOP/s = 8·N·tokens over it). Each layout multiplies to its GPUs, and each row runs its software:
    NeoX DeepSpeed's pipeline engine in fp16 (16-bit gradients, blocking transfers) with the GPT-J parallel
    residual; OPT FairScale FSDP (no copies) with fp16 gradients; all three Megatron's unfused attention."""
    rows = {r["id"]: r for r in ROWS if r["source_key"] in ("gpt_neox_20b", "opt_175b", "bloomberggpt")}
    expected = {"neox20b_96gpu": 43.85, "opt175b_992gpu": 19.98, "bloomberggpt_512gpu": 32.5}
    assert set(rows) == set(expected)
    for name, seconds in expected.items():
        row = rows[name]
        lay = row["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == row["num_gpus"]
        model = published_runs.model_of(row)
        assert abs(published_runs.published_time(row, model) - seconds) < 0.01, name
        assert published_runs.software(row)["attention"] == "unfused"
    bbg = rows["bloomberggpt_512gpu"]["model"]
    tokens = 2048 * 2048
    assert abs(8 * bbg["num_parameters"] * tokens / (512 * 32.5) / 1e12 - 102) < 0.5
    neox = published_runs.software(rows["neox20b_96gpu"])
    assert neox["grad_bytes"] == 2 and neox["p2p"] == "blocking" and neox["grad_reduce"] == "reduce_scatter"
    assert published_runs.model_of(rows["neox20b_96gpu"]).parallel_residual
    assert published_runs.model_of(rows["neox20b_96gpu"]).rotary_dim == 24
    opt = published_runs.software(rows["opt175b_992gpu"])
    assert opt["grad_bytes"] == 2 and opt["fsdp_copies"] is False and opt["sequence_parallel"] is False
    assert published_runs.cluster_of(rows["bloomberggpt_512gpu"]).inter_node.bandwidth_Bps == 6.25e9


def test_nemotron4_rows_match_their_published_mfu():
    """Nemotron-4's pretraining tables (15B: arXiv:2402.16819 Table 2; 340B: arXiv:2406.11704 Table 2) publish the
    iteration time and the MFU of each stage of the batch ramp-up. Each row's time gives back its MFU under
    6·(non-embedding parameters + output layer) + 12·L·s·h FLOPs a token at 989 TFLOP/s, which checks the
    transcription; the layouts multiply to the GPU counts (tp 8, and pp 12 for 340B) and run Megatron."""
    rows = [r for r in ROWS if r["source_key"] == "nemotron4_2024"]
    assert len(rows) == 6 and "nemotron4_2024" in published_runs.DEFAULT_SOURCES
    non_embedding = {"Nemotron-4 15B": 12.5e9, "Nemotron-4 340B": 331.6e9}
    for row in rows:
        m, lay, pub = row["model"], row["layout"], row["published"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == row["num_gpus"] and lay["tp"] == 8
        assert lay["pp"] == (12 if "340b" in row["id"] else 1)
        per_token = 6 * (non_embedding[m["name"]] + m["vocab_size"] * m["hidden_size"]) \
            + 12 * m["num_layers"] * m["seq_len"] * m["hidden_size"]
        model = published_runs.model_of(row)
        seconds = published_runs.published_time(row, model)
        mfu = lay["global_batch_size"] * m["seq_len"] * per_token / (seconds * row["num_gpus"] * 989e12)
        assert abs(100 * mfu - pub["mfu_pct"]) < 0.35, row["id"]
        assert published_runs.usable(row) and published_runs.software(row)["software"] == "megatron"


def test_nemo_2504_llama405b_rows_reduce_bf16_gradients_without_recompute():
    """dgxc-benchmarking v25.05.05 runs NeMo 25.04's performance recipe for Llama 3.1 405B on GB200 and on H100:
    pretrain_recipe(performance_mode=True) sets grad_reduce_in_fp32 = False (2-byte gradients, held and reduced)
    and the recommended configs recompute no layer. Each row's step time reproduces its published tokens/s; the
    H100 rows are the GB200 rows' recipe at tp 8 on 8-GPU nodes; the FP8 ones (launch.sh's default DTYPE) run
    delayed scaling with FP8 parameters."""
    rows = [r for r in ROWS if r["source_key"] in ("dgxc_benchmarking_gb200", "dgxc_benchmarking_2505_h100")]
    assert len(rows) == 8
    for row in rows:
        lay, pub = row["layout"], row["published"]
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == row["num_gpus"]
        assert abs(8192 * lay["global_batch_size"] / pub["iteration_time_s"] / pub["tokens_per_s"] - 1) < 0.002
        settings = published_runs.software(row)
        assert settings["grad_bytes"] == 2 and settings["loss"] == "fused" and lay["recompute"] == "none"
        assert published_runs.usable(row)
        h100 = row["source_key"] == "dgxc_benchmarking_2505_h100"
        assert (lay["tp"], row["gpus_per_node"]) == ((8, 8) if h100 else (4, 4))
    fp8 = [r for r in rows if r.get("fp8")]
    assert [r["id"] for r in fp8] == [f"dgxc2505_llama3.1-405b_{n}gb200_fp8" for n in (128, 256, 512)] + [
        "dgxc2505_llama3.1-405b_512gpu_fp8"]
    for row in fp8:
        assert published_runs.fp8_recipe(row) == "delayed" and published_runs.software(row)["fp8_params"]


def test_software_and_gpu_options_recost_the_same_rows(monkeypatch, capsys):
    """--software costs every row as that engine runs it (meshplan: what `plan` charges by default), --gpu on
    another device preset; --row picks rows. MT-NLG under the executor's software: no blocking transfers."""
    row = next(r for r in ROWS if r["id"] == "mtnlg530b_2240gpu")
    assert published_runs.software(row)["p2p"] == "blocking"
    monkeypatch.setattr(sys, "argv", ["published_runs.py", "--source", "mt_nlg_2022", "--row", "mtnlg530b_2240gpu",
                                      "--no-free", "--software", "meshplan", "--gpu", "a100-40gb"])
    costed: list[tuple[dict, dict]] = []  # each row main costs, and the settings it costs it with
    software = published_runs.software
    monkeypatch.setattr(published_runs, "software", lambda r: costed.append((r, software(r))) or costed[-1][1])
    published_runs.main()
    assert costed and all(r["id"] == row["id"] and r["gpu"] == "a100-40gb" for r, _ in costed)
    for r, settings in costed:
        assert published_runs.named_software(r) == "meshplan"
        assert "p2p" not in settings
    out = capsys.readouterr().out
    assert "mtnlg530b_2240gpu" in out and "mtnlg530b_2800gpu" not in out and "within 15 %" in out
    for bad, said in ((["--gpu", "h100"], "invalid choice"), (["--software", "deepspeed"], "invalid choice"),
                      (["--row", "mtnlg530b_2240"], "no usable row mtnlg530b_2240 in --source"),
                      (["--row", "mtnlg530b_2240gpu", "--source", "megatron_sc21"], "no usable row")):
        monkeypatch.setattr(sys, "argv", ["published_runs.py", "--no-free", *bad])  # argparse's one-line error
        with pytest.raises(SystemExit) as exit_:
            published_runs.main()
        assert exit_.value.code == 2 and f"argument {bad[0]}: {said}" in capsys.readouterr().err


def test_rows_split_stages_as_their_software_did():
    """BLOOM counted its tied embedding as a block at each end ('type:transformer|embedding'), Llama 3 took a
    block off its first and last stages (§3.3.2); MT-NLG's Megatron-DeepSpeed and Megatron-LM of 2021-22 spread
    the blocks evenly, and so did the Megatron-Core that ran Nemotron-4, the README table and NeMo 1's DGX Cloud
    recipes (before uneven stages, or without them set). Costed as another engine (--software), a row takes that
    engine's split."""
    split = {key: None for key in ("bloom_bigscience", "mt_nlg_2022", "megatron_sc21", "korthikanti_2022",
                                   "nemotron4_2024", "llama3_herd_2024", "megatron_readme_h100_2024",
                                   "dgxc_benchmarking", "dgxc_benchmarking_fp8")}
    for row in ROWS:
        if row["source_key"] in split and split[row["source_key"]] is None:
            split[row["source_key"]] = published_runs.constraints_of(row, True).split
            assert published_runs.constraints_of({**row, "costed_as": "meshplan"}, True).split == "free"
    assert split == {"bloom_bigscience": "even-ends", "llama3_herd_2024": "even-ends", "mt_nlg_2022": "even",
                     "megatron_sc21": "even", "korthikanti_2022": "even", "nemotron4_2024": "even",
                     "megatron_readme_h100_2024": "even", "dgxc_benchmarking": "even", "dgxc_benchmarking_fp8": "even"}
    # NeMo 2's and Megatron-Bridge's Llama 3.1 405B recipes count the embedding and the loss as a layer each
    nvidia = ("megatron_bridge_perf_summary", "dgxc_benchmarking_gb200", "dgxc_benchmarking_2505_h100")
    for row in ROWS:
        if row["source_key"] in nvidia + ("nemo_perf_summary", "dgxc_benchmarking_moe") and row["layout"].get("pp"):
            big = row["source_key"] in nvidia and row["model"]["num_layers"] == 126
            assert published_runs.constraints_of(row, True).split == ("even-ends" if big else "even"), row["id"]


def test_dgxc_rows_keep_the_optimizer_state_nemo_1_sets_up():
    """NeMo 1 sets up Apex's DistributedFusedAdam for the bf16 DGX Cloud recipes: fp32 moments with the master
    copy's 16-bit remainders (10 B), an fp32 master copy where the recipe sets fp8_params (12 B: GPT-3's YAML
    always, the others' configure.sh with FP8), bf16 state for Nemotron-4 340B's optim.dtype bf16 (4 B, 6 B
    with the bf16 master copy FP8 parameters make it store). The costed settings carry it."""
    rows = [r for r in ROWS if r["source_key"] in ("dgxc_benchmarking", "dgxc_benchmarking_fp8")]
    assert len(rows) == 70
    for row in rows:
        fp8, lay = bool(row.get("fp8")), row["layout"]
        if "340b" in row["id"]:
            expected = 6.0 if fp8 else 4.0
        else:
            expected = 12.0 if fp8 or "gpt3" in row["id"] else 10.0
        assert lay["optimizer_state_bytes"] == expected, row["id"]
        assert published_runs.software(row)["opt_bytes"] == expected
