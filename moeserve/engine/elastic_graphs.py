"""Elastic EP (engine/elastic.py has the lifecycle), the end of step 4: a re-formed epoch serves at once, and its
compiled decode graphs come back while it serves, one piece at a time between steps.

The old epoch's graphs are dropped at the loss (elastic_placement.roll_back: traced over the old process groups),
and so are the prefill kernels (INT8 quantizer, expert epilogue: park_prefill_kernels; torch._dynamo.reset() has
dropped their compiled code, and their first use would compile them in the middle of a step). Every rank of the
new epoch (survivors and a replacement) then reports ready with a LateGraphs: a CompiledDecode with no bucket
compiled yet, whose applies() takes only the buckets compiled so far: a step of another size runs eagerly.
Eager and compiled forwards issue the same collectives (a MoE block is an opaque op in a graph that calls the
eager dispatch: layers/opaque.py), so ranks can mix them within one step, as they do whenever one prefills while
another decodes.

What does need all ranks at once is compiling: a bucket is compiled by a forward of padding rows (as at start-up,
CompiledDecode.warm_up), whose MoE layers run the epoch's collectives, and while one rank compiles the others
wait for it in their next collective. So the ranks compile together, one item at a time (a bucket, or the
prefill kernels), between two steps (between_steps(), called by dp_worker after the step's all-gather), and
agree without a message: the decision reads only what every rank of the epoch has alike, the all-gathered
step flags and the count of lockstep rounds since the epoch began or since its last compile:
- --elastic-ep-graphs in-use-first (the default): every pending bucket that a rank's decodes (the flags' decode
  counts, times 1 + MTP drafts) fall in, before this round's step, so no decode step of a bucket's size runs
  eagerly: serving pauses for the buckets in use at the epoch's first step and whenever a new one comes in use
  (A8W8's eager and compiled decode round differently: so kept A8W8 requests change tokens less often); not in
  an epoch where a rank built its core afresh (a replacement: in_use_first());
- nobody has work: the next item now (the ranks are idle; a request that arrives waits at most one item);
- else once GAP_STEPS busy steps have run since the epoch began or since the last compile: the next item (a
  compile stalls serving for one item, never for all of them).
The next item: the pending bucket that the most ranks' decodes fall in (ties: the larger), else the prefill
kernels, else the smallest pending bucket. With --elastic-ep-graphs eager-first only the last two rules apply:
the first steps go out at once, decoding eagerly until their bucket's turn.
While a rank compiles, its ProgressBoard slot says COMPILING (elastic.compiling(): the hang check names no
rank). When the last item is compiled each rank prints one line ("decode graphs back ...":
benchmarks/elastic_ep.py times it).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from moeserve.engine.compiled_decode import CompiledDecode, decode_graph_tokens, warm_up_prefill_kernels
from moeserve.stderr_line import stderr_line

logger = logging.getLogger(__name__)

GAP_STEPS = 4  # busy steps served between two compiles (and before the first)
PREFILL = "prefill kernels"  # the pending item that compiles the INT8 quantizer and the expert epilogue


class LateGraphs(CompiledDecode):
    """A re-formed epoch's decode graphs, compiled bucket by bucket while it serves (compile_next())."""

    def __init__(self, runner, started: float) -> None:
        self.per_seq, max_tokens = decode_graph_tokens(runner.config)
        super().__init__(runner.model, max_tokens, runner.config.model.decode_graph_sizes)
        self.runner = runner
        self.ready: set[int] = set()  # buckets compiled: decode steps of these sizes run through their graphs
        self.pending: list = list(self.buckets) + [PREFILL]
        self.busy_steps = 0  # busy lockstep rounds since the epoch began or since the last compile
        self.started = started  # when the rank began joining the epoch (for its "decode graphs back" line)
        self.rounds = 0  # busy rounds until the last item (the line's)
        self.compile_total = 0.0  # seconds spent compiling items

    def applies(self, meta, num_tokens: int) -> bool:
        return super().applies(meta, num_tokens) and self.bucket(num_tokens) in self.ready

    def in_use(self, decodes: list[int]) -> dict[int, int]:
        """Pending buckets that ranks' decodes fall in -> how many ranks (decodes: every rank's decode count, the
        same list on every rank)."""
        votes: dict[int, int] = {}
        for n in decodes:
            b = self.bucket(n * self.per_seq) if n else None
            if b is not None and b in self.pending:
                votes[b] = votes.get(b, 0) + 1
        return votes

    def choose(self, decodes: list[int]) -> int | str:
        """The next item, from every rank's decode count (the same on every rank: the same choice)."""
        votes = self.in_use(decodes)
        if votes:
            return max(votes, key=lambda b: (votes[b], b))
        if PREFILL in self.pending:
            return PREFILL
        return min(b for b in self.pending if b != PREFILL)

    def compile_item(self, item) -> None:
        """Compile one bucket (a forward of padding rows through the layers' and the MTP layer's graphs, as
        CompiledDecode.warm_up: every rank at once, the MoE collectives pair up) or the prefill kernels."""
        runner = self.runner
        if item == PREFILL:  # local kernels, no collective: what _build_decode_graphs warms at start-up
            warm_up_prefill_kernels(runner)
        else:
            self.warm_bucket(item, runner.proposer.kv_caches if runner.proposer is not None else runner.kv_caches)
            self.ready.add(item)
        self.pending.remove(item)


