"""Multi-rank engines (rank processes over gloo, float32) give the single-process engine's greedy tokens.

Each test starts real rank processes; one engine per layout is shared by the scenarios that need it.
"""
import json
import os
import signal
import time

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.engine.dp_client import EngineDeadError
from moeserve.protocol import EngineCoreRequest

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11]]
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def dp2(path):
    # 16-token steps: the 41-token prompt prefills in chunks on one rank while the other rank decodes.
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              max_num_batched_tokens=16, distributed_timeout=30)
    yield llm
    llm.shutdown()


def test_dp2_ep_alltoall_matches_single_process(dp2, reference):
    assert tokens(dp2) == reference
    stats = dp2.engine.stats()
    assert stats.comm_bytes["alltoall"] > 0 and stats.phase_seconds["experts"] > 0
    assert set(stats.phase_seconds) >= {"attention", "router", "dispatch", "experts", "combine", "shared_experts"}


def test_dp2_rank_with_no_requests_runs_empty_steps(dp2, reference):
    before = dp2.engine.stats().num_dummy_steps
    assert tokens(dp2, [PROMPTS[1]]) == [reference[1]]  # one request: the other DP rank has none
    # The idle rank's reports of its last steps may still be in flight; most have arrived.
    assert dp2.engine.stats().num_dummy_steps >= before + NEW // 2


def test_dp2_chunked_prefill_on_one_rank_while_the_other_decodes(dp2, reference):
    engine = dp2.engine
    # The short request lands on the idle rank first; the long one goes to the other (least outstanding).
    got = run_requests(engine, [(0, 1), (1, 2)], {})
    assert got == {"r1": reference[1], "r2": reference[2]}


def test_dp2_uneven_arrivals(dp2, reference):
    # Requests join while others are mid-decode: arrival step -> prompt index.
    got = run_requests(dp2.engine, [(0, 0), (3, 2), (5, 1), (9, 3)], {})
    assert got == {f"r{i}": reference[i] for i in range(4)}


def test_dp2_structured_output_matches_single_process(dp2, path):
    # each rank compiles the grammars of its own requests; masks must not depend on the rank
    from moeserve.structured.params import StructuredOutputsParams as SO
    specs = [SO(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                      "required": ["b"]}), SO(regex=r"[a-f]{2,6}-\d{2}"), SO(choice=["yes", "no"]), SO(json_object=True)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in specs for _ in PROMPTS]
    prompts = PROMPTS * len(specs)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompt_token_ids=prompts,
                                                                               sampling_params=params)]
    assert [o.outputs[0].token_ids for o in dp2.generate(prompt_token_ids=prompts, sampling_params=params)] == want


def run_requests(engine, arrivals, owners):
    """Feed (step, prompt index) arrivals through the EngineCore-shaped interface; collect tokens."""
    out, step, pending = {}, 0, sorted(arrivals)
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            engine.add_request(EngineCoreRequest(f"r{i}", PROMPTS[i], GREEDY, [1]))
            owners[f"r{i}"] = engine.router.owner[f"r{i}"]
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert len(set(owners.values())) == 2, owners  # both DP ranks got work
    return out


@pytest.mark.parametrize("layout", [
    dict(data_parallel_size=4, enable_expert_parallel=True),
    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
    dict(data_parallel_size=2, enable_expert_parallel=True, moe_comm="allgather", num_redundant_experts=2),
    dict(data_parallel_size=2),  # experts TP-sharded over both ranks, allgather/reduce-scatter
], ids=["dp4-ep", "dp2-tp2-ep", "dp2-ep-allgather-redundant", "dp2-tp-sharded-experts"])
def test_layouts_match_single_process(path, reference, layout):
    llm = LLM(path, dtype="float32", distributed_timeout=30, **layout)
    try:
        assert tokens(llm) == reference
    finally:
        llm.shutdown()


