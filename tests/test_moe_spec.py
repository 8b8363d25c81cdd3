"""Mixture-of-experts models: exact parameter counts, HF config.json reading, JSON round trip, the
executor's module against the spec, and the refusal of configs that cannot be read yet."""

import json

import pytest
import torch
from meshplan.executor.model import Transformer, init_weights, loss_fn
from meshplan.planner.errors import InputError
from meshplan.planner.model_sources import builtin_model, from_hf_config
from meshplan.planner.model_spec import ModelSpec, MoESpec, sparse_blocks

# Hugging Face num_parameters() of the published checkpoints; active: the total less the unrouted experts.
EXPECTED = {
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
}

MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "vocab_size": 32000,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False, "vocab_size": 151936,
}
QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B config.json (model type qwen2_moe): 14,315,784,192 parameters
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "vocab_size": 151936,
}


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builtin_counts_are_exact(name):
    spec = builtin_model(name)
    assert (spec.num_parameters, spec.active_parameters) == EXPECTED[name]


def test_mixtral_8x22b_is_141b_with_39b_active():
    spec = builtin_model("mixtral-8x22b")
    assert round(spec.num_parameters / 1e9) == 141 and round(spec.active_parameters / 1e9) == 39


@pytest.mark.parametrize("cfg,builtin", [(MIXTRAL_8X7B, "mixtral-8x7b"), (QWEN3_30B_A3B, "qwen3-30b-a3b")])
def test_hf_configs_read_as_the_builtins(tmp_path, cfg, builtin):
    spec = from_hf_config(_write(tmp_path, cfg))
    want = builtin_model(builtin)
    assert spec.num_parameters == want.num_parameters
    assert spec.moe == want.moe and spec.qk_norm == want.qk_norm


def test_qwen2_moe_shared_expert_and_gate(tmp_path):
    spec = from_hf_config(_write(tmp_path, QWEN15_MOE_A27B))
    assert spec.num_parameters == 14_315_784_192
    assert spec.moe.num_shared_experts == 1 and spec.moe.shared_expert_gate and not spec.moe.norm_topk_prob
    assert spec.qkv_bias


def test_qwen2_moe_sparse_step_and_dense_layers(tmp_path):
    cfg = dict(QWEN15_MOE_A27B, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[0, 1])
    spec = from_hf_config(_write(tmp_path, cfg))
    assert sparse_blocks(spec) == [3, 5]
    with pytest.raises(InputError, match="mlp_only_layers"):
        from_hf_config(_write(tmp_path, dict(cfg, mlp_only_layers=[3])))


def test_unreadable_moe_type_is_one_clear_line(tmp_path):
    with pytest.raises(InputError, match="'deepseek_v3' is not supported yet: multi-head latent attention") as err:
        from_hf_config(_write(tmp_path, {"model_type": "deepseek_v3", "hidden_size": 7168}))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "tiny-moe"])
def test_json_round_trip_keeps_moe(name):
    spec = builtin_model(name)
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["moe"]["num_experts"] == spec.moe.num_experts and data["active_parameters"] == spec.active_parameters
    assert ModelSpec.from_dict(data) == spec


def test_dense_model_has_null_moe():
    data = builtin_model("tiny").to_dict()
    assert data["moe"] is None and data["active_parameters"] == data["num_parameters"]


def test_top_k_above_experts_is_refused():
    with pytest.raises(InputError, match="model.moe.top_k"):
        MoESpec(num_experts=4, top_k=5, expert_ffn_hidden_size=8)


@pytest.mark.parametrize("moe,qk_norm", [
    (MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=32, first_dense_layers=1), False),  # tiny-moe
    (MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=16, num_shared_experts=1,
             shared_expert_ffn_hidden_size=48, shared_expert_gate=True, norm_topk_prob=False, sparse_step=2), False),
    (MoESpec(num_experts=6, top_k=3, expert_ffn_hidden_size=16, router="sigmoid"), True),
])
def test_executor_module_matches_spec_and_trains(moe, qk_norm):
    spec = ModelSpec(name="t", arch="llama", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, ffn_hidden_size=64, max_seq_len=32, qk_norm=qk_norm, moe=moe)
    model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters
    init_weights(model, 0)
    tokens = torch.randint(0, 64, (2, 9))
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    sparse = sparse_blocks(spec)
    gate = model.blocks[str(sparse[0])].feed_forward.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_load_balancing_loss_is_one_when_balanced():
    from meshplan.executor.moe import MoE
    spec = builtin_model("tiny-moe")
    moe = MoE(spec)
    e, k, s = spec.moe.num_experts, spec.moe.top_k, 8
    scores = torch.full((s, e), 1.0 / e)
    ids = torch.arange(s * k).remainder(e).view(s, k)
    assert moe.aux_loss(scores, ids, 1, s).item() == pytest.approx(1.0)
