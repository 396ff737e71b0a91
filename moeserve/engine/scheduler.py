"""Continuous-batching scheduler: CPU bookkeeping only, no tensor code.

Lifecycle of a request: add_request() -> WAITING -> (admitted by schedule()) RUNNING -> tokens appended by
update_from_output() -> FINISHED_* (blocks freed). When the KV pool runs out, the newest running request is
preempted by recompute: its blocks are freed, num_computed_tokens goes back to 0 and it waits at the front
of the queue, keeping its generated tokens, so the output is unchanged.

Policy per step, under max_num_batched_tokens and max_num_seqs:
  1. running requests, decodes before prefill chunks (decode latency first);
  2. waiting requests in arrival order, prefills chunked to the remaining token budget,
     unless someone was preempted this step (the pool is short; admitting more would thrash).
     With an admission policy (engine/slo.py) a request is admitted only if the batch keeps its TPOT
     targets, and waiting requests whose TTFT target is out of reach are turned away first.
     With prefix caching a request starts after its longest cached prefix (engine/kv_cache.py), and every
     step indexes the full blocks it completed.

Speculative decoding (MTP) is the same model: a caught-up request schedules its missing token plus its
drafts (Request.spec_token_ids) as extra tokens; a step that samples also reserves lookahead slots for the
drafts the proposer chains past the accepted tokens. After the step num_computed_tokens moves past the
accepted drafts only, and the blocks past it (rejected and lookahead slots) go back to the pool.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeserve.config import SchedulerConfig, SpeculativeConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request, RequestStatus
from moeserve.speculative.metrics import SpecDecodingStats


class RequestRejected(ValueError):
    """A request that can never run under this configuration (too long, bigger than the KV pool)."""


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step: position of the first scheduled token
    num_tokens: int  # tokens whose KV is computed this step, drafts included
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # the last len(...) scheduled tokens
    num_new_drafts: int = 0  # drafts the proposer makes this step for the next one

    @property
    def samples(self) -> bool:
        """True when this step catches the request up, so the model samples its next token."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    rejected: list = field(default_factory=list)  # engine/slo.py Rejection: TTFT target out of reach

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 speculative: SpeculativeConfig | None = None, admission=None) -> None:
        self.config = config
        self.admission = admission  # engine/slo.py SLOAdmission, or None: plain FCFS
        self.kv = kv
        self.speculative = speculative
        self.spec_stats = SpecDecodingStats(speculative.num_speculative_tokens if speculative else 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up at admission (vLLM's counters)
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # ---- admission -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.config.policy == "priority":  # before the first waiting request of a larger priority value
            at = next((i for i, r in enumerate(self.waiting) if r.priority > request.priority), len(self.waiting))
            self.waiting.insert(at, request)
        else:
            self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens, but the maximum context length is "
                f"{max_len} tokens (prompt plus at least one generated token); shorten the prompt or raise "
                "--max-model-len")
        max_tokens = request.sampling_params.max_tokens
        final_len = max_len if max_tokens is None else min(max_len, request.num_prompt_tokens + max_tokens)
        need, have = self.kv.blocks_needed(final_len), self.kv.pool.num_blocks
        if need > have:
            raise RequestRejected(
                f"the request needs up to {need} KV blocks ({final_len} tokens) but the pool has {have}; "
                "raise --num-kv-blocks / --kv-cache-memory or lower max_tokens")

    def abort(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """Pick this step's work. token_budget, if given, caps it below max_num_batched_tokens."""
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = min(budget, token_budget)
        out = SchedulerOutput()
        scheduled: set[str] = set()
        if self.admission is not None and self.waiting:
            self._reject_late(out)
        # Stable sort: decodes (one missing token) before prefill chunks.
        for req in sorted(self.running, key=lambda r: r.num_missing_tokens > 1):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_missing_tokens, budget)
            if n <= 0:
                continue
            drafts = req.spec_token_ids[: budget - n] if n == req.num_missing_tokens == 1 else []
            s = self._scheduled(req, n + len(drafts), drafts)
            if not self._make_room(req, s.num_tokens + max(s.num_new_drafts - 1, 0), scheduled, out):
                continue
            out.scheduled.append(s)
            scheduled.add(req.request_id)
            budget -= s.num_tokens
        if not out.preempted:
            self._admit_waiting(budget, out)
        return out

    def _reject_late(self, out: SchedulerOutput) -> None:
        """Turn away the waiting requests whose TTFT target the admission policy can no longer meet."""
        for rej in self.admission.expire(self.running, self.waiting):
            req = self.requests[rej.request_id]
            self.waiting.remove(req)
            self.admission.rejected(req.request_id)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            out.rejected.append(rej)

    def _make_room(self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Allocate n slots for req, preempting the newest unscheduled running requests if needed."""
        while not self.kv.allocate_slots(req, n):
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = max(victims, key=lambda r: r.arrival_time)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        # Prefix blocks running prefills are computing: a waiting request whose next block is one of them
        # waits a step and shares it instead of computing it again (n > 1 samples, a burst of requests with
        # one system prompt), as SGLang's in-batch prefix caching does.
        in_flight = {h for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
                     for h in self.kv.uncomputed_prefix(r)} if self.kv.enable_caching else set()
        deferred: list[Request] = []
        view = self.admission.begin(self.running) if self.admission is not None else None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            looked_up = self.kv.looks_up(req)
            cached = self.kv.take_cached_prefix(req)
            if looked_up and in_flight and any(h in in_flight for h in self.kv.uncomputed_prefix(req)[:1]):
                if cached:
                    self.kv.untake(req)
                deferred.append(req)
                continue
            if view is not None and not self.admission.admits(req, view):  # it would break a TPOT target
                if cached:
                    self.kv.untake(req)
                self.waiting.appendleft(req)
                break
            n = min(req.num_missing_tokens, budget)
            s = self._scheduled(req, n, [])
            if ((n < req.num_missing_tokens and not self.config.enable_chunked_prefill)
                    or not self.kv.allocate_slots(req, n + max(s.num_new_drafts - 1, 0))):
                if cached:  # not admitted after all: look again next step
                    self.kv.untake(req)
                self.waiting.appendleft(req)
                break
            if req.num_preemptions == 0:  # what the client is told: its prompt, as first admitted
                req.num_cached_tokens = cached
            if looked_up:  # every lookup, recomputes included; not with the cache off, nor for pulled KV
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(s)
            budget -= n
            if looked_up:
                in_flight.update(self.kv.uncomputed_prefix(req))
        self.waiting.extendleft(reversed(deferred))  # they keep their place in the queue

    def _scheduled(self, req: Request, n: int, drafts: list[int]) -> ScheduledRequest:
        """n tokens from num_computed_tokens on (the last len(drafts) are drafts)."""
        s = ScheduledRequest(req, req.num_computed_tokens, n, self.kv.block_tables.setdefault(req.request_id, []),
                             list(drafts))
        if s.samples:
            s.num_new_drafts = self._num_new_drafts(req, len(drafts))
        return s

    def _num_new_drafts(self, req: Request, num_drafts: int) -> int:
        """Drafts to propose for the next step, sized for the case where every draft is accepted, so the
        next step's drafts stay inside max_model_len and max_tokens (and the lookahead slots inside the
        request's final length)."""
        if self.speculative is None:
            return 0
        tokens_after = req.num_tokens + num_drafts + 1
        room = self.config.max_model_len - tokens_after
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:  # the next step emits up to drafts + 1 tokens
            room = min(room, max_tokens - (req.num_output_tokens + num_drafts + 1) - 1)
        return max(0, min(self.speculative.num_speculative_tokens, room))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- results ---------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           draft_tokens: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests. Returns finished ones.

        sampled maps request id -> new tokens (several when speculative drafts were accepted);
        draft_tokens maps request id -> the drafts to verify next step.
        """
        finished = []
        now = self.admission.clock() if self.admission is not None else 0.0
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            new = sampled.get(req.request_id, ())
            if new and self.admission is not None and not req.num_output_tokens:
                self.admission.first_token(req, now)
            self._advance(req, s, len(new), (draft_tokens or {}).get(req.request_id, []))
            status = None
            for token in new:
                req.output_token_ids.append(token)
                status = req.check_stop(self.config.max_model_len)
                if status is not None:
                    break
            self.kv.cache_full_blocks(req)  # the tokens are appended: MTP's next-token hashes are known
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    def _advance(self, req: Request, s: ScheduledRequest, num_new: int, next_drafts: list[int]) -> None:
        """num_computed_tokens past the verified tokens; drop the KV slots of rejected / lookahead drafts."""
        num_drafts = len(s.draft_token_ids)
        accepted = max(num_new - 1, 0) if num_drafts else 0
        req.num_computed_tokens = s.start + s.num_tokens - (num_drafts - accepted)
        if num_drafts:
            self.spec_stats.observe(num_drafts, accepted)
        if self.speculative is not None:
            req.spec_token_ids = list(next_drafts)
            self.kv.trim(req, req.num_computed_tokens)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside (a stop string matched by the detokenizer)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if self.admission is not None:
            self.admission.finished(req, self.admission.clock(), aborted=status is RequestStatus.FINISHED_ABORTED)
        if req.hold_kv and status is not RequestStatus.FINISHED_ABORTED:
            self.kv.hold(req)  # engine/kv_transfer.py frees them once the decode instance pulled them
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)

    # ---- introspection ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_decodes(self) -> int:
        """Running requests that need exactly one token next step."""
        return sum(1 for r in self.running if r.num_missing_tokens == 1)

    def num_decode_tokens(self) -> int:
        """Tokens the decodes take of next step's budget: each its missing token plus its MTP drafts."""
        return sum(1 + len(r.spec_token_ids) for r in self.running if r.num_missing_tokens == 1)

    def prefill_demand(self) -> int:
        """Prompt (or recompute) tokens waiting to be computed: what DP prefill balancing evens out."""
        return sum(r.num_missing_tokens for r in list(self.waiting) + self.running if r.num_missing_tokens > 1)

    def outstanding_tokens(self) -> int:
        """Work still queued here (for DP load balancing): missing tokens plus remaining outputs."""
        total = 0
        for req in list(self.waiting) + self.running:
            total += req.num_missing_tokens
            max_tokens = req.sampling_params.max_tokens or 0
            total += max(0, max_tokens - req.num_output_tokens)
        return total
