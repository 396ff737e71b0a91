"""PD disaggregation between two real engines over NIXL/UCX: a prefill engine holds a prompt's KV, a decode
engine pulls it and decodes. Lossless: the decode engine's tokens equal a unified engine's."""
import time

import pytest

from moeserve import LLM, SamplingParams
from moeserve.protocol import EngineCoreRequest

PROMPTS = [[5, 17, 99, 200, 3, 45, 67, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [300, 12],
           list(range(20, 90)), [7]]
NIXL = {"kv_connector": "nixl"}


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(engine, timeout=60.0):
    """Step until idle; {request id: output token ids}, {request id: finished output}."""
    tokens, last = {}, {}
    t0 = time.monotonic()
    while engine.has_unfinished():
        assert time.monotonic() - t0 < timeout, "engine did not finish"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                last[out.request_id] = out
    return tokens, last


@pytest.fixture(scope="module")
def engines(ckpt_dir):
    kw = dict(dtype="float32", max_model_len=256, block_size=8)
    unified = LLM(ckpt_dir("v3"), **kw).engine
    prefill = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "kv_role": "kv_producer"}, **kw).engine
    decode = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "kv_role": "kv_consumer"}, num_kv_blocks=64,
                 **kw).engine
    return unified, prefill, decode


def pd(prefill, decode, prompts, n, prefix="r"):
    for i, p in enumerate(prompts):
        prefill.add_request(EngineCoreRequest(f"{prefix}p{i}", p, greedy(1), [],
                                              kv_transfer_params={"do_remote_decode": True}))
    _, done = run(prefill)
    for i, p in enumerate(prompts):
        params = done[f"{prefix}p{i}"].kv_transfer_params
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(p)
        decode.add_request(EngineCoreRequest(f"{prefix}d{i}", p, greedy(n), [], kv_transfer_params=params))
    tokens, done = run(decode)
    return [tokens[f"{prefix}d{i}"] for i in range(len(prompts))], done


def test_pd_output_equals_unified_and_blocks_come_back(engines):
    unified, prefill, decode = engines
    for i, p in enumerate(PROMPTS):
        unified.add_request(EngineCoreRequest(f"u{i}", p, greedy(12), []))
    want, _ = run(unified)
    got, _ = pd(prefill, decode, PROMPTS, 12)
    assert got == [want[f"u{i}"] for i in range(len(PROMPTS))]
    assert decode.kv.pool.num_free == decode.kv.pool.num_blocks
    # The prefill engine frees its held blocks once the decode engine's notifications arrive.
    t0 = time.monotonic()
    while prefill.kv_transfer.num_held and time.monotonic() - t0 < 10:
        prefill.step()
        time.sleep(0.01)
    assert prefill.kv_transfer.num_held == 0
    assert prefill.kv.pool.num_free == prefill.kv.pool.num_blocks
