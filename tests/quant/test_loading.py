"""The three checkpoint kinds under --quantization a8w8: float (quantized at load), DeepSeek FP8 block-scaled
(dequantized, then INT8 per channel), and compressed-tensors W8A8 written by `moeserve quantize`."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.cli import main as cli_main
from moeserve.config import ConfigError
from moeserve.layers.quant import Int8FusedExperts, quantize_per_channel
from moeserve.models.loader import CheckpointError, dequantize_fp8

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LINEAR = "model.layers.1.self_attn.q_b_proj"
EXPERT = "model.layers.2.mlp.experts"


def _tensors(path):
    out = {}
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def _params(llm):
    return dict(llm.engine.runner.model.named_parameters())


def _write_fp8(src: str, dst: str) -> None:
    """DeepSeek's layout: e4m3 weight + weight_scale_inv per 128x128 block, for every 2-D projection."""
    os.makedirs(dst, exist_ok=True)
    out = {}
    for name, t in _tensors(src).items():
        if t.dim() == 2 and "proj" in name:
            o, i = t.shape
            blocks = t.float().new_zeros(-(-o // 128), -(-i // 128))
            for bo in range(blocks.shape[0]):
                for bi in range(blocks.shape[1]):
                    blk = t[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
                    blocks[bo, bi] = blk.abs().max().float() / 448.0
            scale = blocks.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = blocks
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            open(os.path.join(dst, f), "wb").write(open(os.path.join(src, f), "rb").read())


def test_float_checkpoint_is_quantized_at_load(ckpt_dir):
    path = ckpt_dir("v3")
    llm = LLM(path, dtype="bfloat16", quantization="a8w8")
    params, src = _params(llm), _tensors(path)
    q, s = quantize_per_channel(src[LINEAR + ".weight"])
    assert torch.equal(params[LINEAR + ".weight"], q) and torch.equal(params[LINEAR + ".weight_scale"], s)
    experts = llm.engine.runner.model.get_submodule(EXPERT)
    assert isinstance(experts, Int8FusedExperts)
    q, s = quantize_per_channel(src[EXPERT + ".3.up_proj.weight"])
    assert torch.equal(experts.expert_weight(3, "up_proj"), q)
    assert torch.equal(experts.expert_scale(3, "up_proj"), s[:, 0])
    q, s = quantize_per_channel(src["lm_head.weight"])  # the head is a Linear like the projections
    assert torch.equal(params["lm_head.weight"], q) and torch.equal(params["lm_head.weight_scale"], s)
    # high precision where the issue says so: embeddings, router, norms, KV cache
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.input_layernorm.weight"):
        assert params[name].is_floating_point(), name
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    # MLA's absorbed decode uses the dequantized kv_b_proj
    attn = llm.engine.runner.model.model.layers[1].self_attn
    w = attn.kv_b_proj.dequantized_weight().view(attn.num_heads, -1, attn.kv_lora_rank)
    assert torch.equal(attn.w_uk_t, w[:, : attn.dn].transpose(1, 2))
    out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_fp8_block_checkpoint_is_converted_to_int8_per_channel(ckpt_dir, tmp_path):
    src = ckpt_dir("v3")
    fp8 = str(tmp_path / "fp8")
    _write_fp8(src, fp8)
    llm = LLM(fp8, quantization="a8w8")
    assert llm.config.quant.method == "a8w8" and llm.config.quant.checkpoint_format == "fp8"
    file = {}
    with safe_open(os.path.join(fp8, "model.safetensors"), "pt") as f:
        for k in (LINEAR + ".weight", EXPERT + ".5.down_proj.weight"):
            file[k] = dequantize_fp8(f.get_tensor(k), f.get_tensor(k + "_scale_inv"))
    q, s = quantize_per_channel(file[LINEAR + ".weight"])
    assert torch.equal(_params(llm)[LINEAR + ".weight"], q)
    experts = llm.engine.runner.model.get_submodule(EXPERT)
    assert torch.equal(experts.expert_weight(5, "down_proj"), quantize_per_channel(file[EXPERT + ".5.down_proj.weight"])[0])
    llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)


def test_quantize_cli_writes_compressed_tensors_that_load_directly(ckpt_dir, tmp_path):
    src = ckpt_dir("v3")
    dst = str(tmp_path / "w8a8")
    assert cli_main(["quantize", src, dst]) == 0
    cfg = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    assert cfg["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    tensors = _tensors(dst)
    assert tensors[LINEAR + ".weight"].dtype == torch.int8 and tensors[LINEAR + ".weight_scale"].shape == (96, 1)
    assert tensors[EXPERT + ".0.gate_proj.weight"].dtype == torch.int8
    assert tensors["lm_head.weight"].is_floating_point() and tensors["model.layers.1.mlp.gate.weight"].is_floating_point()

    direct = LLM(dst, dtype="float32")  # no --quantization: the checkpoint turns a8w8 on, as in vLLM
    assert direct.config.quant.checkpoint_format == "compressed-tensors" and direct.config.quant.method == "a8w8"
    at_load = LLM(src, dtype="float32", quantization="a8w8")
    pd, pl = _params(direct), _params(at_load)
    # the written checkpoint lists lm_head in `ignore` (as llm-compressor does, so every reader takes it) and
    # loading honours that; quantized at load, the head is INT8 like the projections
    assert pd["lm_head.weight"].dtype == torch.float32 and pl["lm_head.weight"].dtype == torch.int8
    assert torch.equal(pl["lm_head.weight"], quantize_per_channel(pd["lm_head.weight"])[0])
    assert pd.keys() == pl.keys() - {"lm_head.weight_scale"}
    for name in pd.keys() - {"lm_head.weight"}:
        assert torch.equal(pd[name], pl[name]), name
    outs = [[o.outputs[0].token_ids for o in m.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
            for m in (direct, at_load)]
    assert all(len(t) == 12 for out in outs for t in out)
    assert cli_main(["quantize", src, dst]) == 2  # refuses to overwrite


def test_bad_quantization_inputs_fail_clearly(ckpt_dir, tmp_path, capsys):
    src = ckpt_dir("v3")
    with pytest.raises(ConfigError, match="--quantization must be one of a8w8"):
        LLM(src, quantization="int4")
    dst = str(tmp_path / "w8a8")
    cli_main(["quantize", src, dst])
    # a compressed-tensors scheme that is not W8A8 INT8 is refused by name
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="group_0.*weights.*num_bits"):
        LLM(dst)
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    json.dump(cfg, open(cfg_path, "w"))
    # a missing scale names the tensor
    tensors = _tensors(dst)
    del tensors[LINEAR + ".weight_scale"]
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with pytest.raises(CheckpointError, match=LINEAR + ".weight_scale"):
        LLM(dst)
    # INT8 tensors into a float model (quantization_config removed) are refused, not cast
    del cfg["quantization_config"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match="is INT8.*--quantization a8w8"):
        LLM(dst)
    assert cli_main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
