"""Automatic prefix caching: block hashing, sharing and eviction (engine/kv_cache.py) and, on a real engine,
that reused KV gives the same tokens as computing it (greedy, with and without MTP, under preemption)."""
import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HEAD = list(range(40, 73))  # 33 tokens: 8 full blocks of 4 and one token more


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def _run_prefill(kv: KVCacheManager, req: Request) -> None:
    """What the scheduler does for a whole prompt in one step: allocate, compute, index the full blocks."""
    kv.take_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_missing_tokens)
    req.num_computed_tokens = req.num_tokens
    req.output_token_ids.append(7)
    kv.cache_full_blocks(req)


def test_shared_prefix_is_reused_up_to_the_first_difference():
    kv = KVCacheManager(64, BS, enable_caching=True)
    a = _req("a", HEAD + [1, 2, 3])
    _run_prefill(kv, a)
    b = _req("b", HEAD[:20] + [999] + HEAD[21:])  # differs inside block 5 (tokens 20..23)
    assert kv.take_cached_prefix(b) == 20
    assert kv.block_tables["b"] == kv.block_tables["a"][:5]
    c = _req("c", [5] + HEAD[1:])  # differs in the first token: nothing shared
    assert kv.take_cached_prefix(c) == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(64, BS, enable_caching=True)
    _run_prefill(kv, _req("a", HEAD[:32] + [1]))
    again = _req("b", HEAD[:32])  # 8 full blocks, all cached
    assert kv.take_cached_prefix(again) == 28  # the last block is recomputed: its logits give token 1
    assert again.num_missing_tokens == 4


def test_disabled_caching_never_shares():
    kv = KVCacheManager(64, BS)
    _run_prefill(kv, _req("a", HEAD))
    assert kv.take_cached_prefix(_req("b", HEAD)) == 0 and kv.pool.num_cached == 0


def test_mtp_hash_covers_the_token_after_the_block():
    """The MTP layer's KV at a block's last position is computed from the next token, so a prompt equal in
    block 0 but different right after it must not reuse block 0 with MTP (it may without)."""
    for mtp, shared in ((False, 4), (True, 0)):
        kv = KVCacheManager(64, BS, enable_caching=True, hash_next_token=mtp)
        _run_prefill(kv, _req("a", HEAD))
        assert kv.take_cached_prefix(_req("b", HEAD[:4] + [999] + HEAD[5:])) == shared


def test_refcounts_and_eviction_order():
    kv = KVCacheManager(12, BS, enable_caching=True)
    a = _req("a", HEAD[:16] + [1])  # 5 blocks, 4 of them full and indexed
    _run_prefill(kv, a)
    b = _req("b", HEAD[:16] + [2])
    assert kv.take_cached_prefix(b) == 16
    kv.free(a)  # b still uses a's full blocks: none of them is free
    assert kv.pool.num_free == 12 - 4 and kv.pool.num_cached == 4
    kv.free(b)
    assert kv.pool.num_free == 12 and kv.pool.num_cached == 4  # free, but still cached
    # Plain free blocks go first: 8 of them before a cached block is evicted.
    filler = _req("f", [3] * 32)
    assert kv.allocate_slots(filler, 32) and kv.pool.num_cached == 4
    c = _req("c", HEAD[:16] + [3])
    assert kv.take_cached_prefix(c) == 16
    kv.free(c)
    kv.free(filler)
    big = _req("g", [4] * 48)
    assert kv.allocate_slots(big, 48)  # every block: the cached prefix is evicted, last block first
    assert kv.pool.num_cached == 0 and kv.pool.num_free == 0


def test_evicting_the_tail_first_keeps_the_shorter_prefix():
    kv = KVCacheManager(6, BS, enable_caching=True)
    a = _req("a", HEAD[:16] + [1])  # 5 blocks, the 4 full ones cached
    _run_prefill(kv, a)
    kv.free(a)
    # 3 blocks: the never-used one, a's partial last block, then the cached block evicted first: a's 4th.
    assert kv.allocate_slots(_req("x", [9] * 12), 12)
    assert kv.take_cached_prefix(_req("b", HEAD[:16] + [2])) == 12


# ---- a real engine ---------------------------------------------------------------------------------------

def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


PROMPTS = [HEAD + [9, 10, 11], HEAD[:21] + [300, 301], HEAD + [9, 10, 11] + list(range(100, 120))]


