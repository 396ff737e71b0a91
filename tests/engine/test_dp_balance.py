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
