"""Block FP8 (layers/fp8.py): DeepSeek FP8 checkpoints stay FP8 in memory, scales from any shard,
`--quantization fp8` online, and the FP8 GEMM paths against a float reference."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.layers.fp8 import (Fp8FusedExperts, Fp8LinearMethod, Fp8Weight, dequantize_block, fp8_matmul,
                                 quantize_block, tp_slice_fp8)
from moeserve.layers.linear import Linear
from moeserve.models.loader import CheckpointError
from tests.quant.test_loading import EXPERT, LINEAR, PROMPTS, _tensors, _write_fp8

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _dequantized_copy(fp8: str, dst: str) -> str:
    """The same FP8 checkpoint dequantized to float32 and without quantization_config: the reference."""
    os.makedirs(dst)
    out = {}
    with safe_open(os.path.join(fp8, "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.endswith("_scale_inv"):
                continue
            t = f.get_tensor(k)
            out[k] = dequantize_block(t, f.get_tensor(k + "_scale_inv")) if t.dtype == torch.float8_e4m3fn else t
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(fp8, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    for f in os.listdir(fp8):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            open(os.path.join(dst, f), "wb").write(open(os.path.join(fp8, f), "rb").read())
    return dst


@pytest.fixture(scope="module")
def fp8_ckpt(ckpt_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    fp8 = str(root / "fp8")
    _write_fp8(ckpt_dir("v3", hidden_size=160), fp8)  # 160: partial 128-blocks on every projection
    return fp8, _dequantized_copy(fp8, str(root / "deq"))


def _model(llm):
    return llm.engine.runner.model


def _assert_fp8_storage(model) -> int:
    """Every projection and every routed expert holds e4m3 weights (1 byte each) + float32 block scales."""
    n_linear = n_experts = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name == "lm_head":  # the head stays in the model dtype under FP8
            assert m.quant_method is None and m.weight.is_floating_point() and m.weight.element_size() > 1
        elif isinstance(m, Linear):
            assert m.quant_method is Fp8LinearMethod, name
            assert m.weight.dtype == torch.float8_e4m3fn and m.weight.element_size() == 1, name
            assert m.weight_scale_inv.shape == (-(-m.out_features // 128), -(-m.in_features // 128)), name
            n_linear += 1
        elif isinstance(m, Fp8FusedExperts):
            assert m.w13.dtype == m.w2.dtype == torch.float8_e4m3fn, name
            n_experts += 1
    assert n_linear >= 3 * 5 and n_experts == 2  # 3 layers' attention projections + MLPs; 2 MoE layers
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    weight_count = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert weight_bytes == weight_count
    return weight_count


def test_fp8_checkpoint_stays_fp8_and_matches_its_dequantized_reference(fp8_ckpt):
    fp8, deq = fp8_ckpt
    a = LLM(fp8, dtype="float32")  # no --quantization: the checkpoint's FP8 is kept (as vLLM does)
    assert a.config.quant.method == "fp8" and a.config.quant.checkpoint_format == "fp8"
    _assert_fp8_storage(_model(a))
    # the FP8 bytes in memory are the checkpoint's, untouched
    file = _tensors(fp8)
    params = dict(_model(a).named_parameters())
    assert torch.equal(params[LINEAR + ".weight"].view(torch.uint8), file[LINEAR + ".weight"].view(torch.uint8))
    assert torch.equal(params[LINEAR + ".weight_scale_inv"], file[LINEAR + ".weight_scale_inv"])
    experts = _model(a).get_submodule(EXPERT)
    assert torch.equal(experts.expert_weight(5, "down_proj").view(torch.uint8),
                       file[EXPERT + ".5.down_proj.weight"].view(torch.uint8))
    b = LLM(deq, dtype="float32")
    got = [o.outputs[0].token_ids for o in a.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    want = [o.outputs[0].token_ids for o in b.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want
    # tiled dequantization in float32 computes the same products; only the summation order differs
    torch.testing.assert_close(a.engine.score(PROMPTS[0]), b.engine.score(PROMPTS[0]), rtol=1e-4, atol=1e-4)


def test_fp8_weights_take_a_quarter_of_float32_and_half_of_bf16(fp8_ckpt):
    fp8, deq = fp8_ckpt
    bf16 = LLM(deq, dtype="bfloat16")
    f8 = LLM(fp8, dtype="bfloat16")
    count = _assert_fp8_storage(_model(f8))
    quantized = {n for n, p in _model(f8).named_parameters() if p.dtype == torch.float8_e4m3fn}
    bf16_bytes = sum(p.numel() * p.element_size() for n, p in _model(bf16).named_parameters() if n in quantized)
    scale_bytes = sum(p.numel() * p.element_size() for n, p in _model(f8).named_parameters()
                      if n.endswith("scale_inv"))
    assert bf16_bytes == 2 * count
    assert scale_bytes < count  # partial blocks in this tiny model; 4 bytes per 16384 weights at full size
    out = f8.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_scales_in_another_shard(fp8_ckpt, tmp_path):
    fp8, _ = fp8_ckpt
    dst = tmp_path / "sharded"
    os.makedirs(dst)
    for f in os.listdir(fp8):
        if f != "model.safetensors":
            open(dst / f, "wb").write(open(os.path.join(fp8, f), "rb").read())
    tensors = _tensors(fp8)
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    rest = {k: v for k, v in tensors.items() if k not in scales}
    save_file(rest, dst / "model-00001-of-00002.safetensors")
    save_file(scales, dst / "model-00002-of-00002.safetensors")  # every scale in the shard after its weight
    weight_map = {k: "model-00001-of-00002.safetensors" for k in rest}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in scales})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(dst / "model.safetensors.index.json", "w"))
    a, b = LLM(str(dst), dtype="float32"), LLM(fp8, dtype="float32")
    _assert_fp8_storage(_model(a))
    assert torch.equal(a.engine.score(PROMPTS[0]), b.engine.score(PROMPTS[0]))
    # without the index: the loader reads both headers and still pairs them
    os.remove(dst / "model.safetensors.index.json")
    assert torch.equal(LLM(str(dst), dtype="float32").engine.score(PROMPTS[0]), b.engine.score(PROMPTS[0]))
    # a scale in no shard at all names the tensor
    del scales[LINEAR + ".weight_scale_inv"]
    save_file(scales, dst / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=LINEAR + r"\.weight .*has no .*_scale_inv in any shard"):
        LLM(str(dst), dtype="float32")


def test_online_fp8_quantization_of_a_float_checkpoint(ckpt_dir, fp8_ckpt):
    src = ckpt_dir("v3", hidden_size=160)  # the source of fp8_ckpt
    ref = LLM(src, dtype="float32")
    q = LLM(src, dtype="float32", quantization="fp8")
    assert q.config.quant.method == "fp8" and q.config.quant.checkpoint_format == "float"
    _assert_fp8_storage(_model(q))
    w = _tensors(src)[LINEAR + ".weight"]
    layer = _model(q).get_submodule(LINEAR)
    rel = (layer.dequantized_weight() - w).norm() / w.norm()
    assert 0 < rel < 0.04  # e4m3: 3 mantissa bits, ~2-3% relative error per weight
    # the same layout as DeepSeek's offline FP8 (amax / 448 per 128x128 block): bit-identical parameters
    offline = dict(_model(LLM(fp8_ckpt[0], dtype="float32")).named_parameters())
    online = dict(_model(q).named_parameters())
    assert online.keys() == offline.keys()
    for name, p in online.items():
        assert torch.equal(p.view(torch.uint8), offline[name].view(torch.uint8)), name
    x, y = q.engine.score(PROMPTS[0]).flatten(), ref.engine.score(PROMPTS[0]).flatten()
    assert not torch.equal(x, y)
    # this random net is chaotic (tests/models/test_loader.py): FP8 keeps the logits correlated, not equal
    assert torch.nn.functional.cosine_similarity(x, y, dim=0) > 0.8


def test_fp8_gemm_paths_match_the_dequantized_reference():
    torch.manual_seed(0)
    for n, k in ((300, 200), (256, 384), (16, 128)):
        w = torch.randn(n, k)
        q, s = quantize_block(w)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-n // 128), -(-k // 128))
        deq = dequantize_block(q, s)
        assert (deq - w).norm() / w.norm() < 0.04
        x = torch.randn(5, k)
        ref = x @ deq.t()
        torch.testing.assert_close(fp8_matmul(x, q, s, force="tiled"), ref, rtol=1e-5, atol=1e-4)
        # the FP8 tensor-core path (torch._scaled_mm also runs on CPU): activations in e4m3 too
        got = fp8_matmul(x.bfloat16(), q, s, force="scaled_mm").float()
        assert (got - ref).norm() / ref.norm() < 0.05
    # an all-zero block quantizes to zeros, not NaN
    q, s = quantize_block(torch.zeros(130, 130))
    assert torch.equal(dequantize_block(q, s), torch.zeros(130, 130))


def test_tp_slices_of_an_fp8_weight():
    w = torch.randn(512, 256)
    fw = Fp8Weight(*quantize_block(w))
    full = fw.dequantize()
    for tp_dim in (0, 1):
        for rank in (0, 1):
            layer = Linear(256, 512, tp_dim=tp_dim, tp_rank=rank, tp_size=2)
            part = tp_slice_fp8(layer, fw)
            assert isinstance(part, Fp8Weight)  # 256 / 2 = 128: block aligned, stays FP8
            assert torch.equal(part.dequantize(), full.chunk(2, dim=tp_dim)[rank])
    layer = Linear(256, 512, tp_dim=0, tp_rank=1, tp_size=4)  # 128-row slices of a 512-row weight: aligned
    assert isinstance(tp_slice_fp8(layer, fw), Fp8Weight)
    layer = Linear(256, 512, tp_dim=1, tp_rank=1, tp_size=4)  # 64 columns: not aligned, float slice
    part = tp_slice_fp8(layer, fw)
    assert not isinstance(part, Fp8Weight) and torch.equal(part, full.chunk(4, dim=1)[1])


def test_fp8_config_errors(fp8_ckpt, tmp_path):
    fp8, _ = fp8_ckpt
    dst = tmp_path / "bad"
    os.makedirs(dst)
    for f in os.listdir(fp8):
        open(dst / f, "wb").write(open(os.path.join(fp8, f), "rb").read())
    cfg = json.load(open(dst / "config.json"))
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    json.dump(cfg, open(dst / "config.json", "w"))
    with pytest.raises(ConfigError, match=r"weight_block_size \[64, 64\].*\[128, 128\]"):
        LLM(str(dst))
    with pytest.raises(ConfigError, match="--quantization must be one of a8w8, fp8"):
        LLM(fp8, quantization="fp4")


# FP8 e4m3 keeps 3 mantissa bits per weight, per-channel INT8 about 7: on this random net (Gaussian weights,
# near-tied logits) FP8 measured greedy 0.81, top-1 0.84, cosine 0.992 (a8w8: 0.93 / 0.94 / 0.999).
GREEDY_AGREEMENT_MIN, TOP1_MIN, LOGIT_COSINE_MIN = 0.75, 0.78, 0.985


def test_fp8_agrees_with_bf16(ckpt_dir):
    """tests/quant/test_accuracy.py's measurement for a8w8, with FP8's thresholds (docs/quantization.md)."""
    from moeserve.quant_eval import evaluate

    path = ckpt_dir("v3")
    ref, quant = LLM(path, dtype="bfloat16"), LLM(path, dtype="bfloat16", quantization="fp8")
    text = list(range(2, 500, 3)) + list(range(7, 300, 5))
    acc = evaluate(ref, quant, text, [text[0:8], text[120:128]], num_tokens=256, window=128)
    assert acc.greedy_agreement >= GREEDY_AGREEMENT_MIN, acc
    assert acc.logit_cosine_mean >= LOGIT_COSINE_MIN, acc
    assert acc.top1_agreement >= TOP1_MIN, acc
    assert abs(acc.ppl_quantized / acc.ppl_reference - 1) < 0.05, acc
    print(acc)


def test_fp8_kv_cache_halves_the_bytes_and_tracks_bf16_kv():
    """--kv-cache-dtype fp8 on the bundled trained model: e4m3 cache tensors, twice the blocks in the same
    --kv-cache-memory, and greedy output close to the BF16 cache's (measured 232 / 256 same tokens)."""
    prompts = ["def main():\n    ", "import os\nimport sys\n", "class Point:\n    def __init__(self", "for i in range("]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=8 << 20)
        runs[kv] = llm
    bf16, fp8 = runs["auto"].engine.runner, runs["fp8"].engine.runner
    assert bf16.kv_caches[0].dtype == torch.bfloat16 and fp8.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.num_blocks // 2 == bf16.num_blocks  # floor(M / (b / 2)) vs floor(M / b)
    want, got = ([o.outputs[0].token_ids for o in runs[kv].generate(prompts, sampling_params=params)]
                 for kv in ("auto", "fp8"))
    same = sum(a == b for x, y in zip(want, got) for a, b in zip(x, y))
    assert same >= 0.75 * 4 * 64, (same, want, got)


def test_fp8_kv_writes_clamp_and_keep_nan():
    from moeserve.layers.attention.kv_dtype import gather_cache, write_cache

    cache = torch.zeros(4, 3, dtype=torch.float8_e4m3fn)
    rows = torch.tensor([[1e6, -1e6, 0.3], [float("nan"), 2.0, -0.01]])
    write_cache(cache, torch.tensor([2, 0]), rows)
    back = gather_cache(cache, torch.tensor([0, 2]), torch.float32)
    assert back[1, 0] == 448 and back[1, 1] == -448  # saturated, not NaN
    assert abs(back[1, 2] - 0.3) < 0.02 and back[0, 1] == 2.0
    assert torch.isnan(back[0, 0])  # a NaN row stays visible to attention's masking
    assert torch.equal(gather_cache(cache, torch.tensor([1, 3]), torch.float32), torch.zeros(2, 3))
