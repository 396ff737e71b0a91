"""Scheduler and block-pool invariants under hypothesis, with a fake executor (the scheduler has no tensors)."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeserve import SamplingParams
from moeserve.config import SchedulerConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request, RequestStatus
from moeserve.engine.scheduler import RequestRejected, Scheduler

import pytest


def run_to_completion(sched: Scheduler, max_steps: int = 10_000):
    """Drive the scheduler with a deterministic 'model' (next token = f(position)); check budgets each step."""
    cfg, steps = sched.config, 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        assert steps < max_steps, "no progress"
        assert out.total_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        for s in out.scheduled:
            table = sched.kv.block_tables[s.request.request_id]
            assert len(table) * sched.kv.block_size >= s.start + s.num_tokens
        used = sum(len(t) for t in sched.kv.block_tables.values())
        assert used + sched.kv.pool.num_free == sched.kv.pool.num_blocks, "block leaked or double-owned"
        sched.update_from_output(out, {s.request.request_id: [(s.request.num_tokens * 7) % 50 + 2]
                                       for s in out.scheduled if s.samples})
    return steps


requests_strategy = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_strategy, num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 4, 8]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8))
def test_invariants_every_request_finishes(reqs, num_blocks, block_size, budget, max_seqs):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64),
                      KVCacheManager(num_blocks, block_size))
    accepted = []
    for i, (plen, max_tokens) in enumerate(reqs):
        r = Request(str(i), list(range(3, 3 + plen)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        try:
            sched.add_request(r)
            accepted.append(r)
        except RequestRejected:
            assert sched.kv.blocks_needed(plen + max_tokens) > num_blocks
    run_to_completion(sched)
    assert sched.kv.pool.num_free == num_blocks
    for r in accepted:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens


def outputs_of(num_blocks: int, budget: int):
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64),
                      KVCacheManager(num_blocks, 4))
    reqs = [Request(str(i), list(range(5, 5 + 6 + 3 * i)), SamplingParams(max_tokens=10, ignore_eos=True))
            for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    return [r.output_token_ids for r in reqs], sched.num_preemptions


def test_preemption_by_recompute_keeps_outputs():
    big, preemptions_big = outputs_of(num_blocks=100, budget=64)
    small, preemptions_small = outputs_of(num_blocks=8, budget=64)
    assert preemptions_big == 0 and preemptions_small > 0
    assert small == big


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=64), KVCacheManager(64, 4))
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [9]})  # a is now decoding
    sched.add_request(Request("b", list(range(1, 30)), SamplingParams(max_tokens=5)))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert [s.num_tokens for s in out.scheduled] == [1, 3]  # b's prefill chunked to the remaining budget


def test_stop_token_eos_and_ignore_eos():
    def run(params):
        sched = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(64, 4))
        r = Request("r", [1, 2], params, eos_token_ids=[2])
        sched.add_request(r)
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update_from_output(out, {"r": [2 if r.num_output_tokens == 2 else 7]})
        return r

    r = run(SamplingParams(max_tokens=10))
    assert r.output_token_ids == [7, 7, 2] and r.status is RequestStatus.FINISHED_STOPPED
    r = run(SamplingParams(max_tokens=10, ignore_eos=True))
    assert r.num_output_tokens == 10 and r.status is RequestStatus.FINISHED_LENGTH
    r = run(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[7]))
    assert r.output_token_ids == [7] and r.stop_reason == 7


def test_prompt_too_long_and_pool_too_small_are_rejected_clearly():
    sched = Scheduler(SchedulerConfig(max_model_len=16), KVCacheManager(2, 4))
    with pytest.raises(RequestRejected, match="maximum context length is 16"):
        sched.add_request(Request("x", list(range(16)), SamplingParams()))
    with pytest.raises(RequestRejected, match="KV blocks"):
        sched.add_request(Request("y", list(range(8)), SamplingParams(max_tokens=4)))


def test_abort_frees_blocks():
    sched = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(16, 4))
    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=20)))
    sched.update_from_output(sched.schedule(), {"a": [3]})
    assert sched.kv.pool.num_free < 16
    sched.abort(["a"])
    assert sched.kv.pool.num_free == 16 and not sched.has_unfinished()


class FakeKV:
    """The KV tensors, faked: a position's slot holds a digest of the tokens up to it (real KV depends on
    the whole prefix, not only its own token), and the 'model' reads the context back from the blocks. A
    prefix cache that shared the wrong blocks, or a write into a block another request shares, fails."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv, self.slots = kv, {}

    def step(self, out) -> dict[str, list[int]]:
        bs, refs = self.kv.block_size, self.kv.pool._refs
        sampled = {}
        for s in out.scheduled:
            table, req = self.kv.block_tables[s.request.request_id], s.request
            for pos in range(s.start, s.start + s.num_tokens):
                block = table[pos // bs]
                assert refs[block] == 1, "a shared block was written"
                self.slots[(block, pos % bs)] = hash(tuple(req.token_ids_slice(0, pos + 1)))
            if s.samples:
                n = req.num_tokens
                context = [self.slots[(table[p // bs], p % bs)] for p in range(n)]
                assert context == [hash(tuple(req.token_ids_slice(0, p + 1))) for p in range(n)], \
                    "the KV read back is not this request's"
                sampled[req.request_id] = [hash(tuple(context)) % 50 + 2]
        return sampled


def check_refcounts(kv: KVCacheManager) -> None:
    owners = [0] * kv.pool.num_blocks
    for table in list(kv.block_tables.values()) + list(kv.held.values()):
        for b in table:
            owners[b] += 1
    assert owners == kv.pool._refs, "a block's reference count is not its owners"
    assert kv.pool.num_free == owners.count(0)


# A prompt is a few 4-token chunks out of three, plus 0-3 more tokens: equal blocks turn up behind
# different prefixes, which only the chained hash tells apart.
CHUNKS = [[10, 11, 12, 13], [20, 21, 22, 23], [10, 11, 12, 13][::-1]]
shared_prompts = st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=5), st.integers(0, 3),
                                    st.integers(1, 10)), min_size=1, max_size=10)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=shared_prompts, num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(1, 48), next_token=st.booleans())
def test_prefix_caching_shares_only_equal_prefixes(reqs, num_blocks, block_size, budget, next_token):
    """With the cache the outputs (which depend on the KV read back) equal those without it, reference
    counts match the owners at every step, shared blocks are never written, and every block comes back."""
    outputs = {}
    for caching in (False, True):
        kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, hash_next_token=next_token)
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=96), kv)
        fake, accepted = FakeKV(kv), []
        for i, (chunks, extra, max_tokens) in enumerate(reqs):
            prompt = [t for c in chunks for t in CHUNKS[c]] + [7] * extra
            r = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            try:
                sched.add_request(r)
                accepted.append(r)
            except RequestRejected:
                pass
        steps = 0
        while sched.has_unfinished():
            out = sched.schedule()
            steps += 1
            assert steps < 5000, "no progress"
            sched.update_from_output(out, fake.step(out))
            check_refcounts(kv)
        assert kv.pool.num_free == num_blocks and not kv.block_tables
        outputs[caching] = [r.output_token_ids for r in accepted]
    assert outputs[True] == outputs[False]
