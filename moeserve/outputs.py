"""Results of the offline API, with vLLM's names and shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """vLLM's Logprob: .logprob, .rank (1 = the most likely token; None when the token is outside the
    top-N moeserve computed) and .decoded_token. It is also the float of its logprob, as moeserve's
    {token id: logprob} dicts were before, so arithmetic on it keeps working."""

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def logprob_dict(token_id: int, logprob: float, top: list[tuple[int, float]], decode=None) -> dict[int, Logprob]:
    """{token id: Logprob} for one position: the top-N (best first, ranks 1..N) and the chosen token."""
    out = {t: Logprob(lp, i + 1, decode(t) if decode else None) for i, (t, lp) in enumerate(top)}
    if token_id not in out:
        out[token_id] = Logprob(logprob, None, decode(token_id) if decode else None)
    return out


@dataclass
class Metric:
    """One sample of LLM.get_metrics() (vLLM's metrics reader: name, labels, value)."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: {token id: Logprob}
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
    # prompt_logprobs: None for the first prompt token, then {token id: Logprob} (the token and the top-N)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