def park_prefill_kernels() -> None:
    """Back to the eager INT8 quantizer and expert epilogue until LateGraphs compiles them again (PREFILL):
    torch._dynamo.reset() at the loss dropped their compiled code, and their next prefill-sized call would
    compile it on one rank in the middle of a step. Process-wide, as their switches are (one engine per rank
    process)."""
    from moeserve import int8
    from moeserve.layers.moe import expert_epilogue

    int8.uncompile_quantizer()
    expert_epilogue.disable()


def install(worker, started: float) -> bool:
    """The epoch's decode graphs, none compiled yet (the rank reports ready next and serves eagerly); False
    when the engine decodes eagerly (--enforce-eager, MOESERVE_ENFORCE_EAGER=1, ...)."""
    from moeserve.engine.compiled_decode import why_eager

    runner = worker.core.runner
    park_prefill_kernels()
    if why_eager(runner.config, worker.arch, runner.kv_caches[0].device) is not None:
        return False
    graphs = LateGraphs(runner, started)
    graphs.steps = getattr(runner, "graph_steps_carried", 0)  # EngineStats.num_graph_steps counts on
    if runner.proposer is not None:
        graphs.attach_mtp(runner.proposer.mtp.layer)
        runner.proposer.graphs = graphs
    runner.decode_graphs = graphs
    worker.between_steps = between_steps
    return True


def in_use_first(worker) -> bool:
    """--elastic-ep-graphs in-use-first, unless a rank of the epoch built its engine core afresh (a replacement:
    elastic_placement.vote_maps, the same answer on every rank): its process never compiled, its first compile
    takes seconds more (6.7 s before the first decode step in benchmarks/elastic_ep.py --replace, where
    eager-first served the next token 1.2 s after the loss), so that epoch serves eagerly first."""
    if worker.base_config.parallel.elastic_ep_graphs != "in-use-first":
        return False
    return not getattr(worker, "epoch_builds", False)


def between_steps(worker, flags: torch.Tensor) -> None:
    """dp_worker's hook after each round's all-gather (flags [W, 4]: has work, shutdown, prefill demand,
    decodes; the same on every rank): compile the next item where the rule in the module docstring says so."""
    from moeserve.engine.elastic import compiling

    graphs = worker.core.runner.decode_graphs
    if not isinstance(graphs, LateGraphs) or not graphs.pending:
        worker.between_steps = None
        return
    busy = bool(flags[:, 0].any())
    decodes = flags[:, 3].tolist()
    items = []
    if busy and in_use_first(worker):
        items = sorted(graphs.in_use(decodes))  # before this step: none of its decodes runs eagerly
    if busy:
        graphs.rounds += 1
        if not items and graphs.busy_steps < GAP_STEPS:
            graphs.busy_steps += 1
            return
    for item in items or [graphs.choose(decodes)]:
        start = time.monotonic()
        with compiling(worker):
            graphs.compile_item(item)
        took = time.monotonic() - start
        graphs.compile_total += took
        logger.info("epoch %d: %s compiled in %.1f s between steps (%d item(s) left)", worker.epoch,
                    f"decode graph for {item} tokens" if item != PREFILL else item, took, len(graphs.pending))
    graphs.busy_steps = int(busy)
    if not graphs.pending:
        worker.between_steps = None
        stderr_line(f"moeserve: pid {os.getpid()} rank {worker.info.rank} of epoch {worker.epoch}: decode graphs "
                    f"back ({len(graphs.buckets)} buckets and the prefill kernels compiled in "
                    f"{graphs.compile_total:.1f} s between steps, {graphs.rounds} busy steps served meanwhile), "
                    f"{time.monotonic() - graphs.started:.1f} s after it began joining")
