"""Elastic expert parallelism (issue 37): how long from a rank's SIGKILL to the next token, and what it costs.

An offline engine of --dp ranks (expert parallelism, --enable-elastic-ep, gloo, float32) runs --requests greedy
requests of --new-tokens twice: once unfailed (the reference), once with --kills SIGKILLs of rank processes
(the highest-numbered live one, or --victim first), each once every unfinished request has --before more
tokens. Per kill it prints seconds from the kill until the front end began the re-formation (loss seen),
until the survivors served again (re-formed, every unfinished request re-queued), until the next token of
any request, and until every unfinished request had a token again; the requests re-queued and the tokens
(prompt + output so far) they recompute, and of those the tokens the ranks' prefix caches served (cache hits:
a survivor that kept its engine core finds its own requests' blocks there; the reference run's prompts count
too, as the failed run repeats them). Without --enforce-eager also the seconds from the kill until a rank's
count of decode steps through a compiled graph first grew in the new epoch (first graph step: the re-formed
ranks serve eagerly first and compile their graphs between steps, engine/elastic_graphs.py) and until the last
rank of the epoch said its graphs are all back (after the run it waits for them, stepping idle); --graphs
(--elastic-ep-graphs): in-use-first (the default) compiles a bucket before the step whose decodes need it,
eager-first decodes eagerly until the bucket's turn. Last:
requests lost and whether every output equals the reference.
The model is benchmarks/dp_ep.py's shrunk bench config (32 routed experts) unless --bench-model.

With --replace (--elastic-ep-replace) the front end starts a replacement per lost rank once the survivors
serve; after the failed run it prints the seconds from the last kill until the full group served again, then
runs the requests once more and prints their tok/s against the unfailed run's (a second unfailed run, so both
are warm) and whether the outputs are the reference's.

With --hang spin|block the first victim is not killed but hangs (the testing-only fault hook
MOESERVE_TEST_ELASTIC_HANG, triggered by a file the benchmark creates at that moment): its columns count from
the hang, so "loss seen" is --hang-timeout (--elastic-ep-hang-timeout) plus the check's granularity.

    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 2
    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 1 --replace
    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 1 --hang spin --hang-timeout 5

Last it prints how each rank that joined an epoch filled its expert slots, from the rank processes' join lines
(their stderr passes through the benchmark): slots kept (an expert the rank held), received from peers
(engine/elastic_transfer.py), from the host copy (--host-copy: engine/elastic_host_copy.py), checkpoint
tensors read; a replacement (--replace) the same for the core it built (engine/elastic_replace.py: received
from the survivors, from the host copy, checkpoint expert tensors read). --redundant sets
--num-redundant-experts (replicas let survivors hold a lost rank's experts); --default-layout makes rank 0
vote other expert maps (the testing hook MOESERVE_TEST_ELASTIC_HANG=0:0:other-maps, as after a loss
mid-re-formation), so the survivors re-place onto the default layout, where most slots are filled from peers;
--quantization a8w8 quantizes the experts (and linears):

    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 1 --redundant 8 --default-layout
    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 1 --quantization a8w8
    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 2 --host-copy
    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 1 --replace --redundant 32
    PYTHONPATH=. python benchmarks/elastic_ep.py --dp 4 --kills 1 --replace --host-copy
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import BENCH_CONFIG, bench_checkpoint  # noqa: E402
from benchmarks.dp_ep import SHRUNK  # noqa: E402


def run(engine, prompts, params, kills: list[int], before: int,
        hang_file: str | None = None) -> tuple[dict, list[dict]]:
    """Each request's tokens, and one timing record per kill (hang_file: the first victim hangs instead: the
    file that triggers it)."""
    from moeserve.protocol import EngineCoreRequest

    tag = f"k{len(kills)}-"
    for i, p in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"{tag}{i}", p, params, [1]))
    got = {f"{tag}{i}": [] for i in range(len(prompts))}
    records, pending = [], list(kills)
    mark = dict.fromkeys(got, 0)  # tokens of each request at the last kill
    rec = None
    full = len(engine.slots)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.monotonic()
        if records and "full" not in records[-1] and _full(engine, full):
            records[-1]["full"] = now  # --replace: the replacement joined while requests ran
        for out in outs:
            got[out.request_id] += out.new_token_ids
        for r in records + ([rec] if rec is not None else []):  # the first decode step through a graph again
            if "graph" not in r:
                _first_graph_step(engine, r, now)
        if rec is not None:
            if "seen" not in rec and engine.epoch > rec["epoch"]:
                rec["seen"] = now
            if "ready" not in rec and engine.epoch > rec["epoch"] and engine.recovery is None:
                rec["ready"], rec["ranks"] = now, len(engine.slots)
                rec["new_epoch"] = engine.epoch
            if "ready" in rec and outs and "token" not in rec:
                rec["token"] = now
            if "token" in rec and all(len(got[r]) > mark[r] or len(got[r]) == params.max_tokens for r in got):
                rec["all"] = now
                stats = engine.stats()
                rec["requeued"] = stats.elastic_requeued - rec["requeued0"]
                rec["recomputed"] = stats.elastic_tokens_recomputed - rec["recomputed0"]
                rec["hits"] = sum(_hits_since(engine, rec["hits0"]).values())
                records.append(rec)
                rec = None
                mark = {r: len(t) for r, t in got.items()}  # the next kill waits for --before more tokens
        elif pending and all(len(t) - mark[r] >= before or len(t) == params.max_tokens for r, t in got.items()):
            victim = pending.pop(0)
            stats = engine.stats()
            ran = {r.split("-", 1)[1] for r, dp in engine.router.owner.items() if engine.slots[dp] == victim}
            rec = {"victim": victim, "ran": ran, "epoch": engine.epoch, "requeued0": stats.elastic_requeued,
                   "recomputed0": stats.elastic_tokens_recomputed, "kill": time.monotonic(),
                   "hits0": _hits_since(engine, {}), "g0": {},
                   "prev": {engine.slots[dp]: s.num_steps for dp, s in enumerate(engine.rank_stats)}}
            mark = {r: len(t) for r, t in got.items()}
            if hang_file:
                open(hang_file, "w").close()  # its next step hangs
                hang_file = None
            else:
                os.kill(engine.ranks.procs[victim].pid, signal.SIGKILL)
    return {r.split("-", 1)[1]: t for r, t in got.items()}, records


def _first_graph_step(engine, rec: dict, now: float) -> None:
    """Notes in rec["graph"] when a rank's count of decode steps through a compiled graph grew in the new
    epoch. A rank's step count starts again in each epoch, so its first report there is the first whose count
    is below the one before (rec["prev"]: from the kill on; a replacement's reports are all new). That first
    report's graph count (carried over from before the loss) is the base: with --graphs eager-first its steps
    are eager ones (elastic_graphs.GAP_STEPS); with in-use-first (the default) it may be a graph step
    already, noted one step late."""
    for dp, s in enumerate(engine.rank_stats):
        slot = engine.slots[dp]
        if slot not in rec["g0"]:
            if not s.num_steps:
                continue  # no report yet (the front end's placeholder of a new epoch)
            if slot in rec["prev"] and s.num_steps >= rec["prev"][slot]:
                rec["prev"][slot] = s.num_steps
                continue  # still its reports of the old epoch
            rec["g0"][slot] = s.num_graph_steps
        if s.num_graph_steps > rec["g0"][slot]:
            rec["graph"] = now


def _hits_since(engine, before: dict[int, int]) -> dict[int, int]:
    """Prefix-cache hits (tokens) of each rank process since `before` (its counts then): a rank that rebuilt
    its engine core counts from 0 again."""
    now = {engine.slots[dp]: s.prefix_cache_hits for dp, s in enumerate(engine.rank_stats)}
    return {r: n - before.get(r, 0) if n >= before.get(r, 0) else n for r, n in now.items()}


class JoinLog:
    """fd 2 through a pipe (the rank processes inherit it): every line goes on to the real stderr, the ranks'
    join lines ("joined epoch ...": how each filled its expert slots) are kept."""

    LINE = re.compile(r"joined epoch (\d+) as rank (\d+) of \d+ in ([\d.]+) s and (.*)$")
    GRAPHS = re.compile(r"rank (\d+) of epoch (\d+): decode graphs back")

    def __init__(self) -> None:
        r, w = os.pipe()
        self.out = os.dup(2)
        os.dup2(w, 2)
        os.close(w)
        self.joins: list[tuple[int, int, float, str]] = []
        self.graphs_back: dict[int, list[float]] = {}  # epoch -> when each of its ranks said its graphs are back
        threading.Thread(target=self._pump, args=(r,), daemon=True).start()

    def _pump(self, r: int) -> None:
        with os.fdopen(r, "rb") as f:
            for line in f:
                os.write(self.out, line)
                text = line.decode(errors="replace").rstrip()
                if (m := self.LINE.search(text)) is not None:
                    self.joins.append((int(m[1]), int(m[2]), float(m[3]), m[4]))
                for m in self.GRAPHS.finditer(text):  # ranks' lines may come run together
                    self.graphs_back.setdefault(int(m[2]), []).append(time.monotonic())


def _full(engine, size: int) -> bool:
    return len(engine.slots) == size and engine.recovery is None and not engine.joining


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--victim", type=int, default=None, help="rank killed first (default: the last one)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--before", type=int, default=8, help="tokens every request has before each kill")
    ap.add_argument("--bench-model", action="store_true", help="the full bench config (64 experts, ~475M)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--hang", choices=("spin", "block"), default=None,
                    help="the first victim hangs (busy loop / blocked) instead of being killed")
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="--elastic-ep-hang-timeout with --hang")
    ap.add_argument("--replace", action="store_true", help="--elastic-ep-replace: a replacement rank joins; "
                    "tok/s before the loss and after the join")
    ap.add_argument("--redundant", type=int, default=None, help="--num-redundant-experts (default: the fewest "
                    "that divide over --dp)")
    ap.add_argument("--host-copy", action="store_true", help="--elastic-ep-host-copy: lost experts come from "
                    "the ranks' host shared-memory files, not the checkpoint")
    ap.add_argument("--quantization", default=None, help="e.g. a8w8: quantized experts (survivors keep them)")
    ap.add_argument("--graphs", default="in-use-first", choices=("in-use-first", "eager-first"),
                    help="--elastic-ep-graphs: how the re-formed ranks' decode graphs come back")
    ap.add_argument("--default-layout", action="store_true", help="the survivors re-place onto the default "
                    "layout (rank 0 votes other maps: a testing hook), filling slots from peers")
    a = ap.parse_args()
    if a.kills >= a.dp:
        ap.error(f"--kills {a.kills} leaves no survivor of --dp {a.dp}")
    if a.default_layout and a.hang:
        ap.error("--default-layout and --hang both use the testing hook MOESERVE_TEST_ELASTIC_HANG")
    if a.default_layout:
        os.environ["MOESERVE_TEST_ELASTIC_HANG"] = "0:0:other-maps"  # the rank processes inherit it
    log = JoinLog()

    from moeserve import LLM, SamplingParams

    hang_file = None
    if a.hang:
        import tempfile

        hang_file = os.path.join(tempfile.mkdtemp(prefix="elastic-hang-"), "go")
        first = a.victim if a.victim is not None else a.dp - 1
        os.environ["MOESERVE_TEST_ELASTIC_HANG"] = f"{first}:@{hang_file}:{a.hang}"  # the rank processes inherit it
    config = BENCH_CONFIG if a.bench_model else SHRUNK
    path = bench_checkpoint(config=config)
    experts = config["n_routed_experts"]
    started = time.monotonic()
    llm = LLM(path, dtype="float32", data_parallel_size=a.dp, enable_expert_parallel=True, enable_elastic_ep=True,
              num_redundant_experts=-experts % a.dp if a.redundant is None else a.redundant,
              enforce_eager=a.enforce_eager, distributed_timeout=300,
              max_model_len=a.prompt_len + a.new_tokens + 8, elastic_ep_replace=a.replace,
              elastic_ep_hang_timeout=a.hang_timeout, quantization=a.quantization, elastic_ep_host_copy=a.host_copy,
              elastic_ep_graphs=a.graphs)
    print(f"DP={a.dp} EP, {experts} routed experts, float32{', ' + a.quantization if a.quantization else ''}, "
          f"gloo; started in {time.monotonic() - started:.1f} s",
          flush=True)
    engine = llm.engine
    vocab = config["vocab_size"]
    prompts = [[(17 * i + 31 * j) % (vocab - 2) + 2 for j in range(a.prompt_len)] for i in range(a.requests)]
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    tok_s = {}
    try:
        want, _ = run(engine, prompts, params, [], a.before)
        if a.replace:
            t0 = time.monotonic()
            run(engine, prompts, params, [], a.before)
            tok_s["before"] = a.requests * a.new_tokens / (time.monotonic() - t0)
        live = sorted(engine.slots, reverse=True)
        victims = ([a.victim] if a.victim is not None else []) + [r for r in live if r != a.victim]
        got, records = run(engine, prompts, params, victims[:a.kills], a.before, hang_file)
        wait_graphs = time.monotonic() + 120  # the last epoch's graphs, compiled between (idle) steps
        while (not a.enforce_eager and records and len(log.graphs_back.get(engine.epoch, [])) < len(engine.slots)
               and time.monotonic() < wait_graphs):
            engine.step(poll_s=0.1)
        if a.replace:
            deadline = time.monotonic() + 600
            while not _full(engine, a.dp) and time.monotonic() < deadline:
                engine.step(poll_s=0.1)
            joined = records[-1].get("full", time.monotonic()) - records[-1]["kill"]
            t0 = time.monotonic()
            again, _ = run(engine, prompts, params, [], a.before)
            tok_s["after"] = a.requests * a.new_tokens / (time.monotonic() - t0)
    finally:
        llm.shutdown()
        if a.hang:
            import shutil

            shutil.rmtree(os.path.dirname(hang_file), ignore_errors=True)
    if a.hang:
        print(f"kill 1 is a hang ({a.hang}; the hang check killed rank(s) {engine.hung_killed})")
    print("kill  rank  ranks after  loss seen s  serving again s  next token s  all resumed s  requeued  recomputed"
          "  cache hits  first graph step s  graphs back s")
    for k, r in enumerate(records, 1):
        first = f"{r['graph'] - r['kill']:18.2f}" if "graph" in r else f"{'-':>18}"
        back = log.graphs_back.get(r["new_epoch"], [])
        back = f"{max(back) - r['kill']:13.2f}" if len(back) >= r["ranks"] else f"{'-':>13}"
        print(f"{k:4d}  {r['victim']:4d}  {r['ranks']:11d}  {r['seen'] - r['kill']:11.2f}  {r['ready'] - r['kill']:15.2f}"
              f"  {r['token'] - r['kill']:12.2f}  {r['all'] - r['kill']:13.2f}  {r['requeued']:8d}  {r['recomputed']:10d}"
              f"  {r['hits']:10d}  {first}  {back}")
    lost = sum(len(got.get(k, [])) != a.new_tokens for k in want)
    same = sum(got.get(k) == t for k, t in want.items())
    print(f"requests: {len(want)}, lost {lost}, outputs identical to the unfailed run: {same}/{len(want)}")
    if same < len(want):  # which differ, and whether they ran on a lost rank (re-queued: recomputed)
        ran = set().union(*(r["ran"] for r in records))
        print("  differing: " + ", ".join(f"{k}{' (lost rank)' if k in ran else ''}" for k, t in want.items()
                                          if got.get(k) != t))
    time.sleep(0.2)  # the last join lines through the pipe
    print("epoch  rank  join s  expert slots")
    for epoch, rank, took, how in sorted(log.joins):
        print(f"{epoch:5d}  {rank:4d}  {took:6.1f}  {how}")
    if a.replace:
        same = sum(again.get(k) == t for k, t in want.items())
        print(f"replacement: {engine.dp_size} ranks serve again {joined:.1f} s after the last kill "
              f"(ranks {engine.slots}); tok/s unfailed {tok_s['before']:.1f}, after the join {tok_s['after']:.1f} "
              f"(x{tok_s['after'] / tok_s['before']:.2f}); outputs identical: {same}/{len(want)}")


if __name__ == "__main__":
    main()
