"""Turns engine-core token outputs into text: incremental detokenization and stop strings.

Stop strings are matched here, on text, as in vLLM; a match ends the request (the caller aborts it in the
engine core). While a request with stop strings runs, the last len(longest stop) - 1 characters are held
back, so a stop string that arrives over several tokens never has to retract text already streamed.
Used by the offline LLM and by every API server process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.protocol import EngineCoreOutput
from moeserve.sampling_params import SamplingParams


@dataclass
class DetokState:
    params: SamplingParams
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0         # characters of `text` already handed out in deltas
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # TokenLogprobsMsg per prompt token 1.. (prompt_logprobs requests)
    complete_len: int = 0  # characters the tokens so far complete (the text less an unfinished last character)


@dataclass
class Delta:
    """What one engine output added to a request."""

    text: str
    token_ids: list[int]
    logprobs: list
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    final: DetokState | None = None  # the request's whole state, once it finished (it is dropped here)
    kv_transfer_params: dict | None = None  # a PD prefill's answer: where its KV waits (disagg/params.py)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list | None = None  # with a request's first tokens, when it asked for them
    # logprobs requests: where each of token_ids starts in the request's text (completions' text_offset)
    text_offsets: list[int] = field(default_factory=list)


def complete_part(text: str) -> str:
    """The text less an unfinished UTF-8 sequence at its end, which decodes to one U+FFFD."""
    return text[:-1] if text.endswith("\ufffd") else text


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DetokState] = {}

    def add(self, request_id: str, params: SamplingParams, prompt_len: int) -> None:
        self.states[request_id] = DetokState(params, prompt_len)

    def process(self, out: EngineCoreOutput) -> tuple[Delta, bool]:
        """Apply one output. Returns (delta, hit_stop_string); a stop-string hit must be aborted upstream."""
        st = self.states[out.request_id]
        new_ids, new_lps = list(out.new_token_ids), list(out.new_logprobs or [])
        base, base_lp = len(st.token_ids), len(st.logprobs)
        st.token_ids.extend(new_ids)
        st.logprobs.extend(new_lps)
        if out.prompt_logprobs is not None:
            st.prompt_logprobs = list(out.prompt_logprobs)
        full = self._decode(st, st.token_ids)
        complete_before, st.complete_len = st.complete_len, len(complete_part(full))
        finished = out.finish_reason is not None
        if not finished and full.endswith("\ufffd"):
            full = full[: len(full.rstrip("\ufffd"))]  # an incomplete UTF-8 sequence: wait for more bytes
        hit = self._find_stop(st, full)
        if hit is not None:
            at, stop = hit
            cut = at + len(stop) if st.params.include_stop_str_in_output else at
            full, finished = full[:cut], True
            st.finish_reason, st.stop_reason = "stop", stop
            # Speculative decoding hands over several tokens at once: keep them only up to the one that
            # completed the stop string, as plain decoding would have stopped there.
            keep = next((j for j in range(1, len(new_ids))
                         if len(self._decode(st, st.token_ids[:base + j])) >= at + len(stop)), len(new_ids))
            if keep < len(new_ids):
                del st.token_ids[base + keep:]
                del st.logprobs[base_lp + keep:]
                new_ids, new_lps = new_ids[:keep], new_lps[:keep]
        elif finished:
            st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
        st.text = full
        hold = 0 if finished or not st.params.stop else max(len(x) for x in st.params.stop) - 1
        upto = max(st.sent, len(full) - hold)
        delta_text, st.sent = full[st.sent:upto], upto
        delta = Delta(delta_text, new_ids, new_lps, finished, st.finish_reason, st.stop_reason,
                      kv_transfer_params=out.kv_transfer_params, num_cached_tokens=out.num_cached_tokens,
                      prompt_logprobs=out.prompt_logprobs)
        if st.params.logprobs is not None and new_ids:
            delta.text_offsets = self._offsets(st, base, len(new_ids), complete_before,
                                               len(full) if hit is not None else None)
        if finished:
            delta.final = self.states.pop(out.request_id)
        return delta, hit is not None and out.finish_reason is None

    def _offsets(self, st: DetokState, base: int, n: int, first: int, cut: int | None) -> list[int]:
        """Character offset in the text of each new token's start: the characters the tokens before it
        complete (first: those before this output). A token whose bytes finish a character begun by the one
        before starts at that character, so the slices between consecutive offsets are what each token added
        to the text and concatenate to it (offsets from per-token strings drifted: a partial character
        decodes to U+FFFD on its own). Several new tokens (MTP) decode the text up to each one; offsets
        past a stop string's cut are capped there."""
        out = [first] + [len(complete_part(self._decode(st, st.token_ids[:base + j]))) for j in range(1, n)]
        return out if cut is None else [min(o, cut) for o in out]

    def _decode(self, st: DetokState, ids: list[int]) -> str:
        if self.tokenizer is None or not getattr(st.params, "detokenize", True):  # token ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=st.params.skip_special_tokens)

    @staticmethod
    def _find_stop(st: DetokState, text: str) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string that ends in text this output added (older
        text was checked before, or came before min_tokens, when stop strings do not count: vLLM)."""
        if not st.params.stop or len(st.token_ids) < st.params.min_tokens:
            return None
        best = None
        for s in st.params.stop:
            i = text.find(s, max(0, len(st.text) - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        return best
