"""Parameter and KV counts against ../shared/reference/hardware.md's derived figures."""
import json

import pytest

from moeserve.perf.models import from_hf_config, load_model, preset_names


def test_deepseek_v3_counts_match_hardware_md():
    m = load_model("deepseek-v3")
    assert m.attn_params == pytest.approx(187.1e6, rel=1e-3)
    assert m.expert_params == pytest.approx(44.04e6, rel=1e-3)
    assert m.moe_layer_params == pytest.approx(11.507e9, rel=1e-3)
    assert m.dense_layer_params == pytest.approx(583.5e6, rel=1e-3)
    assert m.embed_params == pytest.approx(926.7e6, rel=1e-3)
    assert m.total_params == pytest.approx(671.0e9, rel=1e-3)
    assert m.active_params == pytest.approx(37e9, rel=0.03)
    assert m.kv_bytes_per_token(2) == 70272
    assert (m.num_dense_layers, m.num_moe_layers) == (3, 58)


def test_r1_is_v3_and_presets_listed():
    assert load_model("deepseek-r1").total_params == load_model("deepseek-v3").total_params
    assert {"deepseek-v3", "deepseek-r1", "deepseek-v2", "deepseek-v2-lite"} <= set(preset_names())


def test_v2_lite_has_no_q_lora():
    m = load_model("deepseek-v2-lite")
    assert m.q_lora_rank is None and m.q_a_params == 0
    # q: 2048 -> 16 x 192; kv_a 2048 x 576; kv_b 512 x 16 x 256; o 16 x 128 x 2048
    assert m.attn_params == 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048
    assert m.total_params == pytest.approx(15.7e9, rel=0.02)  # V2-Lite model card: 15.7B


def test_hf_config_json_path(tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
           "first_k_dense_replace": 1, "intermediate_size": 128, "moe_intermediate_size": 32,
           "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "q_lora_rank": 32,
           "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
           "num_attention_heads": 4, "vocab_size": 100, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert m.num_moe_layers == 2 and m.expert_params == 3 * 64 * 32
    assert m.kv_bytes_per_token(1) == (16 + 4) * 3


def test_bad_model_inputs():
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="lacks"):
        from_hf_config({"hidden_size": 1})


def test_context_window_is_read_from_presets_and_configs():
    assert load_model("deepseek-v3").max_position_embeddings == 163840
    cfg = {**_V3_CFG, "max_position_embeddings": 4096}
    assert from_hf_config(cfg).max_position_embeddings == 4096
    assert from_hf_config({k: v for k, v in cfg.items() if k != "max_position_embeddings"}).max_position_embeddings is None


_V3_CFG = {k: v for k, v in load_model("deepseek-v3").__dict__.items() if k != "name"}


@pytest.mark.parametrize("text,words", [
    ('{"hidden_size": 7168,', ["invalid JSON at line 1"]),
    ("[1, 2]", ["expected a config mapping", "list"]),
    (json.dumps({**_V3_CFG, "hidden_size": "big"}), ["hidden_size", "'big'"]),
    (json.dumps({**_V3_CFG, "num_attention_heads": 0}), ["num_attention_heads", "positive"]),
])
def test_bad_config_json_names_the_file_and_the_field(tmp_path, text, words):
    f = tmp_path / "config.json"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        load_model(str(f))
    assert f"--model {f}" in str(e.value)
    for w in words:
        assert w in str(e.value)
