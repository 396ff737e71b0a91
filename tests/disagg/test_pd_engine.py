"""PD disaggregation between two real engines over NIXL/UCX: a prefill engine holds a prompt's KV, a decode
engine pulls it and decodes. Lossless: the decode engine's tokens equal a unified engine's."""
import time

import pytest

from moeserve import LLM, SamplingParams
from moeserve.disagg import trust
from moeserve.protocol import EngineCoreRequest

PROMPTS = [[5, 17, 99, 200, 3, 45, 67, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [300, 12],
           list(range(20, 90)), [7]]
SECRET = "test-deployment-secret-0123456789"
NIXL = {"kv_connector": "nixl", "kv_secret": SECRET}


def hold():
    """What the proxy sends a prefill instance: do_remote_decode with its signed one-use ticket."""
    return trust.ticket(SECRET)


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
                                              kv_transfer_params=hold()))
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


def test_decode_uses_the_pulled_kv(engines):
    """Zero the prefill engine's held blocks before the pull: the decode output changes, so it came from them."""
    unified, prefill, decode = engines
    prompt = PROMPTS[2]
    decode.kv.pool.reset_cache()  # an earlier test decoded this prompt: its cache would serve it, not the pull
    unified.add_request(EngineCoreRequest("cu", prompt, greedy(8), []))
    want, _ = run(unified)
    prefill.add_request(EngineCoreRequest("cp", prompt, greedy(1), [], kv_transfer_params=hold()))
    _, done = run(prefill)
    params = done["cp"].kv_transfer_params
    for t in prefill.runner.kv_tensors():
        t[params["remote_block_ids"]] = 0
    decode.add_request(EngineCoreRequest("cd", prompt, greedy(8), [], kv_transfer_params=params))
    got, _ = run(decode)
    assert got["cd"] != want["cu"]
    for engine in (prefill, decode):  # the zeroed blocks stay cached prefixes: later tests must not reuse them
        engine.kv.pool.reset_cache()


def test_short_decode_pool_queues_pulls_and_aborts_free_blocks(ckpt_dir, engines):
    unified, prefill, _ = engines
    small = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=14,
                kv_transfer_config=NIXL).engine
    prompts = [list(range(30 + i, 70 + i)) for i in range(4)]  # 6 blocks each with 12 tokens out: 2 fit at once
    for i, p in enumerate(prompts):
        unified.add_request(EngineCoreRequest(f"su{i}", p, greedy(12), []))
    want, _ = run(unified)
    got, _ = pd(prefill, small, prompts, 12, prefix="s")
    assert got == [want[f"su{i}"] for i in range(4)]
    assert small.kv.pool.num_free == 14
    # An abort while a pull waits for blocks or reads: its blocks come back, nothing is answered for it.
    prefill.add_request(EngineCoreRequest("ap", prompts[0], greedy(1), [],
                                          kv_transfer_params=hold()))
    _, done = run(prefill)
    small.add_request(EngineCoreRequest("ad", prompts[0], greedy(12), [],
                                        kv_transfer_params=done["ap"].kv_transfer_params))
    small.step()
    small.abort_requests(["ad"])
    tokens, _ = run(small)
    assert "ad" not in tokens and small.kv.pool.num_free == 14 and not small.kv_transfer.pulls


