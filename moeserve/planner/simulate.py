"""Discrete-event simulation: a request stream through the REAL engine Scheduler, step times from the
cost model, so the planner and the server share one scheduling policy.

Lifecycle: requests arrive (Poisson or constant rate) -> Scheduler.add_request -> each step
Scheduler.schedule() picks work -> the cost model prices that exact batch -> the clock advances ->
Scheduler.update_from_output() with sampled tokens (1 + accepted MTP drafts) -> finished requests are
timed.

DP groups (`groups`): the simulated groups of an instance step in lockstep with the engine's own DP
policy (engine/dp_balance.py: least-loaded routing, prefill-balanced token budgets) and each step lasts as
long as the slowest group; the instance's other groups are taken to carry the same load.

PD disaggregation (run_pd): every prefill instance (all its DP groups) and decode DP groups, each group
its own Scheduler. The proxy sends a prompt to the prefill instance with the shortest estimated TTFT
(system-brief item 1) or round robin, and deals decode blocks round robin; inside an instance the engine's
router picks the group. Prefill runs each prompt (to a first token nobody sees); the request then waits for
the KV pull of its prompt but the last token and joins a decode group, whose first step computes that
token and samples the first output token, as moeserve's decode engine does (engine/kv_transfer.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from moeserve.config import MAX_SPEC_TOKENS, SchedulerConfig, SpeculativeConfig
from moeserve.engine.dp_balance import LeastLoadedRouter, prefill_balanced_budget
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request
from moeserve.engine.scheduler import RequestRejected, Scheduler
from moeserve.planner.analysis import decode_memory
from moeserve.perf.deploy import DoesNotFit, Instance, PlanError, Workload
from moeserve.perf.hardware import Hardware
from moeserve.planner.memory import memory_report
from moeserve.perf.models import ModelSpec
from moeserve.perf.step import Batch, run_step
from moeserve.sampling_params import SamplingParams


PROXIES = ("least-loaded", "round-robin")  # how a PD proxy spreads prompts over prefill instances
BLOCK_SIZE = 16  # KV block of the simulated engines (the engine's default --block-size)


@dataclass
class Trace:
    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    ready: float | None = None  # when it reaches the simulated instance (PD decode: after prefill + KV pull)
    rejected: bool = False  # turned away by SLO-aware admission (its TTFT target was out of reach)

    @property
    def start(self) -> float:
        return self.arrival if self.ready is None else self.ready


def arrivals(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if kind == "poisson" else 1.0 / rate
        out.append(t)
    return out


def lengths(n: int, mean: int, kind: str, rng: random.Random) -> list[int]:
    if kind == "fixed":
        return [mean] * n
    if kind == "uniform":
        return [rng.randint(max(1, mean // 2), max(1, 3 * mean // 2)) for _ in range(n)]
    return [max(1, int(rng.expovariate(1.0 / mean))) for _ in range(n)]


def _split(out, prefill_free: bool, pulled: bool = False):
    """A schedule() result as (decodes (context, positions), prefill chunks (1, new, cached)).

    A decode runs its token plus the MTP drafts the scheduler attached (what the engine verifies).
    prefill_free: a PD decode instance receives prompts' KV from prefill instances, so their chunks cost no
    compute here (the transfer overlaps earlier steps). pulled (PD decode): the KV of all but the prompt's
    last token is pulled; this instance computes that token while sampling the first output token: the
    chunk that completes the prompt is a one-position decode. A request preempted since (its KV freed) recomputes here whatever the role: the prefill side no
    longer holds its prompt's KV, and its outputs' KV was made here."""
    decodes, prefill = [], []
    for s in out.scheduled:
        if s.start >= s.request.num_prompt_tokens:
            decodes.append((s.start, s.num_tokens))
        elif s.request.num_preemptions:
            prefill.append((1.0, float(s.num_tokens), float(s.start)))
        elif pulled and s.samples:
            decodes.append((s.start + s.num_tokens - 1, 1))
        elif not prefill_free:
            prefill.append((1.0, float(s.num_tokens), float(s.start)))
    return decodes, prefill


def price(m: ModelSpec, hw: Hardware, inst: Instance, decodes, prefill, n_tokens: float | None = None) -> float:
    """Seconds for a batch _split() read from the scheduler: decodes at their mean context and positions,
    prefill chunks with their cached prefix. n_tokens: the instance's tokens in the MoE layers (default:
    every DP group runs this batch)."""
    n_dec = len(decodes)
    if not n_dec and not prefill and not n_tokens:
        return hw.eff.step_overhead_ms * 1e-3
    new = sum(n for _, n in decodes) / n_dec if n_dec else 1.0  # positions per decode (1 + drafts)
    b = Batch(n_dec, new, sum(c for c, _ in decodes) / n_dec if n_dec else 0.0, tuple(prefill), n_tokens)
    return run_step(m, hw, inst, b).total


def accepted(inst: Instance, rng: random.Random, drafts: int) -> int:
    """Of `drafts` verified drafts, how many are accepted: a chain, each with probability mtp_acceptance."""
    n = 0
    while n < drafts and rng.random() < inst.mtp_acceptance:
        n += 1
    return n


def make_scheduler(m, hw, inst, wl, max_num_seqs, max_batched, max_len, role: str = "unified",
                   free_prompts: bool = False, max_requests: int | None = None,
                   prefix_caching: bool = False, admission=None) -> Scheduler:
    """KV blocks and the sequence cap from the memory model. A prefill instance sizes its workspace for a
    full token budget and its KV for prompts (it frees each one once the decode side has it).

    free_prompts (a decode instance: prompts arrive as KV): the scheduler's token cap leaves room for every
    arriving prompt on top of `max_batched`; each step's budget is set by _Instance._pulled_budget.

    max_requests: requests the run will send; the pool is capped at the blocks they can hold all at once
    (the scheduler never needs more; a 1e9 GiB --hardware-file device made a pool of 1e12 block ids).

    prefix_caching: the engine's prefix cache (the prompts of _request share their cached part).

    admission: the engine's SLO-aware admission policy (engine/slo.py), or None for plain FCFS."""
    if role == "prefill":
        rep = memory_report(m, hw, inst, wl.input_len, max_batched,
                            logit_rows=max_batched / max(1, wl.input_len) * (1 + inst.mtp_drafts),
                            total_tokens=max_batched * inst.dp)
    else:
        rep = decode_memory(m, hw, inst, wl)
    per_token = m.kv_bytes_per_token(inst.kv_bytes, with_mtp=inst.mtp_drafts > 0)
    block = BLOCK_SIZE
    num_blocks = max(1, int(rep.kv_free // (per_token * block)))
    if max_requests is not None:
        num_blocks = min(num_blocks, max_requests * -(-max_len // block))
    seqs = max(1, rep.max_batch) if max_num_seqs is None else max_num_seqs
    cap = max_batched + (max_len * seqs if free_prompts else 0)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=cap, max_model_len=max_len)
    # MTP as the engine runs it: the scheduler attaches drafts, reserves their KV slots, trims rejections.
    if inst.mtp_drafts > MAX_SPEC_TOKENS:
        raise PlanError(f"--mtp-drafts {inst.mtp_drafts}: the engine's scheduler (which the simulator runs) "
                        f"takes at most {MAX_SPEC_TOKENS} speculative tokens")
    spec = SpeculativeConfig(num_speculative_tokens=inst.mtp_drafts) if inst.mtp_drafts else None
    kv = KVCacheManager(num_blocks, block, enable_caching=prefix_caching, hash_next_token=spec is not None)
    if admission is not None:
        admission.max_batch = seqs
    return Scheduler(cfg, kv, spec, admission)


def _admission(m: ModelSpec, hw: Hardware, inst: Instance, max_batched: int, slo, clock):
    """The engine's admission policy with default targets slo = (ttft_ms, tpot_ms), its step-time model
    starting from the planner's prior for this layout and calibrated by the simulated steps."""
    from moeserve.engine.slo import SLOAdmission
    from moeserve.engine.step_time import StepTimeModel, fit_prior
    return SLOAdmission(StepTimeModel(fit_prior(m, hw, inst)), clock, max_batched, *slo)


def _stream(m: ModelSpec, wl: Workload, num_requests: int, rate: float, arrival: str, length_dist: str,
            rng: random.Random) -> list[Trace]:
    """Arrivals at `rate` and drawn lengths; tail draws stay inside the model's context window, as a
    server's would."""
    arr = arrivals(num_requests, rate, arrival, rng)
    ins = lengths(num_requests, wl.input_len, length_dist, rng)
    outs = lengths(num_requests, wl.output_len, length_dist, rng)
    if m.max_position_embeddings:
        cap = m.max_position_embeddings
        ins = [min(i, cap - 1) for i in ins]
        outs = [max(1, min(o, cap - i)) for i, o in zip(ins, outs)]
    return [Trace(a, p, o) for a, p, o in zip(arr, ins, outs)]


def _request(rid: str, t: Trace, role: str, wl: Workload, index: int) -> Request:
    """What the simulated instance's scheduler sees of a trace. Its prompt's first `prefix_hit` share is
    one content every request shares (the engine's prefix cache serves it once it is computed and while it
    stays cached); the rest is its own (a token no other request of the instance has)."""
    if role == "prefill":  # prompt to first token, then the request leaves for decode
        prompt, max_tokens = t.prompt_len, 1
    else:  # unified, or PD decode: the prompt (its KV pulled but the last token's), every output token
        prompt, max_tokens = t.prompt_len, t.output_len
    shared = min(int(wl.prefix_hit * prompt), prompt - 1)
    return Request(rid, [1] * shared + [2 + index] * (prompt - shared),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=t.start)


class _Instance:
    """`groups` DP groups of one instance in lockstep, as the engine's DP ranks run: each request goes to the
    least-loaded group (the engine's router), each group's token budget is the engine's prefill-balanced
    one, and a step lasts as long as its slowest group (every MoE layer waits for all). The instance's other
    DP groups are taken to carry the same load.

    Lifecycle: admit() requests whose time has come -> step() from `clock` (False: no group had work) ->
    result(). Token times are appended to the admitted traces."""

    def __init__(self, m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload, role: str,
                 max_num_seqs: int | None, max_batched: int, rng: random.Random, groups: int, max_len: int,
                 max_requests: int | None = None, slo: tuple | None = None):
        self.m, self.hw, self.inst, self.wl, self.role, self.rng = m, hw, inst, wl, role, rng
        self.max_batched, self.groups = max_batched, groups
        self.prefill_free, self.pulled = role in ("decode", "pd-decode"), role == "pd-decode"
        # The prefix cache saves compute where prompts are computed (a PD decode instance pulls them).
        caching = wl.prefix_hit > 0 and role in ("unified", "prefill")
        self.scheds = [make_scheduler(m, hw, inst, wl, max_num_seqs, max_batched, max_len,
                                      role="prefill" if role == "prefill" else "decode",
                                      free_prompts=self.prefill_free, max_requests=max_requests,
                                      prefix_caching=caching,
                                      admission=None if slo is None else
                                      _admission(m, hw, inst, max_batched, slo, lambda: self.clock))
                       for _ in range(groups)]
        self.router = LeastLoadedRouter(groups, BLOCK_SIZE if caching else None)  # the engine's, cache-aware
        self.traces: dict[str, Trace] = {}
        self.clock, self.steps, self.busy = 0.0, 0, 0.0

    def ttft_estimate(self, t: float, sec_per_token: float) -> float:
        """What a proxy estimates a prompt arriving at `t` waits before its own prefill: the step in flight
        (it ends at `clock`) plus the prompt tokens queued behind it, which the DP groups share."""
        queued = sum(s.prefill_demand() for s in self.scheds)
        return max(self.clock - t, 0.0) + sec_per_token * queued / self.groups

    def has_work(self) -> bool:
        return any(s.has_unfinished() for s in self.scheds)

    def admit(self, rid: str, trace: Trace) -> None:
        req = _request(rid, trace, self.role, self.wl, len(self.traces))
        # with SLO-aware admission the engine's DP router compares the groups' predicted TTFT
        ttft = ([s.admission.ttft_estimate(s.running, s.waiting)[0] for s in self.scheds]
                if self.groups > 1 and self.scheds[0].admission is not None else None)
        sched = self.scheds[self.router.assign(rid, req.num_prompt_tokens, req.sampling_params.max_tokens,
                                               req.prompt_token_ids, ttft)]
        try:
            sched.add_request(req)
        except RequestRejected:  # the engine's message names engine flags (--num-kv-blocks)
            raise DoesNotFit(_pool_too_small(self.role, sched, req, self.wl, self.max_batched)) from None
        self.traces[rid] = trace

    def step(self) -> bool:
        inst, scheds = self.inst, self.scheds
        if self.prefill_free:  # prompts are KV arriving, not compute: nothing to balance (_pulled_budget)
            outs = [s.schedule(self._pulled_budget(s)) for s in scheds]
        else:
            demands = [s.prefill_demand() for s in scheds]
            decodes = sum(s.num_decodes() for s in scheds)
            outs = [s.schedule(prefill_balanced_budget(demands, decodes, self.max_batched, s.num_decode_tokens()))
                    for s in scheds]
        for out in outs:
            for rej in out.rejected:
                self.traces[rej.request_id].rejected = True
        if all(o.is_empty for o in outs):
            return False
        batches = [_split(o, self.prefill_free, self.pulled) for o in outs]
        # The MoE layers see every group's tokens, times the groups not simulated.
        n_tokens = sum(sum(n for _, n in d) + sum(n for _, n, _ in p) for d, p in batches) * inst.dp / self.groups
        dt = max(price(self.m, self.hw, inst, d, p, n_tokens) for d, p in batches)
        self.clock += dt
        self.busy += dt
        self.steps += 1
        for sched, out in zip(scheds, outs):
            if sched.admission is not None and not out.is_empty:
                sched.admission.observe(out.scheduled, dt)
            sampled, drafts = {}, {}
            for s in out.scheduled:
                if s.samples:
                    rid = s.request.request_id
                    # the drafts verified this step, then the bonus token; never past max_tokens (the
                    # scheduler sizes drafts so, and stops the request there)
                    k = 1 + accepted(inst, self.rng, len(s.draft_token_ids))
                    k = min(k, s.request.sampling_params.max_tokens - s.request.num_output_tokens)
                    sampled[rid], drafts[rid] = [0] * k, [0] * s.num_new_drafts
                    self.traces[rid].token_times += [self.clock] * k
                    self.router.progress(rid, k)
            for req in sched.update_from_output(out, sampled, drafts):
                self.router.forget(req.request_id)
        return True

    def _pulled_budget(self, sched: Scheduler) -> int:
        """A decode instance's step budget: its decodes, at most max_batched of them, plus the whole of each
        pulled prompt that has a slot left under max_batched (its KV is not computed here: like a decode it
        takes one slot, as in vLLM's PD decode). The budget used to be max_batched + all prompt tokens, so
        whenever a prompt was pending every decode ran, past --max-num-batched-tokens. A preempted request's
        recompute is compute (_split): it takes its tokens of the budget, as a prefill chunk does."""
        dec = sched.num_decode_tokens()  # MTP drafts included
        budget = min(dec, self.max_batched)
        room = self.max_batched - budget
        # in the order the scheduler serves them: running chunks, then the waiting queue
        for r in [r for r in sched.running if r.num_missing_tokens > 1] + list(sched.waiting):
            if room <= 0:
                break
            n = min(r.num_missing_tokens, room) if r.num_preemptions else r.num_missing_tokens
            budget += n
            room -= n if r.num_preemptions else 1
        return budget

    def advance_to(self, t: float, max_steps: int) -> None:
        """Run the steps that start before `t` (an idle instance waits until then)."""
        while self.clock < t and self.steps < max_steps:
            if not self.step():
                self.clock = t
                return

    def drain(self, max_steps: int) -> None:
        while self.steps < max_steps and self.has_work() and self.step():
            pass

    def result(self) -> dict:
        return {"traces": self.traces, "makespan": self.clock, "steps": self.steps, "busy": self.busy,
                "groups": self.groups, "preemptions": sum(s.num_preemptions for s in self.scheds),
                "prefix_cache": [sum(s.prefix_cache_queries for s in self.scheds),
                                 sum(s.prefix_cache_hits for s in self.scheds)]}


def _max_len(inst: Instance, traces) -> int:
    return max(t.prompt_len + t.output_len for t in traces) + 1 + inst.mtp_drafts


def _run_group(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload, traces: dict[str, Trace], role: str,
               max_num_seqs: int | None, max_batched: int, rng: random.Random, max_steps: int,
               groups: int = 1, slo: tuple | None = None) -> dict:
    """`groups` DP groups of `inst` (an _Instance) serving `traces`; returns its result()."""
    sim = _Instance(m, hw, inst, wl, role, max_num_seqs, max_batched, rng, groups,
                    _max_len(inst, traces.values()), max_requests=len(traces), slo=slo)
    for rid in sorted(traces, key=lambda r: traces[r].start):
        sim.advance_to(traces[rid].start, max_steps)
        sim.admit(rid, traces[rid])
    sim.drain(max_steps)
    return sim.result()


def _run_prefill_pool(m: ModelSpec, hw: Hardware, pre: Instance, wl: Workload, stream: list[Trace],
                      instances: int, proxy: str, max_batched: int, rng: random.Random,
                      max_steps: int) -> tuple[dict[int, float], dict]:
    """Every prefill instance, advanced together in time so a load-aware proxy sees their queues: request i
    goes to instance i % P ('round-robin') or to the one with the shortest estimated TTFT ('least-loaded',
    system-brief item 1: the rest of the step in flight plus the queued prompt tokens at a lone prompt's
    per-token prefill cost). Returns request index -> prefill done, and the instances' summed steps, busy
    and makespan."""
    from moeserve.planner.analysis import prefill_point
    per_token = prefill_point(m, hw, pre, 1, wl.input_len, wl.cached_prompt_tokens).ttft_ms * 1e-3 / wl.input_len
    max_len = _max_len(pre, stream)
    pool = [_Instance(m, hw, pre, wl, "prefill", None, max_batched, rng, pre.dp, max_len, max_requests=len(stream))
            for _ in range(instances)]
    traces = [Trace(t.arrival, t.prompt_len, 1) for t in stream]
    for i, t in enumerate(traces):
        for sim in pool:
            sim.advance_to(t.arrival, max_steps)
        j = i % instances if proxy == "round-robin" else min(
            range(instances), key=lambda j: (pool[j].ttft_estimate(t.arrival, per_token), j))
        pool[j].admit(str(i), t)
    for sim in pool:
        sim.drain(max_steps)
    busy, span = sum(s.busy for s in pool), sum(s.clock for s in pool)
    results = [s.result() for s in pool]
    summed = {"steps": sum(s.steps for s in pool), "busy": busy, "makespan": span,
              "busy_fraction": round(busy / (span or 1.0), 4),
              "prefix_cache": [sum(r["prefix_cache"][i] for r in results) for i in (0, 1)]}
    return {i: t.token_times[0] for i, t in enumerate(traces) if t.token_times}, summed


def _pool_too_small(role: str, sched: Scheduler, req: Request, wl: Workload, max_batched: int) -> str:
    which = {"prefill": "prefill instance", "pd-decode": "decode instance"}.get(role, "instance")
    sized = (f"a --max-num-batched-tokens {max_batched} step's workspace" if role == "prefill"
             else "the memory-limited batch")
    return (f"{which}: a request of {req.num_prompt_tokens + req.sampling_params.max_tokens} tokens needs more "
            f"KV than the {sched.kv.pool.num_blocks * sched.kv.block_size} tokens left after the weights and "
            f"{sized} (--input-len {wl.input_len}); lower --max-num-batched-tokens, use more cards, or "
            f"shorter lengths (--input-len / --length-dist)")


def run(m: ModelSpec, hw: Hardware, inst: Instance, wl: Workload, rate: float, num_requests: int,
        arrival: str = "poisson", length_dist: str = "fixed", max_num_seqs: int | None = None,
        max_batched: int = 8192, seed: int = 0, max_steps: int = 2_000_000,
        role: str = "unified", groups: int = 1, slo: tuple | None = None) -> dict:
    """`rate` requests/s into the whole instance, `groups` of its DP groups simulated, `num_requests` per
    simulated group; returns raw traces. slo = (ttft_ms, tpot_ms): the engine's SLO-aware admission with
    these default targets (either may be None); rejected traces are marked.

    role 'unified': prefill and decode share the instance (chunked prefill); 'decode': a PD decode
    instance whose prompts arrive prefilled."""
    _check_groups(groups, inst, "")
    _check_stream(num_requests, rate, num_requests * groups, f" x --sim-dp-groups {groups}")
    rng = random.Random(seed)
    traces = {str(i): t for i, t in enumerate(_stream(m, wl, num_requests * groups, rate * groups / inst.dp,
                                                       arrival, length_dist, rng))}
    return _run_group(m, hw, inst, wl, traces, role, max_num_seqs, max_batched, rng, max_steps, groups, slo)


def _check_groups(groups: int, inst: Instance, which: str) -> None:
    if groups < 1 or inst.dp % groups:
        raise PlanError(f"--sim-dp-groups {groups} must divide the {which}instance's {inst.dp} DP groups "
                        f"(--cards / --tp)")


# Requests in one simulated stream (docs/planner.md): the run keeps every trace and its time grows with
# the requests (milliseconds each); --num-requests 1e30 allocated until memory ran out. The default is at
# most 4000 per simulated decode DP group (sim_plan.settling_requests).
MAX_SIM_REQUESTS = 1_000_000


def _check_stream(num_requests: int, rate: float, total: int | None = None, what: str = "") -> None:
    """total: requests in the whole simulated stream (default num_requests); what: the flags that multiply
    --num-requests into it."""
    if num_requests < 1 or not rate > 0:  # no stream to measure; a non-positive rate has no arrivals
        raise ValueError(f"simulate needs num_requests >= 1 and rate > 0, got {num_requests} and {rate}")
    total = num_requests if total is None else total
    if total > MAX_SIM_REQUESTS:
        raise PlanError(f"the simulated stream would hold {total} requests (--num-requests / --simulate-requests "
                        f"{num_requests}{what}); at most {MAX_SIM_REQUESTS}: ask for fewer requests")


def run_pd(m: ModelSpec, hw: Hardware, pre: Instance, dec: Instance, wl: Workload, rate: float,
           num_requests: int, prefill_instances: int = 1, decode_instances: int = 1, arrival: str = "poisson",
           length_dist: str = "fixed", max_num_seqs: int | None = None, max_batched: int = 8192,
           seed: int = 0, max_steps: int = 2_000_000, groups: int = 1,
           prefill_max_batched: int | None = None, proxy: str = PROXIES[0]) -> dict:
    """A PD deployment at `rate` requests/s: `prefill_instances` x `pre` and `decode_instances` x `dec`.

    Every prefill instance is simulated whole (its DP groups in lockstep: prompts do not arrive aligned;
    a prefill step is short, so this is cheap), so each request has its own prefill latency; `groups` DP
    groups of one decode instance serve their share, `num_requests` per simulated decode group (as in
    `run`). prefill_max_batched: the prefill instances' token budget per step (default max_batched);
    proxy: how requests are spread over prefill instances (_run_prefill_pool); decode blocks are dealt
    round robin.
    Returns the decode groups' raw traces (arrival = at the proxy; token 1 = prefill done + KV pull), the
    prefill instances' summed raw result under "prefill" and the pull times."""
    from moeserve.planner.analysis import kv_pull_ms
    _check_groups(groups, dec, "decode ")
    if proxy not in PROXIES:
        raise PlanError(f"--pd-proxy must be one of {', '.join(PROXIES)}, got {proxy!r}")
    blocks = decode_instances * dec.dp // groups  # blocks of `groups` decode DP groups
    _check_stream(num_requests, rate, num_requests * groups * blocks,
                  f" per decode DP group x {decode_instances * dec.dp} decode DP groups: --decode-instances "
                  f"{decode_instances} x {dec.dp}")
    rng = random.Random(seed)
    stream = _stream(m, wl, num_requests * groups * blocks, rate, arrival, length_dist, rng)
    firsts, pre_raw = _run_prefill_pool(m, hw, pre, wl, stream, prefill_instances, proxy,
                                        prefill_max_batched or max_batched, rng, max_steps)
    # Decode: request i goes to decode block i % blocks; the first block is simulated.
    cards = prefill_instances * pre.cards + decode_instances * dec.cards
    pull_cache: dict[int, float] = {}
    traces = {}
    for i, t in enumerate(stream):
        if i % blocks:
            continue
        if i not in firsts:  # its prefill did not finish within the step cap: unfinished, not measured
            traces[str(i)] = Trace(t.arrival, t.prompt_len, t.output_len)
            continue
        if t.prompt_len not in pull_cache:
            pull_cache[t.prompt_len] = kv_pull_ms(m, hw, dec, t.prompt_len, cards) * 1e-3
        # its KV is here after the prefill and the pull; the decode side emits every output token
        traces[str(i)] = Trace(t.arrival, t.prompt_len, t.output_len, ready=firsts[i] + pull_cache[t.prompt_len])
    decoding = {r: t for r, t in traces.items() if t.ready is not None}
    if decoding:
        raw = _run_group(m, hw, dec, wl, decoding, "pd-decode", max_num_seqs, max_batched, rng, max_steps,
                         groups)
    else:  # no prefill finished within the step cap: the decode side never steps
        raw = {"makespan": 0.0, "steps": 0, "busy": 0.0, "groups": groups, "preemptions": 0}
    raw["traces"] = traces
    raw["prefill"] = pre_raw
    raw["kv_pull_ms"] = {p: round(s * 1e3, 3) for p, s in sorted(pull_cache.items())}
    return raw
