"""Checkpoint loading: FP8 block-scaled weights, sharded index, clear errors."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.arch import UnsupportedModelError
from moeserve.models.loader import CheckpointError, dequantize_fp8, load_weights
from moeserve.models.registry import build_model
from moeserve.tokenizer import load_tokenizer

PROMPT = [5, 17, 99, 200, 3, 45, 67]


def fp8_quantize(w: torch.Tensor):
    """Per 128x128 block: scale = amax / 448, stored as weight_scale_inv (DeepSeek's layout)."""
    out_f, in_f = w.shape
    sb = torch.zeros(-(-out_f // 128), -(-in_f // 128))
    q = torch.empty_like(w)
    for i in range(sb.shape[0]):
        for j in range(sb.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            sb[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = blk / sb[i, j]
    return q.to(torch.float8_e4m3fn), sb


def copy_ckpt(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_fp8_block_checkpoint_matches_dequantized_model(ckpt_dir, tmp_path):
    src = ckpt_dir("v3", hidden_size=160)  # 160 is not a multiple of 128: partial blocks
    fp8_dir, deq_dir = copy_ckpt(src, str(tmp_path / "fp8")), copy_ckpt(src, str(tmp_path / "deq"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2:
            q, s = fp8_quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize_fp8(q, s)
        else:
            fp8[name] = deq[name] = t
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"))
    save_file(deq, os.path.join(deq_dir, "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = LLM(fp8_dir, dtype="float32")
    b = LLM(deq_dir, dtype="float32")
    assert a.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids == \
        b.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids
    torch.testing.assert_close(a.engine.score(PROMPT), b.engine.score(PROMPT))
    # and the FP8 model really is a (close) approximation, not a copy
    c = LLM(src, dtype="float32")
    x, y = a.engine.score(PROMPT).flatten(), c.engine.score(PROMPT).flatten()
    assert not torch.equal(x, y)
    # e4m3 keeps 3 mantissa bits; on a random (chaotic) net that still leaves the logits well correlated
    assert torch.nn.functional.cosine_similarity(x, y, dim=0) > 0.8


def test_sharded_checkpoint_with_index(ckpt_dir, tmp_path):
    src = ckpt_dir("v3")
    dst = copy_ckpt(src, str(tmp_path / "sharded"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, os.path.join(dst, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(dst, dtype="float32").generate(prompt_token_ids=[PROMPT], sampling_params=params)
    want = LLM(src, dtype="float32").generate(prompt_token_ids=[PROMPT], sampling_params=params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_mtp_tensors_are_kept_aside_only_for_speculative_decoding(ckpt_dir, tmp_path):
    src = ckpt_dir("v3")
    dst = copy_ckpt(src, str(tmp_path / "mtp"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    n = 3  # num_hidden_layers of the test checkpoints
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    # An FP8 tensor without its scale: reading (dequantizing) it is an error, so loading proves it unread.
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(64).to(torch.float8_e4m3fn)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    llm = LLM(dst, dtype="float32")  # no speculative config: the MTP layer is neither read nor kept
    assert llm.engine.runner.checkpoint.mtp_weights == {}

    arch = llm.engine.runner.arch
    model, _ = build_model(dst, arch, torch.float32, 64)
    with pytest.raises(CheckpointError, match=rf"model\.layers\.{n}\.hnorm\.weight.*has no .*_scale_inv"):
        load_weights(model, dst, keep_mtp=True)
    tensors.pop(f"model.layers.{n}.hnorm.weight")
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    kept = load_weights(model, dst, keep_mtp=True).mtp_weights
    assert set(kept) == {f"model.layers.{n}.eh_proj.weight", f"model.layers.{n}.enorm.weight"}


def test_missing_tensor_is_named(ckpt_dir, tmp_path):
    dst = copy_ckpt(ckpt_dir("v3"), str(tmp_path / "missing"))
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        LLM(dst, dtype="float32")


def test_shape_mismatch_is_named(ckpt_dir, tmp_path):
    dst = copy_ckpt(ckpt_dir("v3"), str(tmp_path / "shape"))
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(3, 3\)"):
        LLM(dst, dtype="float32")


def test_corrupt_file_is_named(ckpt_dir, tmp_path):
    dst = copy_ckpt(ckpt_dir("v3"), str(tmp_path / "corrupt"))
    with open(os.path.join(dst, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        LLM(dst, dtype="float32")


def test_unsupported_architecture(ckpt_dir, tmp_path):
    dst = copy_ckpt(ckpt_dir("v3"), str(tmp_path / "llama"))
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        LLM(dst)


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is neither a local folder nor a Hugging Face repo id"):
        LLM(str(tmp_path / "nope"))


def edited_config(src: str, dst: str, **changes) -> str:
    """A copy of checkpoint src whose config.json has `changes` applied (value None deletes the key)."""
    copy_ckpt(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_missing_config_keys_are_named_with_the_file(ckpt_dir, tmp_path):
    dst = edited_config(ckpt_dir("v3"), str(tmp_path / "nokeys"), kv_lora_rank=None, v_head_dim=None)
    with pytest.raises(UnsupportedModelError, match=r"nokeys/config.json is missing required key\(s\) "
                                                     r"kv_lora_rank, v_head_dim"):
        LLM(dst, dtype="float32")


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 1.0}


@pytest.mark.parametrize("rope, words", [
    ({k: v for k, v in YARN.items() if k != "factor"}, "rope_scaling of type 'yarn' has no 'factor'"),
    ({**YARN, "factor": "4"}, "rope_scaling values must be numbers: factor='4'"),
    ({**YARN, "factor": 0}, "rope_scaling factor and original_max_position_embeddings must be positive (got 0"),
])
def test_bad_yarn_rope_scaling_is_reported_against_config_json(ckpt_dir, tmp_path, rope, words):
    src = ckpt_dir("v3")
    dst = edited_config(src, str(tmp_path / "yarn"), rope_parameters=None, rope_scaling=rope)
    for tokenizer in (None, src):  # with or without --tokenizer: a config error, not a tokenizer or KeyError one
        with pytest.raises(UnsupportedModelError, match="config.json: " + re.escape(words)):
            LLM(dst, dtype="float32", tokenizer=tokenizer)


def test_tokenizer_errors_are_only_claimed_for_the_tokenizer(ckpt_dir, tmp_path):
    src = ckpt_dir("v3")
    # transformers rejects this config.json too (AutoTokenizer parses it): report the file, not the tokenizer
    bad_cfg = edited_config(src, str(tmp_path / "cfg"), rope_parameters=None,
                            rope_scaling={k: v for k, v in YARN.items() if k != "factor"})
    with pytest.raises(ValueError, match=r"transformers cannot read .*cfg/config.json .*factor") as e:
        load_tokenizer(bad_cfg)
    assert "tokenizer PATH" not in str(e.value)
    no_tok = copy_ckpt(src, str(tmp_path / "notok"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(no_tok, name))
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*notok.*pass --tokenizer PATH"):
        load_tokenizer(no_tok)
    tok_only = str(tmp_path / "tokonly")  # a tokenizer folder without config.json still loads
    os.makedirs(tok_only)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), tok_only)
    assert load_tokenizer(tok_only).encode("def f") == load_tokenizer(src).encode("def f")


def test_load_expert_slots_reads_only_the_wanted_experts(ckpt_dir, tmp_path):
    # elastic EP's re-placement (engine/elastic.py): expert 3 of layer 2 into local slots 0 and 5, nothing
    # else read. Two tensors turned FP8 without a scale (another expert's, an attention weight's) would fail
    # the read: loading past them proves them unread
    from moeserve.arch import DeepseekArch
    from moeserve.models.loader import load_expert_slots

    src = ckpt_dir("v3")
    dst = copy_ckpt(src, str(tmp_path / "experts"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    want = {p: tensors[f"model.layers.2.mlp.experts.3.{p}.weight"].float()
            for p in ("gate_proj", "up_proj", "down_proj")}
    for name in ("model.layers.2.mlp.experts.4.up_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"):
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    model, _ = build_model(src, DeepseekArch.from_pretrained(src), torch.float32, 64)
    experts = model.get_submodule("model.layers.2.mlp.experts")
    with torch.no_grad():
        experts.w13.zero_()
        experts.w2.zero_()
    assert load_expert_slots(model, dst, {"model.layers.2.mlp.experts": {3: [0, 5]}}) == 3
    for slot in (0, 5):
        for proj, w in want.items():
            assert torch.equal(experts.expert_weight(slot, proj), w), (slot, proj)
    assert not experts.w13[1].any() and not experts.w2[4].any()  # the other slots untouched
    with pytest.raises(CheckpointError, match=r"experts\.4\.up_proj\.weight.*has no .*_scale_inv"):
        load_expert_slots(model, dst, {"model.layers.2.mlp.experts": {4: [1]}})
