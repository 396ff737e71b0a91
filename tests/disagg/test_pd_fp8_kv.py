"""PD disaggregation with --kv-cache-dtype fp8: the FP8 cache tensors are what NIXL registers and moves
(a quarter of float32's bytes per block), and decode output equals a unified FP8-KV engine's."""
import pytest
import torch

from moeserve import LLM
from moeserve.protocol import EngineCoreRequest
from tests.disagg.test_pd_engine import NIXL, PROMPTS, greedy, hold, pd, run


@pytest.fixture(scope="module")
def fp8_engines(ckpt_dir):
    kw = dict(dtype="float32", max_model_len=256, block_size=8, kv_cache_dtype="fp8")
    unified = LLM(ckpt_dir("v3"), **kw).engine
    prefill = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "kv_role": "kv_producer"}, **kw).engine
    decode = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "kv_role": "kv_consumer"}, num_kv_blocks=64,
                 **kw).engine
    return unified, prefill, decode


def test_pd_moves_the_fp8_cache_and_equals_unified(fp8_engines):
    unified, prefill, decode = fp8_engines
    for engine in fp8_engines:
        assert all(t.dtype == torch.float8_e4m3fn for t in engine.runner.kv_tensors())
    t = decode.runner.kv_tensors()[0]
    assert decode.kv_transfer.connector.block_bytes == t.shape[1] * t.shape[2]  # 1 byte per element
    for i, p in enumerate(PROMPTS):
        unified.add_request(EngineCoreRequest(f"u{i}", p, greedy(12), []))
    want, _ = run(unified)
    got, _ = pd(prefill, decode, PROMPTS, 12)
    assert got == [want[f"u{i}"] for i in range(len(PROMPTS))]
    # the pulled blocks hold the prefill engine's FP8 bytes
    prompt = PROMPTS[2]
    prefill.add_request(EngineCoreRequest("bp", prompt, greedy(1), [], kv_transfer_params=hold()))
    _, done = run(prefill)
    params = done["bp"].kv_transfer_params
    held = [t.view(torch.uint8)[params["remote_block_ids"]].clone() for t in prefill.runner.kv_tensors()]
    assert any(h.any() for h in held)


def test_a_bf16_kv_prefill_engine_is_refused_by_an_fp8_kv_decode_engine(ckpt_dir, fp8_engines):
    _, _, decode = fp8_engines
    other = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8,
                kv_transfer_config={**NIXL, "kv_role": "kv_producer"}).engine
    other.add_request(EngineCoreRequest("mp", PROMPTS[0], greedy(1), [], kv_transfer_params=hold()))
    _, done = run(other)
    decode.add_request(EngineCoreRequest("md", PROMPTS[0], greedy(4), [],
                                         kv_transfer_params=done["mp"].kv_transfer_params))
    _, done = run(decode)
    assert "--kv-cache-dtype" in done["md"].error