def test_unpulled_blocks_are_freed_after_the_hold_timeout(ckpt_dir):
    eng = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8,
              kv_transfer_config={**NIXL, "kv_hold_timeout": 0.2}).engine
    eng.add_request(EngineCoreRequest("h", PROMPTS[0], greedy(1), [], kv_transfer_params=hold()))
    run(eng)
    assert eng.kv_transfer.num_held == 1 and eng.kv.pool.num_free < eng.kv.pool.num_blocks
    time.sleep(0.3)
    eng.step()
    assert eng.kv_transfer.num_held == 0 and eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_an_abort_frees_kv_held_for_a_decode_instance(engines):
    """Where the prefill server's /kv_transfer/release ends (the proxy's call when the decode instance refused
    the request): aborting a finished do_remote_decode request's id frees its held blocks now; they used to
    stay held until kv_hold_timeout (120 s by default). Unknown ids are ignored."""
    _, prefill, _ = engines
    prefill.add_request(EngineCoreRequest("rel", list(range(400, 437)), greedy(1), [],
                                          kv_transfer_params=hold()))
    run(prefill)
    blocks = len(prefill.kv.held["rel"])
    assert "rel" in prefill.kv_transfer.held_until and blocks == 5
    free = prefill.kv.pool.num_free
    prefill.abort_requests(["rel", "never-seen"])
    assert "rel" not in prefill.kv_transfer.held_until and "rel" not in prefill.kv.held
    assert prefill.kv.pool.num_free == free + blocks


def resign(params, tokens, **changes):
    """Params altered and signed again with the deployment's secret: what only an insider could send."""
    body = {k: v for k, v in params.items() if k not in ("remote_signature", "remote_prompt_hash", "remote_expires")}
    return trust.sign_params(SECRET, {**body, **changes}, tokens, 60)


def test_unreachable_prefill_engine_and_bad_params_are_errors(engines, monkeypatch):
    from moeserve.engine import kv_transfer
    unified, prefill, decode = engines
    monkeypatch.setattr(kv_transfer, "METADATA_TIMEOUT_S", 0.5)
    prefill.add_request(EngineCoreRequest("xp", PROMPTS[0], greedy(1), [], kv_transfer_params=hold()))
    _, done = run(prefill)
    good = done["xp"].kv_transfer_params
    p0 = PROMPTS[0]
    gone = resign(good, p0, remote_engine_id="nobody", remote_port=9)  # nothing listens there
    bad = {"x1": ({"do_remote_prefill": True}, "remote_engine_id"),
           "x2": (resign(good, p0, remote_block_ids=[0]), "too few"),
           "x3": (resign(good, p0, remote_block_bytes=4), "KV layout"),
           "x4": ({"do_remote_decode": True, "do_remote_prefill": True}, "exclude"),
           "x5": ([1, 2], "JSON object"),
           "x6": (hold(), "decode instance"),
           "x7": (gone, "nothing listens"),
           "x8": (good, "another prompt")}  # the params of PROMPTS[0] with PROMPTS[1]
    for rid, (params, _) in bad.items():
        decode.add_request(EngineCoreRequest(rid, PROMPTS[1] if rid == "x8" else p0, greedy(4), [],
                                             kv_transfer_params=params))
    tokens, done = run(decode)
    for rid, (_, words) in bad.items():
        assert words in done[rid].error, (rid, done[rid].error)
    assert done["x7"].error_kind == "kv_transfer"
    unified.add_request(EngineCoreRequest("x9", PROMPTS[0], greedy(1), [], kv_transfer_params=hold()))
    _, done = run(unified)
    assert "--kv-transfer-config" in done["x9"].error
    assert decode.kv.pool.num_free == decode.kv.pool.num_blocks


def test_pd_with_mtp_equals_unified_mtp(mtp_ckpt_dir):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw = dict(dtype="float32", max_model_len=256, block_size=8, speculative_config=spec)
    path = mtp_ckpt_dir("v3")
    unified = LLM(path, **kw).engine
    prefill = LLM(path, kv_transfer_config=NIXL, **kw).engine
    decode = LLM(path, kv_transfer_config=NIXL, **kw).engine
    assert len(decode.runner.kv_tensors()) == decode.arch.num_hidden_layers + 1  # the MTP layer's cache too
    for i, p in enumerate(PROMPTS[:3]):
        unified.add_request(EngineCoreRequest(f"mu{i}", p, greedy(12), []))
    want, _ = run(unified)
    got, _ = pd(prefill, decode, PROMPTS[:3], 12, prefix="m")
    assert got == [want[f"mu{i}"] for i in range(3)]
    assert decode.stats().spec_num_accepted_tokens > 0


