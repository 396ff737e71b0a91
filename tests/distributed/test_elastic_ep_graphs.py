"""--enable-elastic-ep without --enforce-eager (issue 37): the compiled decode graphs come back after a loss and
after a replacement joins. The re-formed ranks report ready and serve eagerly at once; every rank of the epoch
then compiles the graphs between steps, one bucket at a time at the same lockstep rounds (elastic_graphs.py); the
front end counts a compile against neither its hang check nor --elastic-ep-timeout. Real rank processes over gloo,
float32 (the graphs give the eager tokens), the tiny V3 checkpoint."""
import re

import pytest

from moeserve.engine.elastic import COMPILING, any_compiling, hung_ranks
from tests.distributed.test_elastic_ep import GREEDY, PROMPTS  # noqa: F401 - what the reference fixture decodes
from tests.distributed.test_elastic_ep import elastic_llm, generate, kill_mid_decode
from tests.distributed.test_elastic_ep_replace import wait_for_full_group

# buckets 1, 2: as few graphs as 4 prompts over 2 or 3 ranks need; no prefix cache, so the router spreads the
# prompts by load alone and every rank decodes some (it would send a prompt back to a rank that cached it)
GRAPHS = dict(max_num_seqs=2, enable_prefix_caching=False)
SERVED = re.compile(r"rank (\d+) of epoch 1: decode graphs back \([^)]*?, (\d+) busy steps served meanwhile")
# non-greedy: two ranks' lines may come run together on one line
COMPILED = re.compile(r"rank (\d+) of epoch (\d+): decode graphs back \([^)]*? compiled in ([\d.]+) s")


@pytest.fixture(autouse=True)
def compile_allowed(monkeypatch):
    monkeypatch.delenv("MOESERVE_ENFORCE_EAGER", raising=False)  # tests/conftest.py makes engines eager
    # direct graph calls (compiled_decode.DirectGraphs) check their entry's guards: the re-formed layers
    # must go through a fresh lookup, never a stale entry
    monkeypatch.setenv("MOESERVE_CHECK_GRAPH_GUARDS", "1")


def graph_steps(engine) -> dict[int, int]:
    """Decode steps through a graph so far, per rank process (its last report)."""
    return {engine.slots[dp]: s.num_graph_steps for dp, s in enumerate(engine.rank_stats)}


def graphs_back(engine, capfd, ranks: int) -> str:
    """The ranks' stderr until `ranks` of them said their decode graphs are all back (the last items may be
    compiled in idle rounds after the requests finished: the idle front end waits for them, 60 s at most)."""
    import time

    err, deadline = "", time.monotonic() + 60
    while True:
        err += capfd.readouterr().err
        if len(COMPILED.findall(err)) >= ranks or time.monotonic() > deadline:
            return err
        engine.step(poll_s=0.1)


def compiles(engine, capfd, ranks: int) -> dict[tuple[int, int], float]:
    """(epoch, rank) -> seconds, of the ranks that compiled their decode graphs in a re-formation."""
    return {(int(e), int(r)): float(s) for r, e, s in COMPILED.findall(graphs_back(engine, capfd, ranks))}


@pytest.mark.parametrize("replace", [False, True], ids=["loss", "loss-and-join"])
def test_graphs_come_back_after_a_loss_and_a_join(path, reference, capfd, replace):
    # D=3, rank 1 SIGKILLed mid-decode: its 2 survivors (and, with --elastic-ep-replace, the spare that joins
    # the loss's epoch) compile their decode graphs between steps once they serve; the kept requests and the
    # re-queued ones finish with the unfailed run's tokens, and so do the requests after, through the graphs
    llm = elastic_llm(path, 3, elastic_ep_replace=replace, **GRAPHS)
    try:
        engine = llm.engine
        assert generate(llm) == reference
        before = graph_steps(engine)
        assert all(n > 0 for n in before.values()), before  # the start-up graphs ran
        capfd.readouterr()
        assert kill_mid_decode(engine, 1) == reference
        if replace:
            wait_for_full_group(engine, 3)
        assert engine.slots == ([0, 2, 3] if replace else [0, 2]) and engine.epoch == 1
        assert generate(llm) == reference
        took = compiles(engine, capfd, len(engine.slots))
        assert sorted(took) == [(1, r) for r in range(len(engine.slots))], took  # every rank of the epoch
        after = graph_steps(engine)
        for slot, n in after.items():  # a survivor's count goes on from before the loss; the replacement's starts
            assert n > before.get(slot, 0), (before, after)
    finally:
        llm.shutdown()


