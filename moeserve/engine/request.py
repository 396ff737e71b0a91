"""A request as the engine core tracks it.

One scheduling model (vLLM v1): a request has `num_computed_tokens` catching up to `num_tokens`
(prompt + generated). Prefill, chunked prefill, decode and recompute after preemption are all the same
thing: schedule some of the missing tokens; when the request has caught up, the model samples one more.
With speculative decoding a caught-up request also schedules its drafts (spec_token_ids) after the missing
token; the accepted ones become output tokens and num_computed_tokens moves past them.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moeserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step (MTP)
    hold_kv: bool = False  # PD prefill: keep the KV blocks at the finish for a decode instance to pull
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # prompt_logprobs: entries for prompt tokens 1.. computed so far (kept over preemption; sent with token 1)
    prompt_logprobs: list = field(default_factory=list)
    priority: int = 0  # --scheduling-policy priority: lower values are admitted first
    cache_salt: str | None = None  # prefix-cache blocks are shared only among requests with the same salt
    first_scheduled_time: float | None = None  # time.monotonic() of its first step (queue-time metric)
    grammar: object = None  # structured output: a structured.matcher.GuidanceMatcher, set by the engine core
    slo_ttft_ms: float | None = None  # this request's targets (engine/slo.py); None: the engine's default
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        self._stop_ids = self.sampling_params.all_stop_token_ids(self.eos_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_missing_tokens(self) -> int:
        """Tokens whose KV is not yet computed (1 for a request in steady decode)."""
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def stop_ids(self) -> set[int]:
        """Token ids that end this request (EOS unless ignore_eos, plus stop_token_ids)."""
        return self._stop_ids

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Status after the newest token was appended, or None to keep generating."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        # A structured request samples a stop token before min_tokens only when its pattern is complete
        # and nothing can follow (structured/grammar.py): it ends there.
        if last in self._stop_ids and (self.num_output_tokens >= params.min_tokens or self.grammar is not None):
            if last in params.stop_token_ids:
                self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
