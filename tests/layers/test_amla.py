"""AMLA (exponent-add rescaling of the online softmax) against the standard absorbed MLA decode."""
import math

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError, ModelConfig
from moeserve.layers.attention import amla
from moeserve.layers.attention.kv_dtype import gather_decode_context
from moeserve.layers.attention.metadata import _decode_batch


def standard(q, kv, mask, scale, value_dim):
    """What MLAttention._decode computes from the absorbed query on."""
    scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale
    scores.masked_fill_(mask[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv.dtype)
    return torch.bmm(probs, kv[..., :value_dim])


def _inputs(b=3, h=4, length=200, c=32, dr=8, dtype=torch.float32, spread=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, c + dr, generator=g) * spread).to(dtype)
    kv = torch.randn(b, length, c + dr, generator=g).to(dtype)
    lens = torch.tensor([length, 1, length // 2 + 7])[:b]
    mask = torch.arange(length)[None, :] >= lens[:, None]
    return q, kv, mask, 1 / math.sqrt(c + dr), c


def test_scale_by_pow2_is_an_exact_multiply_with_zero_and_underflow_guards():
    x = torch.tensor([[1.5, -3.25, 0.0, 2e-38, 6e4, -0.0]])
    k = torch.tensor([[-3]], dtype=torch.int32)
    want = torch.tensor([[1.5 / 8, -3.25 / 8, 0.0, 0.0, 6e4 / 8, 0.0]])  # 2e-38 / 8 would be denormal
    got = amla.scale_by_pow2_(x.clone(), k)
    assert torch.equal(got, want)
    y = torch.randn(1000) * 100
    assert torch.equal(amla.scale_by_pow2_(y.clone(), torch.tensor(-5, dtype=torch.int32)), y / 32)


@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0])  # flat, ordinary and very peaked softmax
@pytest.mark.parametrize("block", [1, 16, 64, 512])
def test_float32_equals_standard(spread, block):
    q, kv, mask, scale, c = _inputs(spread=spread)
    want = standard(q, kv, mask, scale, c)
    got = amla.amla_attention(q, kv, mask, scale, c, block=block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_within_bf16_tolerance():
    q, kv, mask, scale, c = _inputs(dtype=torch.bfloat16)
    want = standard(q.float(), kv.float(), mask, scale, c)
    got = amla.amla_attention(q, kv, mask, scale, c).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_the_rescale_is_an_integer_add_on_the_output_bits(monkeypatch):
    # the online loop never multiplies the accumulated output: every rescale goes through scale_by_pow2_
    calls = []
    real = amla.scale_by_pow2_

    def spy(x, k):
        calls.append(int(k.min()))
        return real(x, k)
    monkeypatch.setattr(amla, "scale_by_pow2_", spy)
    q, kv, mask, scale, c = _inputs(spread=30.0)
    amla.amla_attention(q, kv, mask, scale, c, block=8)
    assert len(calls) == 2 * math.ceil(200 / 8) and min(calls) < 0


def _paged(block, lens, dtype=torch.float32, heads=4, c=32, dr=8, seed=0):
    """A shuffled paged cache [num_blocks, block, c + dr] holding ragged contexts, every slot past a length (in
    a row's last block, in unused blocks and in the padding block 0 of shorter rows' tables) NaN as a failed
    request leaves it; the query; the DecodeBatch."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.full((num_blocks, block, c + dr), float("nan"))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n, count in zip(lens, per_seq):
        table = order[used:used + count]
        used += count
        flat = cache[table].view(-1, c + dr)
        flat[:n] = torch.randn(n, c + dr, generator=g)
        cache[table] = flat.view(count, block, c + dr)
        tables.append(table)
    q = torch.randn(len(lens), heads, c + dr, generator=g) * 3
    cache = cache.to(dtype) if dtype != torch.float8_e4m3fn else cache.clamp(-400, 400).to(dtype)
    return q, cache, _decode_batch(list(range(len(lens))), tables, lens, block), 1 / math.sqrt(c + dr), c


@pytest.mark.parametrize("block", [1, 16, 64, 128])  # 128: a tile is one block larger than BLOCK
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_paged_reader_equals_the_gathered_one(block, dtype):
    """Tile by tile from the block table, stale NaN slots included, the same as over the gathered context
    (float32 within 1e-5: only the tiles' boundaries differ), and no context buffer is made."""
    q, cache, d, scale, c = _paged(block, [200, 1, 107, 64], dtype)
    got = amla.amla_attention_paged(q, cache, d, scale, c)
    assert d._context == {}  # the step's scratch buffer for whole contexts was never asked for
    assert not got.isnan().any()
    kv = gather_decode_context(cache, d, torch.float32)
    torch.testing.assert_close(got, amla.amla_attention(q, kv, d.mask, scale, c), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, standard(q, kv, d.mask, scale, c), rtol=1e-5, atol=1e-5)


def test_engine_greedy_output_matches_standard(ckpt_dir):
    path = ckpt_dir("v3")
    prompts = [[5, 17, 99, 200, 3, 45, 67], list(range(20, 120))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        outs = {}
        for impl in ("standard", "amla"):
            llm = LLM(path, dtype="float32", mla_decode=impl)
            outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                                        sampling_params=params)]
        assert outs["amla"] == outs["standard"]
    finally:
        amla.set_decode_impl("standard")


def test_unknown_impl_is_refused():
    with pytest.raises(ConfigError, match="--mla-decode must be one of standard, amla, amla-triton"):
        ModelConfig(model="unused", mla_decode="fast")
    with pytest.raises(ValueError, match="--mla-decode must be one of"):
        amla.set_decode_impl("fast")


TRITON_CHECK = """
import torch
from tests.layers.test_amla import _inputs, standard
from moeserve.layers.attention.amla_triton import amla_attention_triton
for spread in (0.1, 3.0, 30.0):
    for block in (16, 64):
        q, kv, mask, scale, c = _inputs(spread=spread)
        torch.testing.assert_close(amla_attention_triton(q, kv, mask, scale, c, block=block),
                                   standard(q, kv, mask, scale, c), rtol=1e-5, atol=2e-5)
q, kv, mask, scale, c = _inputs(dtype=torch.bfloat16, c=48, dr=16)  # D = 64, C = 48: a masked tail of columns
torch.testing.assert_close(amla_attention_triton(q, kv, mask, scale, c).float(),
                           standard(q.float(), kv.float(), mask, scale, c), rtol=2e-2, atol=2e-2)
print("ok")
"""


def test_triton_kernel_under_the_interpreter_equals_standard():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}  # read when the kernel is defined
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


ENGINE_CHECK = """
import sys
from moeserve import LLM, SamplingParams
prompts = [[5, 17, 99, 200, 3, 45, 67], list(range(20, 90))]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = [[o.outputs[0].token_ids for o in LLM(sys.argv[1], dtype="float32", mla_decode=impl).generate(
    prompt_token_ids=prompts, sampling_params=params)] for impl in ("standard", "amla-triton")]
assert outs[0] == outs[1], outs
print("ok")
"""


def test_engine_with_the_triton_kernel_under_the_interpreter_matches_standard(ckpt_dir):
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", ENGINE_CHECK, ckpt_dir("v3")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