def test_kv_transfer_config_errors_name_the_flag():
    from moeserve.config import ConfigError, KVTransferConfig
    from moeserve.engine_args import EngineArgs
    for value, words in [('{"kv_connector": "tcp"}', "kv_connector"), ('{"kv_role": "x"}', "kv_role"),
                         ('{"kv_port": 70000}', "kv_port"), ('{"colour": 1}', "unknown key"),
                         ("not json", "JSON object"), ('{"kv_hold_timeout": 0}', "kv_hold_timeout")]:
        with pytest.raises(ConfigError, match=words):
            KVTransferConfig.from_value(value)
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        EngineArgs(model="m", tensor_parallel_size=2, kv_transfer_config=NIXL).create_config(256)



def test_a_pd_engine_needs_the_deployment_secret(monkeypatch):
    from moeserve.config import ConfigError
    from moeserve.engine_args import EngineArgs
    monkeypatch.delenv(trust.SECRET_ENV, raising=False)
    for kvt, words in [({"kv_connector": "nixl"}, "MOESERVE_KV_SECRET"), ({"kv_secret": "short"}, ">= 16")]:
        with pytest.raises(ConfigError, match=words):
            EngineArgs(model="m", kv_transfer_config=kvt).create_config(256)
    monkeypatch.setenv(trust.SECRET_ENV, SECRET)
    config = EngineArgs(model="m", kv_transfer_config={"kv_connector": "nixl"}).create_config(256)
    assert config.kv_transfer.kv_secret == SECRET
    assert SECRET not in repr(EngineArgs(model="m", kv_transfer_config=NIXL).create_config(256))


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_pd_with_a_data_parallel_instance(ckpt_dir, engines, side):
    """A DP2 + EP instance on either side: each rank process pulls (or serves) KV with its own NIXL agent."""
    unified, prefill, decode = engines
    dp = LLM(ckpt_dir("v3"), dtype="float32", max_model_len=256, block_size=8, data_parallel_size=2,
             enable_expert_parallel=True, kv_transfer_config=NIXL).engine
    try:
        for i, p in enumerate(PROMPTS):
            unified.add_request(EngineCoreRequest(f"dpu{side}{i}", p, greedy(10), []))
        want, _ = run(unified)
        pre, dec = (prefill, dp) if side == "decode" else (dp, decode)
        got, _ = pd(pre, dec, PROMPTS, 10, prefix=f"dp{side}")
        assert got == [want[f"dpu{side}{i}"] for i in range(len(PROMPTS))]
        if side == "prefill":
            # KV held for a decode instance that will not pull it is freed by an abort of its id, although
            # the front end forgot which rank ran it at its finish (the abort goes to every rank).
            dp.add_request(EngineCoreRequest("dprel", PROMPTS[2], greedy(1), [],
                                             kv_transfer_params=hold()))
            _, done = run(dp)
            assert done["dprel"].kv_transfer_params["do_remote_prefill"]
            assert dp.stats().kv_cache_usage > 0
            dp.abort_requests(["dprel"])
            t0 = time.monotonic()
            while dp.stats().kv_cache_usage > 0 and time.monotonic() - t0 < 10:
                time.sleep(0.05)
            assert dp.stats().kv_cache_usage == 0
    finally:
        dp.shutdown()