def test_serving_resumes_eagerly_before_the_graphs_come_back(path, reference, capfd):
    # --elastic-ep-graphs eager-first, D=3, rank 1 SIGKILLed mid-decode: the survivors' first GAP_STEPS steps of the new epoch make tokens with no
    # graph (their graph-step counts stand still), then the graphs come back between steps while the requests
    # still run (the counts grow), every rank says so, and the outputs are the unfailed run's
    from moeserve.engine.elastic_graphs import GAP_STEPS

    llm = elastic_llm(path, 3, elastic_ep_graphs="eager-first", **GRAPHS)
    try:
        engine = llm.engine
        seen = []  # (epoch, rank process, steps in its epoch, graph steps, tokens) of every step report
        take = engine._take_report

        def record(report, outputs):
            if report.stats:
                seen.append((engine.epoch, engine.slots[report.dp_rank], report.stats.num_steps,
                             report.stats.num_graph_steps, sum(len(o.new_token_ids) for o in report.outputs)))
            take(report, outputs)

        engine._take_report = record
        capfd.readouterr()
        assert kill_mid_decode(engine, 1) == reference
        assert engine.slots == [0, 2] and engine.epoch == 1
        for slot in (0, 2):
            old = [g for e, s, n, g, _ in seen if e == 0 and s == slot]
            new = [(n, g, t) for e, s, n, g, t in seen if e == 1 and s == slot]
            first = [g for n, g, _ in new if n <= GAP_STEPS]
            assert len(first) == GAP_STEPS and len(set(first)) == 1 and first[0] >= max(old), (old, new)
            assert new[-1][1] > first[0], new  # a decode graph ran before the requests finished
        assert sum(t for e, _, n, _, t in seen if e == 1 and n <= GAP_STEPS) > 0  # tokens before any graph
        assert generate(llm) == reference
        took = compiles(engine, capfd, 2)
        assert sorted(took) == [(1, 0), (1, 1)], took
    finally:
        llm.shutdown()


def test_in_use_first_compiles_the_buckets_in_use_before_the_step(path, reference, capfd):
    # --elastic-ep-graphs in-use-first (the default): the buckets the survivors' decodes need are compiled before
    # the step that needs them, so graph steps count on from the first steps of epoch 1 (eager-first: after 4),
    # and the rest comes between steps while the requests run
    from moeserve.engine.elastic_graphs import GAP_STEPS

    llm = elastic_llm(path, 3, **GRAPHS)
    try:
        engine = llm.engine
        seen = []
        take = engine._take_report

        def record(report, outputs):
            if report.stats:
                seen.append((engine.epoch, engine.slots[report.dp_rank], report.stats.num_steps,
                             report.stats.num_graph_steps))
            take(report, outputs)

        engine._take_report = record
        assert kill_mid_decode(engine, 1) == reference
        grew = []
        for slot in (0, 2):
            first = [g for e, s, n, g in seen if e == 1 and s == slot and n <= GAP_STEPS]
            grew.append(len(first) == GAP_STEPS and first[-1] > first[0])
        assert any(grew), seen
        assert generate(llm) == reference
        served = {int(r): int(n) for r, n in SERVED.findall(graphs_back(engine, capfd, 2))}
        assert sorted(served) == [0, 1] and all(n > 0 for n in served.values()), served  # steps before the last
    finally:
        llm.shutdown()


def test_an_unknown_graphs_mode_is_refused():
    from moeserve.config import ConfigError, ParallelConfig

    with pytest.raises(ConfigError, match="--elastic-ep-graphs must be one of in-use-first, eager-first"):
        ParallelConfig(elastic_ep_graphs="later")


