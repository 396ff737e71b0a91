"""Results of the offline API, with vLLM's names and shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token id: logprob}
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (the most of its n samples)
    # prompt_logprobs: None for the first prompt token, then {token id: logprob} (the token and the top-N)
    prompt_logprobs: list[dict[int, float] | None] | None = None
