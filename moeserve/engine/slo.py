"""SLO-aware admission: admit a waiting request only if the running batch keeps its TPOT targets, and
turn away (503 + Retry-After) a request whose TTFT target can no longer be met.

The policy is CPU bookkeeping the Scheduler consults (design principle 2); it never sees tensors. Its
predictions come from a StepTimeModel (engine/step_time.py: the cost model (moeserve/perf/, shared with the planner) calibrated online by
the engine's measured steps):

  TPOT of a batch of B requests: a decode step of B at their mean context, plus the prefill work that
  joins it: in steady state a slot frees (and a prompt of mean length P is prefilled) every O_mean / B
  steps, so each step carries B / O_mean of a prefill of P tokens.
  TTFT of a waiting request: the time it waited, then until a slot for it frees (slots under the TPOT cap
  release as running requests finish: remaining tokens x predicted TPOT), then the prefill steps of the
  prompts ahead of it and its own.

Requests without targets (neither their own nor the engine's --slo-ttft-ms / --slo-tpot-ms) are never
turned away and set no TPOT cap, but they are admitted only where the batch stays inside the targets of
the requests that have them. Preempted requests return without a check (they were admitted once).

Accounting (SLOStats): every request with a target is counted when it finishes (met or not) or is
turned away; the TTFT and TPOT predicted at admission are compared with what happened.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from moeserve.engine.step_time import StepFeatures, StepTimeModel, chunk_pairs, features_of

EWMA = 0.05  # weight of the newest request in the running prompt / output length means


@dataclass
class Rejection:
    request_id: str
    message: str
    retry_after_s: float


@dataclass
class SLOStats:
    """Counters since start (EngineStats fields slo_*)."""
    requests: int = 0  # finished or turned away, with a target
    met: int = 0  # finished inside every target it had
    rejected: int = 0  # turned away (503): their TTFT target could not be met
    ttft_pred_error_s: float = 0.0  # summed |predicted - measured| TTFT of admitted requests
    ttft_measured_s: float = 0.0
    ttft_count: int = 0
    tpot_pred_error_s: float = 0.0
    tpot_measured_s: float = 0.0
    tpot_count: int = 0


@dataclass
class _Track:
    ttft_s: float | None
    tpot_s: float | None
    pred_ttft_s: float | None = None
    pred_tpot_s: float | None = None
    first_token_at: float | None = None


@dataclass
class BatchView:
    """The batch the policy reasons about during one step's admission: the running requests plus those
    admitted so far this step."""
    size: int
    context: float  # summed mid-life context of its members
    tightest_tpot_s: float  # inf when nobody has a TPOT target
    prefill_tokens: float  # prompt tokens this step computes for running requests
    queued_prefill: float = 0.0  # prompt tokens of requests admitted this step
    admitted: list = field(default_factory=list)


class SLOAdmission:
    def __init__(self, model: StepTimeModel, clock: Callable[[], float], token_budget: int,
                 default_ttft_ms: float | None = None, default_tpot_ms: float | None = None,
                 max_batch: int = 1 << 12) -> None:
        self.model, self.clock, self.token_budget, self.max_batch = model, clock, token_budget, max_batch
        self.default_ttft_s = None if default_ttft_ms is None else default_ttft_ms / 1e3
        self.default_tpot_s = None if default_tpot_ms is None else default_tpot_ms / 1e3
        self.stats = SLOStats()
        self._tracks: dict[str, _Track] = {}
        self.mean_prompt: float | None = None
        self.mean_output: float | None = None

    # ---- targets ---------------------------------------------------------------------------------
    def track(self, req) -> _Track:
        t = self._tracks.get(req.request_id)
        if t is None:
            ttft = req.slo_ttft_ms / 1e3 if req.slo_ttft_ms is not None else self.default_ttft_s
            tpot = req.slo_tpot_ms / 1e3 if req.slo_tpot_ms is not None else self.default_tpot_s
            t = self._tracks[req.request_id] = _Track(ttft, tpot)
            if self.mean_output is None:  # until requests finish, the first one's lengths stand for all
                self.mean_output = float(req.sampling_params.max_tokens or 256)
                self.mean_prompt = float(req.num_prompt_tokens)
        return t

    # ---- predictions -----------------------------------------------------------------------------
    def _output_len(self, req) -> float:
        """Tokens the request will generate in all: its max_tokens, capped by what requests produce
        on average (a request ends at EOS well before max_tokens, as often as not)."""
        cap = req.sampling_params.max_tokens or 1 << 20
        return float(min(cap, self.mean_output)) if self.mean_output else float(cap)

    def _mid_context(self, req) -> float:
        return req.num_tokens + max(0.0, self._output_len(req) - req.num_output_tokens) / 2.0

    def tpot(self, size: int, context: float) -> float:
        """Predicted TPOT of a batch of `size` requests with summed mid-life context `context`."""
        if size <= 0:
            return 0.0
        decode = StepFeatures(size, context)
        step = self.model.predict(decode)
        p = self.mean_prompt or 0.0
        o = max(self.mean_output or 1.0, 1.0)
        joining = self.model.predict(decode.plus(prefill_tokens=p, prefill_pairs=chunk_pairs(p, 0.0))) - step
        return step + size / o * max(joining, 0.0)

    def prefill_time(self, view: BatchView, tokens_ahead: float, own: float, past: float = 0.0) -> float:
        """Seconds until `own` prompt tokens are computed behind `tokens_ahead` others: steps of the
        token budget left beside the batch's decodes."""
        room = max(1.0, self.token_budget - view.size)
        steps = max(1, math.ceil((tokens_ahead + own) / room))
        chunk = min(own + tokens_ahead, room)
        one = self.model.predict(StepFeatures(view.size, view.context, chunk, chunk_pairs(chunk, past)))
        return steps * one

    def begin(self, running: list) -> BatchView:
        """The running batch, at the start of a step's admission."""
        tight = min((t for r in running if (t := self.track(r).tpot_s) is not None), default=math.inf)
        pre = sum(r.num_missing_tokens for r in running if r.num_missing_tokens > 1)
        return BatchView(len(running), sum(self._mid_context(r) for r in running), tight, pre)

    def admits(self, req, view: BatchView) -> bool:
        """Whether admitting `req` keeps every admitted request (and itself) inside its TPOT target.
        Slow start: until the step-time model is calibrated a step at most doubles the batch (a burst at
        start-up would otherwise rest on the nominal prior alone)."""
        if req.num_preemptions:
            return True
        t = self.track(req)
        tight = min(view.tightest_tpot_s, t.tpot_s if t.tpot_s is not None else math.inf)
        slow_start = not self.model.calibrated and not math.isinf(tight)  # nobody's target: plain FCFS
        if slow_start and len(view.admitted) >= max(1, view.size - len(view.admitted)):
            return False
        size, ctx = view.size + 1, view.context + self._mid_context(req)
        pred_tpot = self.tpot(size, ctx)
        if pred_tpot > tight and view.size > 0:  # a lone request runs whatever its target: nothing helps it
            return False
        now = self.clock()
        t.pred_tpot_s = pred_tpot
        t.pred_ttft_s = (now - req.arrival_time) + self.prefill_time(
            view, view.prefill_tokens + view.queued_prefill, req.num_missing_tokens, req.num_computed_tokens)
        view.size, view.context, view.tightest_tpot_s = size, ctx, tight
        view.queued_prefill += req.num_missing_tokens
        view.admitted.append(req)
        return True

    def _release_times(self, running: list, view: BatchView) -> list[float]:
        """Seconds until each running request finishes (sorted): its remaining tokens at the batch's TPOT."""
        tpot = self.tpot(view.size, view.context)
        return sorted(max(0.0, self._output_len(r) - r.num_output_tokens) * tpot for r in running)

    def expire(self, running: list, waiting) -> list[Rejection]:
        """Waiting requests (in queue order) whose TTFT target cannot be met any more, even if every
        request ahead of them is served first."""
        view = self.begin(running)
        releases = self._release_times(running, view)
        cap = self._batch_cap(view)
        free = max(0, cap - view.size)
        now = self.clock()
        out, ahead, position = [], view.prefill_tokens, 0
        for req in waiting:
            if req.num_preemptions or req.num_output_tokens:
                continue
            t = self.track(req)
            if t.ttft_s is not None:
                eta = now - req.arrival_time + self._slot_wait(position - free, releases, view) \
                    + self.prefill_time(view, ahead, req.num_missing_tokens)
                if eta > t.ttft_s:
                    retry = releases[0] if releases else 1.0
                    out.append(Rejection(
                        req.request_id,
                        f"the server cannot meet this request's TTFT target of {t.ttft_s * 1e3:.0f} ms "
                        f"(predicted {eta * 1e3:.0f} ms: {len(running)} running, {position} waiting ahead); "
                        "retry later or raise slo_ttft_ms", max(1.0, math.ceil(retry))))
                    continue
            ahead += req.num_missing_tokens
            position += 1
        return out

    def _slot_wait(self, j: int, releases: list[float], view: BatchView) -> float:
        """Seconds until the j-th request past the free slots gets one (j < 0: a slot is free now): running
        requests finish at `releases`, then their successors after a mean output each."""
        if j < 0 or not releases:
            return 0.0
        cycle = (self.mean_output or 1.0) * self.tpot(view.size, view.context)
        return releases[j % len(releases)] + (j // len(releases)) * cycle

    def ttft_estimate(self, running: list, waiting) -> tuple[float, float]:
        """(predicted TTFT, predicted own prefill seconds) of a request of mean prompt length arriving now
        behind the waiting queue: what the DP router compares between ranks."""
        view = self.begin(running)
        releases = self._release_times(running, view)
        free = max(0, self._batch_cap(view) - view.size)
        queued = [r for r in waiting if not r.num_preemptions]
        position, ahead = len(queued), view.prefill_tokens + sum(r.num_missing_tokens for r in queued)
        wait = self._slot_wait(position - free, releases, view)
        own = self.mean_prompt or 1.0
        prefill = self.prefill_time(view, 0.0, own)
        return wait + self.prefill_time(view, ahead, own), prefill

    def _batch_cap(self, view: BatchView) -> int:
        """The largest batch whose predicted TPOT meets the running requests' tightest target."""
        if math.isinf(view.tightest_tpot_s):
            return 1 << 30
        per = view.context / view.size if view.size else (self.mean_prompt or 0.0)
        lo, hi = 1, self.max_batch  # bisect: the predicted TPOT grows with the batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.tpot(mid, per * mid) <= view.tightest_tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- outcomes --------------------------------------------------------------------------------
    def observe(self, scheduled, seconds: float) -> None:
        self.model.observe(features_of(scheduled), seconds)

    def first_token(self, req, now: float) -> None:
        t = self.track(req)
        if t.first_token_at is None:
            t.first_token_at = now
            if req.num_prompt_tokens:
                p = float(req.num_prompt_tokens)
                self.mean_prompt = p if self.mean_prompt is None else (1 - EWMA) * self.mean_prompt + EWMA * p

    def rejected(self, request_id: str) -> None:
        t = self._tracks.pop(request_id, None)
        if t is not None and t.ttft_s is not None:
            self.stats.requests += 1
            self.stats.rejected += 1

    def finished(self, req, now: float, aborted: bool = False) -> None:
        """The request left the engine; aborted ones (client gone, stop strings are not aborts) are not
        counted."""
        t = self._tracks.pop(req.request_id, None)
        n = req.num_output_tokens
        if n and not aborted:
            self.mean_output = n if self.mean_output is None else (1 - EWMA) * self.mean_output + EWMA * n
        if t is None or aborted or t.first_token_at is None:
            return
        s = self.stats
        ttft = t.first_token_at - req.arrival_time
        tpot = (now - t.first_token_at) / (n - 1) if n > 1 else None
        if t.pred_ttft_s is not None:
            s.ttft_pred_error_s += abs(t.pred_ttft_s - ttft)
            s.ttft_measured_s += ttft
            s.ttft_count += 1
        if t.pred_tpot_s is not None and tpot is not None:
            s.tpot_pred_error_s += abs(t.pred_tpot_s - tpot)
            s.tpot_measured_s += tpot
            s.tpot_count += 1
        if t.ttft_s is None and t.tpot_s is None:
            return
        s.requests += 1
        s.met += (t.ttft_s is None or ttft <= t.ttft_s) and (t.tpot_s is None or tpot is None or tpot <= t.tpot_s)
