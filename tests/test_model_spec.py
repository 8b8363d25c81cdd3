import json

import pytest
from meshplan.planner.errors import InputError
from meshplan.planner.model_sources import BUILTIN_MODELS, builtin_model, from_hf_config, resolve_model
from meshplan.planner.model_spec import ModelSpec

# Reference counts: Hugging Face `num_parameters()` of the published checkpoints (tied embeddings once).
EXPECTED_PARAMS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name,count", EXPECTED_PARAMS.items())
def test_builtin_parameter_counts(name, count):
    assert builtin_model(name).num_parameters == count


def test_gpt3_175b_is_175b():
    assert abs(builtin_model("gpt3-175b").num_parameters / 1e9 - 175) < 1


def test_layer_list_is_embedding_blocks_head():
    spec = builtin_model("llama3-8b")
    kinds = [layer.kind for layer in spec.layers]
    assert kinds == ["embedding"] + ["block"] * 32 + ["head"]
    assert spec.block_indices == list(range(1, 33))


def test_tied_head_counts_weight_once():
    spec = builtin_model("gpt2")
    head = spec.layers[-1]
    assert head.tied_params == 50257 * 768 and head.params == 2 * 768


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_json_round_trip(name):
    spec = builtin_model(name)
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec


def test_unknown_name_suggests_close_names():
    with pytest.raises(InputError, match="did you mean llama3-8b"):
        resolve_model("lama3-8b")


