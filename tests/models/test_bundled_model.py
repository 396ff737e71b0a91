"""The bundled default model (moeserve/models/bundled/tiny-deepseek-v3): shipped, small, loadable, and served
by moeserve with exactly transformers' greedy tokens."""
import json
import os

import pytest
import torch

from moeserve.models.default import BUNDLED

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(BUNDLED, "model.safetensors")),
                                reason="bundled model not present")

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
NEW_TOKENS = 24


def _hf(dtype=torch.float32):
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(BUNDLED, dtype=dtype).eval()


def _hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    with torch.no_grad():  # explicit mask: BOS is id 0, which generate() would otherwise treat as padding
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=1)
    return out[0, len(ids):].tolist()


def test_folder_is_small_and_complete():
    files = set(os.listdir(BUNDLED))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "README.md"):
        assert f in files, f
    total = sum(os.path.getsize(os.path.join(BUNDLED, f)) for f in files)
    assert total <= 30 * 1024 * 1024, f"bundled folder is {total / 2**20:.1f} MiB (limit 30)"
    cfg = json.load(open(os.path.join(BUNDLED, "config.json")))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["topk_method"] == "noaux_tc"


def test_checkpoint_uses_standard_names_and_has_the_mtp_layer():
    from safetensors import safe_open

    cfg = json.load(open(os.path.join(BUNDLED, "config.json")))
    L, k = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    with safe_open(os.path.join(BUNDLED, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        bias = f.get_tensor(f"model.layers.{k}.mlp.gate.e_score_correction_bias")
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.0.mlp.gate_proj.weight", f"model.layers.{k}.self_attn.kv_a_proj_with_mqa.weight",
              f"model.layers.{k}.mlp.experts.0.gate_proj.weight", f"model.layers.{k}.mlp.shared_experts.up_proj.weight",
              f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight", f"model.layers.{L}.hnorm.weight",
              f"model.layers.{L}.shared_head.norm.weight", f"model.layers.{L}.mlp.experts.0.down_proj.weight"):
        assert n in names, n
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # trained by aux-loss-free balancing


def test_transformers_loads_it_and_tokenizer_adds_bos():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"
    model = _hf()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()


def test_moeserve_greedy_matches_transformers_float32():
    from moeserve import LLM, SamplingParams

    llm = LLM(BUNDLED, dtype="float32")
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=prompt_ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    model = _hf()
    for ids, out in zip(prompt_ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, ids, NEW_TOKENS)


def test_default_model_is_the_bundled_one():
    from moeserve.models.default import default_model_path

    assert os.path.samefile(default_model_path(), BUNDLED)