def test_a_prefill_engine_restarted_under_the_same_engine_id_is_pulled_from_again(ckpt_dir, engines):
    """The decode engine keeps a prefill agent's metadata by name: a prefill instance restarted with the same
    engine_id (on another port, or the same one) used to fail every pull with the old metadata, for good."""
    import gc
    import socket
    unified, _, decode = engines
    kw = dict(dtype="float32", max_model_len=256, block_size=8)
    for i, p in enumerate(PROMPTS[:2]):
        unified.add_request(EngineCoreRequest(f"ru{i}", p, greedy(6), []))
    want, _ = run(unified)
    want = [want[f"ru{i}"] for i in range(2)]

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    first_port = port()
    first = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "engine_id": "restarted", "kv_port": first_port}, **kw)
    assert pd(first.engine, decode, PROMPTS[:2], 6, prefix="ra")[0] == want
    # The same name on another port (the first one still alive): the decode engine must not read the first.
    second = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "engine_id": "restarted", "kv_port": port()}, **kw)
    got, done = pd(second.engine, decode, PROMPTS[:2], 6, prefix="rb")
    assert got == want, {k: v.error for k, v in done.items()}
    # The same name and port after the first is gone: its stale metadata fails one read, which is retried.
    del second
    first = None
    gc.collect()
    third = LLM(ckpt_dir("v3"), kv_transfer_config={**NIXL, "engine_id": "restarted", "kv_port": first_port}, **kw)
    got, done = pd(third.engine, decode, PROMPTS[:2], 6, prefix="rc")
    assert got == want, {k: v.error for k, v in done.items()}
    assert decode.kv.pool.num_free == decode.kv.pool.num_blocks


def test_a_held_request_id_is_not_reused(engines):
    """A second do_remote_decode request under the id of one whose KV is held replaced the held blocks'
    record at its finish: the first blocks were never freed (not by a pull, not by the hold timeout)."""
    _, prefill, _ = engines
    held, free = prefill.kv_transfer.num_held, prefill.kv.pool.num_free  # other tests' KV may still wait
    prefill.add_request(EngineCoreRequest("dup", PROMPTS[0], greedy(1), [], kv_transfer_params=hold()))
    run(prefill)
    prefill.add_request(EngineCoreRequest("dup", PROMPTS[2], greedy(1), [], kv_transfer_params=hold()))
    _, done = run(prefill)
    assert "already in use" in done["dup"].error and done["dup"].kv_transfer_params is None
    prefill.kv_transfer.held_until["dup"] = 0.0  # expire it now
    prefill.step()
    assert prefill.kv_transfer.num_held <= held and prefill.kv.pool.num_free >= free


def test_decode_pulls_only_what_its_prefix_cache_lacks(engines):
    """A second turn of a chat: the decode instance decoded turn 1, so its prefix cache holds that prompt's
    blocks and it pulls only the new ones (still lossless)."""
    unified, prefill, decode = engines
    turn1 = list(range(100, 141))  # 41 tokens: 5 full blocks of 8
    turn2 = turn1 + list(range(200, 230))
    unified.add_request(EngineCoreRequest("t2u", turn2, greedy(6), []))
    want, _ = run(unified)
    pd(prefill, decode, [turn1], 6, prefix="t1")
    pulled, here = decode.kv_transfer.blocks_pulled, decode.kv_transfer.blocks_cached_here
    got, _ = pd(prefill, decode, [turn2], 6, prefix="t2")
    assert got == [want["t2u"]]
    # turn 2 needs blocks for 70 of its 71 tokens (9); turn 1's 5 full blocks are cached here
    assert decode.kv_transfer.blocks_cached_here - here == 5
    assert decode.kv_transfer.blocks_pulled - pulled == 4
    assert decode.kv.pool.num_free == decode.kv.pool.num_blocks


def test_pd_equals_unified_in_float32_on_prompts_neither_side_has_seen(engines):
    """Fresh random prompts (no prefix-cache hit on either side), all in flight at once on each side: the
    decode engine computes the last prompt token in a one-token step, the unified engine inside the prefill;
    in float32 the logits differ by ~1e-6, never enough to change a greedy token (BF16: docs/disaggregation.md,
    benchmarks/pd_agreement.py)."""
    import random
    unified, prefill, decode = engines
    rng = random.Random(1919)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 70))] for _ in range(16)]
    for i, p in enumerate(prompts):
        unified.add_request(EngineCoreRequest(f"fresh-u{i}", p, greedy(24), []))
    want, _ = run(unified)
    got, _ = pd(prefill, decode, prompts, 24, prefix="fresh")
    assert got == [want[f"fresh-u{i}"] for i in range(len(prompts))]
