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


def test_budget_is_an_even_share_of_prefill_only_while_someone_decodes():
    assert prefill_balanced_budget(4096, 10, dp_size=1, max_tokens=8192, decodes=10) is None  # one rank
    assert prefill_balanced_budget(4096, 12, dp_size=4, max_tokens=8192, decodes=3) == 3 + 1024
    assert prefill_balanced_budget(10, 1, dp_size=4, max_tokens=8192, decodes=0) == MIN_PREFILL_CHUNK
    assert prefill_balanced_budget(40000, 8, dp_size=2, max_tokens=8192, decodes=4) == 8192
    # nobody decodes: nothing waits for a long prompt, so it is not chunked into extra steps
    assert prefill_balanced_budget(2048, 0, dp_size=8, max_tokens=8192, decodes=0) is None