HF_CONFIGS = {
    "gpt2": ({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
              "n_positions": 1024}, 124_439_808),
    "llama": ({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
               "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False},
              8_030_261_248),
    # Mistral-7B-v0.1: 7,241,732,096 parameters.
    "mistral": ({"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                 "vocab_size": 32000, "max_position_embeddings": 32768}, 7_241_732_096),
    # Qwen2-0.5B: 494,032,768 parameters (tied embeddings, q/k/v bias).
    "qwen2": ({"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
               "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
               "max_position_embeddings": 32768, "tie_word_embeddings": True}, 494_032_768),
    # Qwen/Qwen3-8B: 8,190,735,360 parameters (untied head, no q/k/v bias, a norm over each head of q and k).
    "qwen3": ({"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
               "max_position_embeddings": 40960, "rope_theta": 1000000, "tie_word_embeddings": False},
              8_190_735_360),
    # EleutherAI/gpt-neox-20b: 20,554,567,680 parameters (untied head, biases, two LayerNorms per block).
    "gpt_neox": ({"model_type": "gpt_neox", "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                  "intermediate_size": 24576, "vocab_size": 50432, "max_position_embeddings": 2048,
                  "rotary_pct": 0.25, "use_parallel_residual": True}, 20_554_567_680),
    # facebook/opt-125m: 125,239,296 parameters, less the 2 spare rows of its position table (2·768).
    "opt": ({"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048, "do_layer_norm_before": True,
             "word_embed_proj_dim": 768, "activation_function": "relu"}, 125_239_296 - 2 * 768),
    # google/gemma-7b: 8,537,680,896 parameters (head_dim 256 beside hidden 3072, tied head).
    "gemma": ({"model_type": "gemma", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
               "num_key_value_heads": 16, "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000,
               "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh"}, 8_537_680_896),
    # bigscience/bloom: 176,247,271,424 parameters (ALiBi, the embedding's LayerNorm, tied head).
    "bloom": ({"model_type": "bloom", "n_embed": 14336, "n_layer": 70, "num_attention_heads": 112,
               "vocab_size": 250880, "apply_residual_connection_post_layernorm": False}, 176_247_271_424),
    # microsoft/Phi-3-mini-4k-instruct: 3,821,079,552 parameters.
    "phi3": ({"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
              "max_position_embeddings": 4096}, 3_821_079_552),
}


def _read(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return from_hf_config(str(path))


def test_hf_gpt_neox_rotates_a_quarter_of_each_head_with_a_parallel_residual(tmp_path):
    spec = _read(tmp_path, HF_CONFIGS["gpt_neox"][0])
    assert (spec.head_dim, spec.rotary_dim, spec.parallel_residual, spec.norm, spec.mlp) == \
        (96, 24, True, "layernorm", "gelu")
    assert spec.linear_bias and not spec.tied_embeddings
    v5 = dict(HF_CONFIGS["gpt_neox"][0], rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5})
    del v5["rotary_pct"]
    assert _read(tmp_path, v5).rotary_dim == 48  # transformers v5 spelling


def test_hf_falcon_new_decoder_architecture(tmp_path):
    """Falcon-40B's config: 128 heads of 64 over 8 k/v groups, attention and MLP side by side behind their own
    LayerNorms, no biases, tied head; Falcon-7B's single shared LayerNorm and ALiBi variants are refused."""
    cfg = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_hidden_layers": 60,
           "num_kv_heads": 8, "new_decoder_architecture": True, "vocab_size": 65024, "bias": False, "alibi": False}
    spec = _read(tmp_path, cfg)
    assert (spec.num_kv_heads, spec.ffn_hidden_size, spec.parallel_residual, spec.linear_bias, spec.tied_embeddings) \
        == (8, 4 * 8192, True, False, True)
    with pytest.raises(InputError, match="new_decoder_architecture"):
        _read(tmp_path, dict(cfg, new_decoder_architecture=False, multi_query=True))
    with pytest.raises(InputError, match="alibi"):
        _read(tmp_path, dict(cfg, alibi=True))


def test_hf_refuses_what_it_cannot_model_by_name(tmp_path):
    with pytest.raises(InputError, match="do_layer_norm_before"):
        _read(tmp_path, dict(HF_CONFIGS["opt"][0], do_layer_norm_before=False))
    with pytest.raises(InputError, match="apply_residual_connection_post_layernorm"):
        _read(tmp_path, dict(HF_CONFIGS["bloom"][0], apply_residual_connection_post_layernorm=True))
    with pytest.raises(InputError, match="'gemma2' is not supported yet"):
        _read(tmp_path, {"model_type": "gemma2"})
    with pytest.raises(InputError, match="'gpt_oss' is not supported yet: its alternating sliding-window"):
        _read(tmp_path, {"model_type": "gpt_oss"})


def test_hf_starcoder2_layernorm_gelu_gqa_biases(tmp_path):
    cfg = {"model_type": "starcoder2", "hidden_size": 6144, "intermediate_size": 24576, "num_attention_heads": 48,
           "num_key_value_heads": 4, "num_hidden_layers": 40, "vocab_size": 49152, "rope_theta": 100000}
    spec = _read(tmp_path, cfg)
    assert (spec.norm, spec.mlp, spec.position, spec.num_kv_heads, spec.linear_bias, spec.rope_theta) == \
        ("layernorm", "gelu", "rope", 4, True, 100000.0)


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_hf_config(tmp_path, kind):
    cfg, count = HF_CONFIGS[kind]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(path))
    assert spec.num_parameters == count


def test_hf_config_malformed(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        from_hf_config(str(path))


def test_hf_config_unknown_type_names_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(InputError, match="model_type"):
        from_hf_config(str(path))


def test_hf_config_bad_value_names_field(tmp_path):
    cfg = dict(HF_CONFIGS["llama"][0], hidden_size=-4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="hidden_size"):
        from_hf_config(str(path))


def test_hf_config_missing_file():
    with pytest.raises(InputError, match="no such file"):
        resolve_model("/nonexistent/config.json")


def test_factory_finds_blocks_and_tied_head():
    spec = resolve_model("tests.fixtures.factory_models:tiny_lm")
    assert spec.arch == "custom" and spec.num_layers == 3
    assert spec.num_heads == 4 and spec.hidden_size == 32 and spec.vocab_size == 100
    from tests.fixtures.factory_models import TinyLM

    assert spec.num_parameters == sum(p.numel() for p in TinyLM().parameters())
    assert spec.layers[-1].tied_params == 100 * 32


def test_factory_untied():
    spec = resolve_model("tests.fixtures.factory_models:untied_lm")
    from tests.fixtures.factory_models import TinyLM

    assert spec.num_parameters == sum(p.numel() for p in TinyLM(tied=False).parameters())
    assert spec.layers[-1].tied_params == 0


@pytest.mark.parametrize("ref,message", [
    ("tests.fixtures.factory_models:no_blocks", "no list of repeated blocks"),
    ("tests.fixtures.factory_models:not_a_module", "expected an nn.Module"),
    ("tests.fixtures.factory_models:broken", "failed: RuntimeError: boom"),
    ("tests.fixtures.factory_models:missing", "no callable 'missing'"),
    ("no_such_package.mod:fn", "cannot import module"),
])
def test_factory_errors(ref, message):
    with pytest.raises(InputError, match=message):
        resolve_model(ref)


def test_model_json_rejects_bad_field():
    data = builtin_model("tiny").to_dict()
    data["num_heads"] = "four"
    with pytest.raises(InputError, match=r"model\.num_heads: expected an integer"):
        ModelSpec.from_dict(data)
    data = builtin_model("tiny").to_dict()
    data["num_parameters"] += 1
    with pytest.raises(InputError, match=r"model\.num_parameters"):
        ModelSpec.from_dict(data)


def test_hf_config_name(tmp_path):
    """config.json is named after its folder (a Hugging Face snapshot); any other file after itself."""
    cfg = json.dumps(HF_CONFIGS["mistral"][0])
    (tmp_path / "Mistral-7B").mkdir()
    (tmp_path / "Mistral-7B" / "config.json").write_text(cfg)
    (tmp_path / "mistral-7b.json").write_text(cfg)
    assert from_hf_config(str(tmp_path / "Mistral-7B" / "config.json")).name == "Mistral-7B"
    assert from_hf_config(str(tmp_path / "mistral-7b.json")).name == "mistral-7b"


def test_rotary_dim_follows_a_changed_head():
    """rotary_dim 0 rotates the whole head, whatever head_dim a copy of the spec gets."""
    from dataclasses import replace

    spec = replace(builtin_model("llama3-70b"), hidden_size=6144, head_dim=0, layers=())
    assert (spec.head_dim, spec.rotary_dim, spec.rotated_dims) == (96, 0, 96)


def test_hf_sliding_windows(tmp_path):
    """Mistral v0.1 attends over the last 4,096 tokens (its config's sliding_window; v0.2 and later: null);
    Qwen2's per-layer window (use_sliding_window) is refused; the band's pairs replace s²/2 when it binds."""
    v01 = dict(HF_CONFIGS["mistral"][0], sliding_window=4096)
    spec = _read(tmp_path, v01)
    assert spec.sliding_window == 4096 and _read(tmp_path, dict(v01, sliding_window=None)).sliding_window == 0
    assert spec.attention_pairs(4096) == 4096 ** 2 / 2
    assert spec.attention_pairs(32768) == 32768 * 4096 - 4096 ** 2 / 2
    with pytest.raises(InputError, match="use_sliding_window"):
        _read(tmp_path, dict(HF_CONFIGS["qwen2"][0], use_sliding_window=True))


def test_hf_qwen3_norms_each_head_of_q_and_k(tmp_path):
    """Qwen3 (dense): the llama block with an RMSNorm over each head of q and k, no q/k/v bias; its per-layer
    sliding window (use_sliding_window) is refused."""
    spec = _read(tmp_path, HF_CONFIGS["qwen3"][0])
    assert (spec.qk_norm, spec.qkv_bias, spec.head_dim, spec.norm_eps, spec.moe) == (True, False, 128, 1e-6, None)
    with pytest.raises(InputError, match="use_sliding_window"):
        _read(tmp_path, dict(HF_CONFIGS["qwen3"][0], use_sliding_window=True))
    with pytest.raises(InputError, match="field 'hidden_act': expected 'silu'"):
        _read(tmp_path, dict(HF_CONFIGS["qwen3"][0], hidden_act="gelu"))
