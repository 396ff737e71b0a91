"""--enable-elastic-ep (issue 37, stage 1): a DP/EP engine whose rank dies (SIGKILL, or SIGSTOP past
--engine-stall-timeout) goes on with the survivors, and every request finishes with the greedy tokens of an
unfailed run. Real rank processes over gloo, float32, the tiny V3 checkpoint (8 routed experts)."""
import dataclasses
import os
import signal
import threading
import time

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError, ParallelConfig
from moeserve.engine.elastic import survivor_parallel
from moeserve.engine.elastic_placement import keep_map
from moeserve.protocol import EngineCoreRequest

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def elastic_llm(path, dp, **kw):
    return LLM(path, dtype="float32", data_parallel_size=dp, enable_expert_parallel=True, enable_elastic_ep=True,
               num_redundant_experts=-8 % dp, distributed_timeout=60, **kw)


def signal_after_steps(engine, rank: int, sig: int, steps: int) -> threading.Thread:
    """Send `sig` to rank process `rank` once a DP rank has run `steps` steps (LLM.generate runs meanwhile)."""
    pid = engine.ranks.procs[rank].pid

    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and max(s.num_steps for s in list(engine.rank_stats)) < steps:
            time.sleep(0.005)
        os.kill(pid, sig)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def kill_mid_decode(engine, rank, lost: list[str] | None = None, params=GREEDY) -> list[list[int]]:
    """Run PROMPTS through the engine's front end; SIGKILL rank process `rank` once every request has 2 tokens out
    (every rank mid-decode, the killed one's requests included: 8 tokens in all could all be other ranks'; rank may be
    a function of the engine, called once the requests are routed). lost: filled with the ids of the requests
    the killed rank ran."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineCoreRequest(f"r{i}", p, params, [1]))
    rank = rank(engine) if callable(rank) else rank
    ranks = rank if isinstance(rank, tuple) else (rank,)  # several: killed at once
    got = {f"r{i}": [] for i in range(len(PROMPTS))}
    killed = False
    deadline = time.monotonic() + 300
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if not killed and min(map(len, got.values())) >= 2:  # every rank mid-decode
            if lost is not None:
                lost += [rid for rid, dp in engine.router.owner.items() if engine.slots[dp] in ranks]
            for r in ranks:
                os.kill(engine.ranks.procs[r].pid, signal.SIGKILL)
            killed = True
    assert killed and not engine.has_unfinished()
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def test_dp3_loses_a_nonzero_rank_mid_decode_then_a_stopped_one(path, reference):
    llm = elastic_llm(path, 3)
    try:
        engine = llm.engine
        lost: list[str] = []
        assert kill_mid_decode(engine, 1, lost) == reference  # none lost, none changed
        stats = engine.stats()
        assert (engine.dp_size, engine.epoch, stats.elastic_ranks_lost) == (2, 1, 1)
        assert stats.elastic_requeued == len(lost) and stats.elastic_last_recovery_s > 0  # the survivors kept theirs
        # the offline LLM rides through a second loss: a stopped rank is killed after --engine-stall-timeout
        watcher = signal_after_steps(engine, 2, signal.SIGSTOP, engine.stats().num_steps + 3)
        assert generate(llm) == reference
        watcher.join(5)
        assert (engine.dp_size, engine.epoch, engine.stats().elastic_ranks_lost) == (1, 2, 2)
        assert engine.ranks.procs[2].poll() == -signal.SIGKILL
    finally:
        llm.shutdown()


def test_survivors_keep_their_engine_core_and_requests(path, reference):
    # a survivor keeps its engine core (weights, KV pool, prefix cache) and the requests it runs, which go on
    # from their KV: only the lost rank's requests are re-queued and recomputed (prompt + tokens so far). An
    # engine core rebuilt after the loss would hold no request: all 4 re-queued, 4 prompts recomputed
    llm = elastic_llm(path, 3)
    try:
        engine = llm.engine
        lost: list[str] = []
        assert kill_mid_decode(engine, 2, lost) == reference
        stats = engine.stats()
        assert 0 < len(lost) < len(PROMPTS) and stats.elastic_ranks_lost == 1
        assert stats.elastic_requeued == len(lost)
        prompts = sum(len(PROMPTS[int(rid[1:])]) for rid in lost)  # ids are r<index>
        assert prompts < stats.elastic_tokens_recomputed <= prompts + GREEDY.max_tokens * len(lost)
        assert generate(llm) == reference  # and the survivors serve on
    finally:
        llm.shutdown()


def test_a_step_report_read_before_the_recovery_finished_counts(path, reference):
    # regression (31f6248): a lone survivor is ready at once and steps on with the requests it kept, so its
    # first step report of the new epoch may be read in the same poll as its ready report, before
    # _finish_recovery; it was dropped, and its token lost. Here the front end, once it has read the ready
    # report, waits until that step report is queued too: it is always read early
    llm = elastic_llm(path, 2)
    try:
        engine, recv, early = llm.engine, llm.engine._recv, []

        def recv_then_wait():
            report = recv()
            if report is not None and report.ready and engine.recovery is not None:
                assert engine.sock.poll(60_000), "the survivor did not step on with its kept requests"
                early.append(report.dp_rank)
            return report

        engine._recv = recv_then_wait
        lost: list[str] = []
        assert kill_mid_decode(engine, 1, lost) == reference
        assert early == [0] and 0 < engine.stats().elastic_requeued == len(lost) < len(PROMPTS)  # 0 kept some
    finally:
        llm.shutdown()


def test_seeded_requests_continue_exactly_where_kept_and_where_re_queued(path):
    # temperature 1, seeded: a kept request's generator is where its last finished step left it (the
    # interrupted step failed before sampling), a re-queued one's is fast-forwarded past its tokens (issue
    # 31's resume); both end with the tokens of an unfailed single-process engine
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompt_token_ids=PROMPTS,
                                                                                 sampling_params=seeded)]
    llm = elastic_llm(path, 3)
    try:
        lost: list[str] = []
        assert kill_mid_decode(llm.engine, 1, lost, seeded) == want
        assert 0 < llm.engine.stats().elastic_requeued == len(lost) < len(PROMPTS)  # both kinds were there
    finally:
        llm.shutdown()


def test_keep_map_keeps_held_slots_and_spreads_the_lost_experts():
    # 8 experts + 1 replica over 3 ranks (rank r: slots 3r..3r+2), rank 1 lost; 2 survivors of 5 slots each
    assert keep_map([0, 1, 2, 3, 4, 5, 6, 7, 0], 3, [0, 2], 8, 5) == [0, 1, 2, 3, 5, 6, 7, 0, 4, 6]
    # 32 experts over 4 ranks, rank 0 lost: each survivor keeps its 8 and takes 3 (or 2 and a local copy)
    got = keep_map(list(range(32)), 4, [1, 2, 3], 32, 11)
    assert got[:8] == list(range(8, 16)) and got[11:19] == list(range(16, 24)) and got[22:30] == list(range(24, 32))
    assert sorted(set(got)) == list(range(32)) and got[-1] == 24
    # 2 of those 3 survivors, now 4 slots each: a replica held twice gives way so the lost experts fit
    assert keep_map([0, 1, 2, 3, 4, 5, 6, 7, 0], 3, [1, 2], 8, 4) == [3, 4, 5, 1, 6, 7, 0, 2]
    assert keep_map([0, 1, 2, 3, 4, 5, 0, 6, 7], 3, [0, 2], 8, 4) == [1, 2, 3, 4, 0, 6, 7, 5]
    # a replacement (-1) joins the 2 survivors of the first case, 3 slots each: they keep 3 of theirs, it
    # takes the 3 experts left uncovered
    assert keep_map([0, 1, 2, 3, 5, 6, 7, 0, 4, 6], 2, [0, 1, -1], 8, 3) == [0, 1, 2, 6, 7, 0, 3, 4, 5]
    # the spare joins the loss's epoch (D=4, rank 3 lost): the survivors keep all, it takes the lost rank's
    assert keep_map(list(range(32)), 4, [0, 1, 2, -1], 32, 8) == list(range(32))


def test_dp3_loses_a_second_rank_while_re_forming(path, reference):
    # the front end hosts each epoch's rendezvous and the survivors read it while they check in, so rank 0
    # does not wait for the dead rank 2 in epoch 1's rendezvous (--distributed-timeout 120) and the front end
    # does not give up on it (--elastic-ep-timeout 30)
    llm = LLM(path, dtype="float32", data_parallel_size=3, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=1, distributed_timeout=120, elastic_ep_timeout=30)
    try:
        engine = llm.engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineCoreRequest(f"r{i}", p, GREEDY, [1]))
        got = {f"r{i}": [] for i in range(len(PROMPTS))}
        kills = [1, 2]
        deadline = time.monotonic() + 300
        while engine.has_unfinished() and time.monotonic() < deadline:
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            if kills == [1, 2] and sum(map(len, got.values())) >= 8:
                os.kill(engine.ranks.procs[kills.pop(0)].pid, signal.SIGKILL)
            elif kills == [2] and engine.recovery is not None:  # epoch 1 is forming
                os.kill(engine.ranks.procs[kills.pop(0)].pid, signal.SIGKILL)
        assert not kills and not engine.has_unfinished()
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
        assert (engine.dp_size, engine.slots, engine.epoch, engine.stats().elastic_ranks_lost) == (1, [0], 2, 2)
    finally:
        llm.shutdown()


def test_dp4_survivor_away_from_the_dead_rank_leaves_its_step_too(path, reference):
    # gloo's all-gather is a ring: only rank 2's neighbours see its sockets close; rank 0 waits on rank 1 or 3,
    # both alive, until they shut their connections down as they leave
    llm = elastic_llm(path, 4)
    try:
        engine = llm.engine
        assert kill_mid_decode(engine, 2) == reference
        assert (engine.dp_size, engine.slots, engine.stats().elastic_ranks_lost) == (3, [0, 1, 3], 1)
        # a loss while idle: the next request finds it (add_request), waits for the re-formation, then runs
        os.kill(engine.ranks.procs[0].pid, signal.SIGKILL)
        engine.ranks.procs[0].wait(30)
        assert generate(llm) == reference
        assert (engine.dp_size, engine.slots, engine.epoch) == (2, [1, 3], 2)
    finally:
        llm.shutdown()


def test_dp3_with_mtp_and_online_eplb_loses_a_rank(mtp_ckpt_dir):
    # EPLB rebalances every 2 steps (a weight move is in flight across every other step boundary), MTP drafts
    # one token a step: the survivors start both afresh, and the tokens are those of an unfailed engine
    model = mtp_ckpt_dir("v3")
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    want = generate(LLM(model, dtype="float32", speculative_config=mtp))
    llm = elastic_llm(model, 3, speculative_config=mtp, enable_eplb=True, eplb_step_interval=2)
    try:
        assert kill_mid_decode(llm.engine, 1) == want
        stats = llm.engine.stats()
        assert (llm.engine.dp_size, stats.elastic_ranks_lost) == (2, 1) and stats.spec_num_drafts > 0
        assert stats.elastic_requeued < len(PROMPTS)  # the survivors kept their cores, MTP layer included
    finally:
        llm.shutdown()


def test_dp2_loses_rank_0_during_prefill_and_one_survivor_serves(path, reference):
    # 16-token steps: the 41-token prompt prefills over three steps; rank 0 dies after the first
    llm = elastic_llm(path, 2, max_num_batched_tokens=16)
    try:
        engine = llm.engine
        signal_after_steps(engine, 0, signal.SIGKILL, 1)
        assert generate(llm) == reference
        assert (engine.dp_size, engine.slots, engine.stats().elastic_ranks_lost) == (1, [1], 1)
        assert generate(llm) == reference  # the survivor alone serves the next batch too
    finally:
        llm.shutdown()


def test_survivor_layout_tops_up_redundant_slots():
    p = ParallelConfig(data_parallel_size=3, enable_expert_parallel=True, num_redundant_experts=1,
                       enable_eplb=True, enable_elastic_ep=True)
    two = survivor_parallel(p, 8, 2, 1234)
    assert (two.data_parallel_size, two.num_redundant_experts, two.master_port, two.enable_eplb) == (2, 2, 1234, True)
    one = survivor_parallel(p, 8, 1, 1234)
    assert (one.num_redundant_experts, one.enable_eplb, one.enable_elastic_ep) == (1, False, False)
    replacing = survivor_parallel(dataclasses.replace(p, elastic_ep_replace=True), 8, 1, 1234)
    assert not replacing.elastic_ep_replace  # a lone survivor's layout is valid (the front end replaces ranks)


@pytest.mark.parametrize("kw,words", [
    (dict(data_parallel_size=2), "--enable-expert-parallel and --data-parallel-size >= 2"),
    (dict(data_parallel_size=1, enable_expert_parallel=True), "--data-parallel-size >= 2"),
    (dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True), "--tensor-parallel-size > 1"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, shared_expert_ranks=1), "--shared-expert-ranks"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, distributed_backend="nccl"), "--distributed-backend gloo"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, elastic_ep_timeout=0), "--elastic-ep-timeout"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, load_format="dummy"), "--load-format dummy"),
])
def test_refusals_name_the_flag(path, kw, words):
    kw.setdefault("enable_elastic_ep", True)
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32", **kw)
    assert words in str(e.value) and ("--enable-elastic-ep" in str(e.value) or "elastic-ep-timeout" in words)
