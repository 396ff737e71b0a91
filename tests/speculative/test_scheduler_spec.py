"""Scheduler bookkeeping for drafts (no model): drafts are extra scheduled tokens, num_computed_tokens moves
by the accepted count, rejected and lookahead slots go back to the pool."""
from hypothesis import given, settings, strategies as st

from moeserve.config import SchedulerConfig, SpeculativeConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request
from moeserve.engine.scheduler import Scheduler
from moeserve.sampling_params import SamplingParams


def make(k=2, blocks=64, block_size=4, max_len=64, budget=64):
    kv = KVCacheManager(blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_len),
                      kv, SpeculativeConfig("mtp", k))
    return sched, kv


def step(sched, accept):
    """One step: every sampling request emits accepted drafts + 1 token (token ids are fake: 7)."""
    out = sched.schedule()
    sampled, drafts = {}, {}
    for s in out.scheduled:
        if s.samples:
            a = min(accept(s), len(s.draft_token_ids))
            sampled[s.request.request_id] = s.draft_token_ids[:a] + [7]
            drafts[s.request.request_id] = [7] * s.num_new_drafts
    return out, sched.update_from_output(out, sampled, drafts)


def test_drafts_are_scheduled_and_rejected_ones_rolled_back():
    sched, kv = make(k=3)
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50))
    sched.add_request(req)
    out, _ = step(sched, lambda s: 0)
    s = out.scheduled[0]
    assert (s.start, s.num_tokens, s.draft_token_ids, s.num_new_drafts) == (0, 5, [], 3)
    assert len(kv.block_tables["r"]) == kv.blocks_needed(5 + 2)  # 2 lookahead slots for the MTP chain
    assert req.spec_token_ids == [7, 7, 7] and req.num_computed_tokens == 5
    assert len(kv.block_tables["r"]) == kv.blocks_needed(5)  # trimmed after the step
    out, _ = step(sched, lambda s: 1)  # [last token + 3 drafts], one accepted
    s = out.scheduled[0]
    assert (s.start, s.num_tokens, len(s.draft_token_ids)) == (5, 4, 3)
    assert req.num_computed_tokens == 5 + 1 + 1 and req.num_tokens == 8
    assert sched.spec_stats.accepted_per_position == [1, 0, 0]
    assert sched.spec_stats.drafts_per_position == [1, 1, 1]


def test_drafts_stop_at_max_tokens_and_max_model_len():
    sched, _ = make(k=3, max_len=12)
    req = Request("r", [1] * 5, SamplingParams(max_tokens=4))
    sched.add_request(req)
    while sched.has_unfinished():
        out, _ = step(sched, lambda s: 99)
        s = out.scheduled[0]
        assert s.start + s.num_tokens + max(s.num_new_drafts - 1, 0) <= 12
    assert req.num_output_tokens == 4
    sched, _ = make(k=3, max_len=9)
    req = Request("q", [1] * 5, SamplingParams(max_tokens=None))
    sched.add_request(req)
    while sched.has_unfinished():
        step(sched, lambda s: 99)
    assert req.num_tokens == 9


def test_token_budget_trims_drafts():
    sched, _ = make(k=3, budget=6)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=30)))
    step(sched, lambda s: 0)
    out = sched.schedule()
    assert out.total_tokens <= 6
    assert [len(s.draft_token_ids) for s in out.scheduled] == [3, 1]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=5), st.integers(1, 3), st.integers(0, 2**16),
       st.integers(9, 24))
def test_blocks_match_computed_tokens_and_all_return(prompt_lens, k, seed, blocks):
    """Random acceptance under a small pool (preemption): after every step each running request holds exactly
    the blocks of its computed tokens, and every block is back at the end."""
    import random
    rnd = random.Random(seed)
    sched, kv = make(k=k, blocks=blocks, block_size=4, max_len=40, budget=16)
    for i, n in enumerate(prompt_lens):
        sched.add_request(Request(f"r{i}", [1] * n, SamplingParams(max_tokens=rnd.randint(1, 15))))
    for _ in range(500):
        if not sched.has_unfinished():
            break
        step(sched, lambda s: rnd.randint(0, k))
        for req in sched.running:
            assert len(kv.block_tables[req.request_id]) == kv.blocks_needed(req.num_computed_tokens)
            assert req.num_computed_tokens <= req.num_tokens
    assert not sched.has_unfinished()
    assert kv.pool.num_free == kv.pool.num_blocks