@pytest.mark.parametrize("mtp", [False, True])
def test_engine_reuses_cached_prefixes_with_identical_tokens(mtp_ckpt_dir, mtp):
    kw = dict(dtype="float32", block_size=BS, max_num_batched_tokens=32)
    if mtp:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 2}
    ref = _greedy(LLM(mtp_ckpt_dir("v3"), enable_prefix_caching=False, **kw), PROMPTS)
    llm = LLM(mtp_ckpt_dir("v3"), **kw)
    first = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    assert first[0].num_cached_tokens == 0
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert first[0].outputs[0].token_ids == ref[0]
    # Prompt 0 again: its 9 full blocks less the last token's; prompt 1 shares 5 blocks; prompt 2 extends
    # prompt 0 (its prompt blocks and, in the same call, nothing of the answer: different tokens follow).
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 32 and cached[1] == 20 and cached[2] >= 32
    s = llm.engine.stats()
    assert s.prefix_cache_hits == sum(cached) and s.prefix_cache_queries == sum(len(p) for p in [PROMPTS[0]] + PROMPTS)
    kv = llm.engine.kv
    assert kv.pool.num_free == kv.pool.num_blocks and not kv.block_tables


def test_engine_really_reads_the_cached_kv(mtp_ckpt_dir):
    """Corrupt the cached blocks between two calls: a request that reuses them must see it."""
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", block_size=BS)
    ref = _greedy(llm, [PROMPTS[0]])
    for cache in llm.engine.runner.kv_tensors():
        cache.mul_(-3.0)
    assert _greedy(llm, [PROMPTS[0]]) != ref
    llm.engine.kv.pool.reset_cache()
    assert _greedy(llm, [PROMPTS[0]]) == ref


def test_engine_identical_under_preemption_with_caching(mtp_ckpt_dir):
    """A pool too small for every request: preempted requests recompute, partly from the cache."""
    prompts = [HEAD[:8] + [i] * 27 for i in range(5)]  # 2 shared blocks, 47 tokens = 12 blocks each
    kw = dict(dtype="float32", block_size=BS, num_kv_blocks=24, max_num_batched_tokens=32)
    ref = _greedy(LLM(mtp_ckpt_dir("v3"), enable_prefix_caching=False, **kw), prompts)
    llm = LLM(mtp_ckpt_dir("v3"), **kw)
    assert _greedy(llm, prompts) == ref
    s = llm.engine.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    assert llm.engine.kv.pool.num_free == 24


def test_queries_count_only_lookups(mtp_ckpt_dir):
    """/metrics hit rate = hits / queries: with the cache off nothing is looked up, so nothing is queried
    (it read 0 hits of every prompt token), and a request that arrives with its KV (a PD pull) is not
    looked up either."""
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", block_size=BS, enable_prefix_caching=False)
    _greedy(llm, [PROMPTS[0], PROMPTS[0]])
    s = llm.engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0)
    from moeserve.config import SchedulerConfig
    from moeserve.engine.scheduler import Scheduler
    kv = KVCacheManager(64, BS, enable_caching=True)
    sched = Scheduler(SchedulerConfig(), kv)
    pulled = _req("p", HEAD)
    assert kv.allocate_slots(pulled, len(HEAD))
    pulled.num_computed_tokens = len(HEAD) - 1  # as kv_transfer hands it over
    sched.add_request(pulled)
    sched.add_request(_req("n", HEAD))
    assert len(sched.schedule().scheduled) == 2
    assert sched.prefix_cache_queries == len(HEAD) and sched.prefix_cache_hits == 0


def test_prefix_caching_flag_is_checked():
    with pytest.raises((TypeError, ValueError), match="enable-prefix-caching"):
        LLM(enable_prefix_caching="yes")


def test_seeded_sampling_unchanged_by_caching(mtp_ckpt_dir):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", block_size=BS)
    ref = LLM(mtp_ckpt_dir("v3"), enable_prefix_caching=False, **kw).generate(
        prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0].outputs[0].token_ids
    llm = LLM(mtp_ckpt_dir("v3"), **kw)
    runs = [llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0] for _ in range(2)]
    assert [r.outputs[0].token_ids for r in runs] == [ref, ref] and runs[1].num_cached_tokens == 32


def test_siblings_wait_a_step_and_share_the_prompt(mtp_ckpt_dir):
    """n > 1 samples (and a burst of requests with one prompt) arrive together: the first computes the
    prompt, the others wait a step and take its blocks from the cache instead of computing it again."""
    params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", block_size=BS)
    ref = LLM(mtp_ckpt_dir("v3"), enable_prefix_caching=False, **kw).generate(
        prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0]
    llm = LLM(mtp_ckpt_dir("v3"), **kw)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert llm.engine.stats().prefix_cache_hits == 3 * 32  # 3 siblings x the prompt's shareable 8 blocks
    burst = llm.generate(prompt_token_ids=[PROMPTS[2]] * 5, sampling_params=GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in burst}) == 1
    assert sorted(o.num_cached_tokens for o in burst)[1:] == [52] * 4  # 13 blocks of the 56-token prompt