def test_ranks_get_the_whole_engine_config_int8_included(path):
    """Every rank runs the engine the flags describe (here A8W8), not just its parallel layout."""
    want = tokens(LLM(path, dtype="float32", quantization="a8w8"), PROMPTS[:2])
    llm = LLM(path, dtype="float32", quantization="a8w8", data_parallel_size=2, enable_expert_parallel=True)
    try:
        assert tokens(llm, PROMPTS[:2]) == want
    finally:
        llm.shutdown()


def test_single_process_redundant_experts_and_placement_file(path, reference, tmp_path):
    assert tokens(LLM(path, dtype="float32", num_redundant_experts=2)) == reference
    f = tmp_path / "placement.json"
    f.write_text(json.dumps({"default": [7, 6, 5, 4, 3, 2, 1, 0, 0, 7]}))
    assert tokens(LLM(path, dtype="float32", expert_placement=str(f))) == reference


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel_size=2, moe_comm="alltoall"), "--enable-expert-parallel"),
    (dict(data_parallel_size=2, num_redundant_experts=2), "--enable-expert-parallel"),
    (dict(tensor_parallel_size=3), "--tensor-parallel-size 3"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=1), "--num-redundant-experts"),
    (dict(data_parallel_size=3, enable_expert_parallel=True), "do not spread evenly"),
])
def test_bad_layouts_are_refused_before_starting_ranks(path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(path, dtype="float32", **kwargs)


@pytest.mark.parametrize("placement, message", [
    ({"default": [0, 1, 2, 3, 4, 5, 6, 6]}, r"expert\(s\) \[7\] have no physical slot"),
    ({"default": [0, 1, 2, 3, 4, 5, 6, 7, 0]}, "not divisible over 2 EP ranks"),
    ({"default": [0, 1, 2, 3, 4, 5, 6, 9]}, "expert id 9"),
    ({"default": [0, 1, 2, 3, 4, 5, 6, True]}, "expert id True"),
    # malformed files name the flag, the file and what is wrong (not "'int' object is not iterable")
    ({"default": 5}, r'--expert-placement \S+p\.json: "default" must be a list of logical expert ids'),
    ({"layers": {"abc": list(range(8))}}, r"--expert-placement \S+p\.json: layer key 'abc' is not a decoder "
                                           "layer number"),
    ({"layers": {"1": {"0": 1}}}, r"--expert-placement \S+p\.json: layer 1 must be a list"),
    ({"layers": [list(range(8))]}, r'--expert-placement \S+p\.json: "layers" must be an object'),
])
def test_invalid_placement_files_are_refused(path, tmp_path, placement, message):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(placement))
    with pytest.raises(ConfigError, match=message):
        LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, expert_placement=str(f))


def test_killed_rank_stops_the_engine_with_an_error_naming_it(path):
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, distributed_timeout=20)
    try:
        engine = llm.engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineCoreRequest(f"k{i}", p, SamplingParams(temperature=0, max_tokens=400,
                                                                            ignore_eos=True), [1]))
        while not engine.step():
            pass
        victim = engine.ranks.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 \(dp 1, tp 0\) was killed by signal SIGKILL"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 20
        engine.ranks.join(timeout=15)
        assert all(code is not None for code in engine.ranks.dead().values()) and len(engine.ranks.dead()) == 2
    finally:
        llm.shutdown()


