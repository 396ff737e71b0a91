"""Messages that cross process boundaries, as msgspec structs (msgpack on the wire, never pickle)."""
from __future__ import annotations

import msgspec

from moeserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0


class TokenLogprobsMsg(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobsMsg] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    error: str | None = None  # set when the request was rejected


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    outstanding_tokens: int = 0
