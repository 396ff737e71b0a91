"""The DP policy shared by the engine's front end/ranks and the planner's simulator."""
from moeserve.engine.dp_balance import MIN_PREFILL_CHUNK, LeastLoadedRouter, prefill_balanced_budget


def test_router_sends_each_request_to_the_least_loaded_rank_and_forgets_what_is_left():
    r = LeastLoadedRouter(3)
    assert [r.assign("a", 100, 50), r.assign("b", 10, 10), r.assign("c", 10, 10)] == [0, 1, 2]
    assert r.assign("d", 1, 1) == 1  # ties go to the lowest rank: 1 and 2 both carry 20
    assert r.load == [150, 22, 20]
    r.progress("a", 40)  # 40 tokens out: 10 still to generate
    assert r.load[0] == 110 and len(r) == 4 and "a" in r
    assert r.forget("a") == 0 and r.load[0] == 0 and "a" not in r  # finished early: its remaining cost leaves
    assert r.assign("e", 5, 5) == 0


def test_budget_evens_out_the_ranks_with_prefill_demand_while_someone_decodes():
    b = prefill_balanced_budget
    assert b([4096], 10, max_tokens=8192, decodes=10) is None  # one rank
    # two of four ranks have prompts: the long one is chunked to their mean, the others do not care
    assert b([3000, 1000, 0, 0], 12, max_tokens=8192, decodes=3) == 3 + 2000
    assert b([10, 20, 0, 0], 1, max_tokens=8192, decodes=0) == MIN_PREFILL_CHUNK
    assert b([40000, 40000], 8, max_tokens=8192, decodes=4) == 8192
    # a lone prompt is not cut to 1/D of itself step after step (max_num_batched_tokens bounds the step)
    assert b([2048, 0, 0, 0, 0, 0, 0, 0], 40, max_tokens=8192, decodes=5) is None
    # nobody decodes: nothing waits for a long prompt, so it is not chunked into extra steps
    assert b([2048, 512], 0, max_tokens=8192, decodes=0) is None


def test_rank_budget_counts_mtp_drafts_so_they_cannot_starve_a_prompt():
    # Two DP ranks, each running 40 decodes with 3 MTP drafts and holding a 100-token prompt: a budget that
    # counted a decode as one token (40 + share 100 = 140) let the drafts take all of it, so the prompt (and
    # 5 decodes) got nothing, step after step. dp_worker passes num_decode_tokens(), drafts included.
    from moeserve.config import SchedulerConfig, SpeculativeConfig
    from moeserve.engine.kv_cache import KVCacheManager
    from moeserve.engine.request import Request
    from moeserve.engine.scheduler import Scheduler
    from moeserve.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096),
                      KVCacheManager(4096, 16), SpeculativeConfig(num_speculative_tokens=3))
    for i in range(40):
        sched.add_request(Request(f"d{i}", [1] * 8, SamplingParams(max_tokens=1000, ignore_eos=True)))
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: [0] for s in out.scheduled},
                             {s.request.request_id: [0] * s.num_new_drafts for s in out.scheduled})
    sched.add_request(Request("p", [1] * 100, SamplingParams(max_tokens=10, ignore_eos=True)))
    assert sched.num_decodes() == 40 and sched.num_decode_tokens() == 160
    demands = [sched.prefill_demand()] * 2  # the other rank is in the same state
    budget = prefill_balanced_budget(demands, 80, 8192, sched.num_decode_tokens())
    picked = {s.request.request_id: s.num_tokens for s in sched.schedule(budget).scheduled}
    assert picked.get("p") == 100 and len(picked) == 41  # every decode and the whole prompt
    starved = prefill_balanced_budget(demands, 80, 8192, sched.num_decodes())  # the old count: 140
    assert starved == 140


def test_router_prefers_the_rank_holding_the_prompt_prefix_by_what_it_saves():
    r = LeastLoadedRouter(2, block_size=4)
    history = list(range(100, 141))  # 41 tokens: 10 whole blocks the engine could share
    assert r.assign("t1", 41, 8, history) == 0
    r.forget("t1")
    r.assign("other", 30, 8, list(range(500, 530)))  # rank 1 now carries 38
    r.forget("other")
    assert r.assign("busy", 20, 5, [9] * 20) == 0  # rank 0: 25 of load
    turn2 = history + [1, 2, 3]
    assert r.assign("t2", 44, 8, turn2) == 0  # 25 - 40 cached < 0: back to its history
    assert r.cost["t2"] == 44 - 40 + 8
    r.assign("heavy", 100, 0, [8] * 100)  # rank 1 (least loaded) gets it...
    r.load[0] += 200  # ... and rank 0 becomes busier than the history is worth
    assert r.assign("t3", 44, 8, turn2) == 1
    # without a block size (prefix caching off) tokens are ignored: plain least-loaded
    plain = LeastLoadedRouter(2)
    plain.load[0] = 1
    assert plain.assign("x", 44, 8, turn2) == 1


def test_router_prefix_memory_is_bounded():
    r = LeastLoadedRouter(1, block_size=1, max_prefix_blocks=8)
    r.assign("a", 30, 1, list(range(30)))
    assert len(r.prefixes[0]) == 8
    # the 8 kept are the prompt's first blocks: eviction took the tail (a chain without its head is useless)
    assert r.prefixes[0].matched(r._hashes(list(range(30)))) == 8