def test_two_nodes_by_flags_generate_like_one_process(path):
    """Two `moeserve generate` commands as node 0 and node 1 (--nnodes/--node-rank/--master-*)."""
    import subprocess
    import sys

    from moeserve.netif import free_port

    port = free_port()
    gen = [sys.executable, "-m", "moeserve.cli", "generate", "--model", path, "--dtype", "float32",
           "--max-tokens", "8", "--ignore-eos", "--prompt", "def f(x):"]
    base = gen + ["--data-parallel-size", "2", "--enable-expert-parallel", "--nnodes", "2", "--master-addr",
                  "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen(base + ["--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    node0 = subprocess.run(base + ["--node-rank", "0"], capture_output=True, text=True, timeout=150)
    rc1 = node1.wait(timeout=120)
    single = subprocess.run(gen, capture_output=True, text=True, timeout=150)
    assert node0.returncode == 0 and rc1 == 0, node0.stderr[-2000:]
    text = [line for line in node0.stdout.splitlines() if not line.startswith("---")]
    assert text and text == [line for line in single.stdout.splitlines() if not line.startswith("---")]


def test_dp2_lone_prompt_is_not_chunked_when_nobody_decodes(path):
    """The even prefill share (dp_balance.py) protects decodes; with none anywhere it would only add steps."""
    long_prompt = list(range(20, 100))  # 80 tokens: an even share would be 40 per rank, two steps
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    single = LLM(path, dtype="float32", max_num_batched_tokens=128)
    want = single.generate(prompt_token_ids=[long_prompt], sampling_params=one)[0].outputs[0].token_ids
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              max_num_batched_tokens=128, distributed_timeout=30)
    try:
        before = llm.engine.stats().num_steps
        got = llm.generate(prompt_token_ids=[long_prompt], sampling_params=one)[0].outputs[0].token_ids
        assert got == want
        assert llm.engine.stats().num_steps == before + 1  # the whole prompt in one step
    finally:
        llm.shutdown()


def test_dp2_sends_a_chat_turn_back_to_the_rank_holding_its_history(path):
    """Each DP rank has its own prefix cache: turn 2 of conversation A goes to A's rank (1 here), where its
    history is cached, though plain least-loaded routing would pick rank 0 (a tie); same tokens either way."""
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, block_size=4,
              distributed_timeout=30)
    try:
        conv_b, conv_a = list(range(300, 341)), list(range(100, 141))
        first = llm.generate(prompt_token_ids=[conv_b, conv_a], sampling_params=GREEDY)  # B -> rank 0, A -> 1
        turn2 = conv_a + first[1].outputs[0].token_ids + [7, 8, 9]
        out = llm.generate(prompt_token_ids=[turn2], sampling_params=GREEDY)[0]
        assert out.num_cached_tokens >= 40  # A's 41-token prompt, in whole blocks, at least
        single = LLM(path, dtype="float32", enable_prefix_caching=False)
        assert out.outputs[0].token_ids == tokens(single, [turn2])[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [dict(), dict(moe_comm="allgather", quantization="a8w8",
                                              speculative_config={"method": "mtp", "num_speculative_tokens": 1})],
                         ids=["alltoall", "allgather-a8w8-mtp"])
def test_online_eplb_moves_experts_and_changes_no_token(path, mtp_ckpt_dir, kw):
    """--enable-eplb rebalancing every 2 steps: expert weights (INT8 scales too, the MTP layer's block too)
    really move between the ranks, and the tokens equal a run that never rebalances."""
    model = mtp_ckpt_dir("v3") if "speculative_config" in kw else path
    base = dict(dtype="float32", data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2,
                distributed_timeout=30, **kw)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fixed = LLM(model, **base)
    try:
        want = [o.outputs[0].token_ids for o in fixed.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    finally:
        fixed.shutdown()
    llm = LLM(model, enable_eplb=True, eplb_step_interval=2, **base)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert got == want
    assert stats.eplb_rebalances >= 4 and stats.eplb_experts_moved > 0


def test_online_eplb_flags_are_checked(path):
    with pytest.raises(ConfigError, match="--enable-eplb"):
        LLM(path, enable_eplb=True)  # one rank: nothing to move
    with pytest.raises(ConfigError, match="--eplb-step-interval"):
        LLM(path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_step_interval=0)


def test_dp2_slo_admission_routes_by_predicted_ttft_and_counts_every_request(path, reference):
    # loose targets: nothing is turned away, so the tokens are the single process's; every rank's
    # admission counts its requests and reports a TTFT prediction the router compares
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              slo_ttft_ms=600000, slo_tpot_ms=600000, distributed_timeout=30)
    try:
        assert tokens(llm) == reference
        st = llm.engine.stats()
        assert st.slo_requests == st.slo_met == len(PROMPTS) and st.slo_rejected == 0
        assert all(s.slo_ttft_estimate_s > 0 for s in llm.engine.rank_stats)
    finally:
        llm.shutdown()