def test_graphs_come_back_with_mtp_and_online_eplb(mtp_ckpt_dir):
    # the MTP proposer's passes go through the new epoch's graphs too (the old ones are dropped with the
    # decode graphs at the loss), EPLB rebalancing every 2 steps around them; the unfailed engine's tokens
    from moeserve import LLM

    model = mtp_ckpt_dir("v3")
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    want = generate(LLM(model, dtype="float32", speculative_config=mtp, **GRAPHS))
    llm = elastic_llm(model, 3, speculative_config=mtp, enable_eplb=True, eplb_step_interval=2, **GRAPHS)
    try:
        engine = llm.engine
        assert kill_mid_decode(engine, 1) == want
        before = graph_steps(engine)
        assert generate(llm) == want
        after = graph_steps(engine)
        assert engine.slots == [0, 2] and all(after[r] > before[r] for r in after), (before, after)
        stats = engine.stats()
        assert stats.spec_num_drafts > 0 and stats.eplb_rebalances > 0
    finally:
        llm.shutdown()


def test_a_compiling_rank_is_neither_hung_nor_timed_out():
    # the hang check names no rank while one compiles (its epoch word carries COMPILING), whatever the counts
    assert hung_ranks({0: (2, 10), 1: (2, 7)}, 2) == [1]
    assert hung_ranks({0: (2, 10), 1: (2 | COMPILING, 7)}, 2) == []
    assert hung_ranks({0: (2 | COMPILING, 10), 1: (2, 7)}, 2) == []

    class Board:
        def __init__(self, words):
            self.words = words

        def read(self, slot):
            return self.words[slot]

    board = Board({0: (2, 10), 3: (2 | COMPILING, 7), 5: (1 | COMPILING, 0)})
    assert any_compiling(board, [0, 3]) and not any_compiling(board, [0]) and not any_compiling(None, [0, 3])


def test_a_re_formation_counts_its_timeout_from_the_compile_s_end():
    # --elastic-ep-timeout 5, the epoch formed 60 s ago: while a rank of it compiles its decode graphs the front
    # end waits on (the timeout counts from now); once none compiles and ranks are still missing, it gives up
    import time
    from types import SimpleNamespace

    from moeserve.engine.elastic_front import ElasticFront

    class Front(ElasticFront):
        def __init__(self, words):
            self.board = SimpleNamespace(read=lambda slot: words[slot])
            self.slots, self.dp_size = [0, 2], 2
            self.sock = SimpleNamespace(poll=lambda ms: False)
            self.config = SimpleNamespace(parallel=SimpleNamespace(elastic_ep_timeout=5.0))
            self.recovery = {"waiting": {1}, "epoch_at": time.monotonic() - 60, "early": []}
            self.failed = []

        def _kill_laggards(self, timeout):
            return False

        def _fail(self, msg):
            self.failed.append(msg)

    front = Front({0: (1, 4), 2: (1 | COMPILING, 3)})
    front._poll_recovery(0)
    assert not front.failed and time.monotonic() - front.recovery["epoch_at"] < 5
    front = Front({0: (1, 4), 2: (1, 3)})
    front._poll_recovery(0)
    assert front.failed and "--elastic-ep-timeout" in front.failed[0]


def test_an_epoch_with_a_replacement_serves_eagerly_first():
    # in-use-first is the default, but not in an epoch where a rank built its core afresh (vote_maps says so on
    # every rank): a replacement's first compile in its process would hold every rank before the first decode
    from types import SimpleNamespace

    from moeserve.engine.elastic_graphs import in_use_first

    parallel = SimpleNamespace(elastic_ep_graphs="in-use-first")
    worker = SimpleNamespace(base_config=SimpleNamespace(parallel=parallel), epoch_builds=False)
    assert in_use_first(worker)
    worker.epoch_builds = True
    assert not in_use_first(worker)
    parallel.elastic_ep_graphs, worker.epoch_builds = "eager-first", False
    assert not in_use_first(worker)
