"""Sampling parameters, with vLLM's names and defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeserve.config import LOGPROBS_MODES
from moeserve.markers import THINK_END
from moeserve.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "SamplingParamsError", "StructuredOutputsParams", "GuidedDecodingParams"]

INT64_MAX = 2**63 - 1
# repetition_penalty divides positive logits and multiplies negative ones: outside this range one factor
# scales a logit by more than 100x (vLLM accepts any value > 0, but 1e-300 is 0 in float32: x / 0 = inf).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `param` names it (the HTTP error body's "param")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Validated on construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # top logprobs per prompt token (vLLM's; the first token has none)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI)
    # vLLM's penalties: presence / frequency (OpenAI's) over the generated tokens, repetition (CTRL's:
    # positive logits divided by it, negative ones multiplied) over prompt and generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Guided decoding (vLLM's): the output must match a JSON schema, a regex, a choice or any JSON object.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name; moved to structured_outputs
    # vLLM's: sample only among these token ids; never complete one of these words (token sequences)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # bad_words tokenized (with_tokenizer fills it)
    # vLLM's: at most this many tokens of thinking; then the end-of-thinking tokens are forced (the output
    # starts inside the thinking section; thinking_end_token_ids: that section's end, e.g. "</think>" tokenized;
    # with_tokenizer fills it, the chat server sets it only for a request that thinks)
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[int] | None = None
    detokenize: bool = True  # False: outputs carry token ids, no text (stop strings need text)
    output_kind: int = 0  # vLLM's RequestOutputKind: 0 CUMULATIVE (offline generate returns final outputs)
    extra_args: dict | None = None  # free-form data for custom processors; moeserve has none, so it must be empty
    # the engine's --logprobs-mode, which the front end (LLM, the API server) sets on each request it sends: the
    # sampler reads it per row (None: raw_logprobs, vLLM's default)
    logprobs_mode: str | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise SamplingParamsError("give structured_outputs or guided_decoding, not both", "guided_decoding")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        ints = {"n": self.n, "top_k": self.top_k, "min_tokens": self.min_tokens}
        ints.update({k: v for k, v in (("max_tokens", self.max_tokens), ("seed", self.seed),
                                        ("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs))
                     if v is not None})
        for name, v in ints.items():
            if not _is_int(v):
                raise SamplingParamsError(f"{name} must be an integer, got {v!r}", name)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not _is_real(getattr(self, name)):
                raise SamplingParamsError(f"{name} must be a number, got {getattr(self, name)!r}", name)
        checks = [
            ("n", self.n >= 1, f"n must be >= 1, got {self.n}"),
            ("temperature", 0.0 <= self.temperature < math.inf,
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k == -1 or 1 <= self.top_k <= INT64_MAX,
             f"top_k must be -1 (disabled) or a positive 64-bit integer, got {self.top_k}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            ("max_tokens", self.max_tokens is None or 1 <= self.max_tokens <= INT64_MAX,
             f"max_tokens must be at least 1 (and fit 64 bits), got {self.max_tokens}"),
            ("min_tokens", 0 <= self.min_tokens <= INT64_MAX,
             f"min_tokens must be >= 0 (and fit 64 bits), got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            ("seed", self.seed is None or -(2**63) <= self.seed <= INT64_MAX,
             f"seed must be a 64-bit signed integer, got {self.seed}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                self.allowed_token_ids and all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids (non-negative integers)"),
            ("logit_bias", all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.logit_bias),
             "logit_bias keys must be token ids (non-negative integers)"),
            ("logit_bias", all(_is_real(b) and math.isfinite(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
             "logit_bias values must be numbers in [-100, 100]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 = off), "
             f"got {self.repetition_penalty}"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        self._validate_structured_outputs()
        self._validate_vllm_extras()

    def _validate_vllm_extras(self) -> None:
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise SamplingParamsError("bad_words must be non-empty strings", "bad_words")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
            if not all(w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_token_ids):
                raise SamplingParamsError("bad_words_token_ids must be non-empty lists of token ids", "bad_words")
        if self.thinking_token_budget is not None and not (_is_int(self.thinking_token_budget)
                                                           and 0 <= self.thinking_token_budget <= INT64_MAX):
            raise SamplingParamsError("thinking_token_budget must be a non-negative integer, got "
                                      f"{self.thinking_token_budget!r}", "thinking_token_budget")
        if self.thinking_end_token_ids is not None:
            self.thinking_end_token_ids = list(self.thinking_end_token_ids)
            if not (self.thinking_end_token_ids and all(_is_int(t) and t >= 0 for t in self.thinking_end_token_ids)):
                raise SamplingParamsError("thinking_end_token_ids must be a non-empty list of token ids",
                                          "thinking_token_budget")
        if not isinstance(self.detokenize, bool):
            raise SamplingParamsError("detokenize must be True or False", "detokenize")
        if not self.detokenize and self.stop:
            raise SamplingParamsError("stop strings need detokenize=True (use stop_token_ids)", "stop")
        if self.output_kind not in (0, 2):
            raise SamplingParamsError("output_kind: LLM.generate returns finished outputs, so only CUMULATIVE (0) "
                                      "and FINAL_ONLY (2) are meaningful here; DELTA (1) is not supported",
                                      "output_kind")
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise SamplingParamsError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                                      f"{self.logprobs_mode!r}", "logprobs_mode")
        if self.extra_args:
            raise SamplingParamsError(f"extra_args {sorted(self.extra_args)}: moeserve has no custom logits "
                                      "processors to read them", "extra_args")

    def with_tokenizer(self, tokenizer) -> "SamplingParams":
        """Fill bad_words_token_ids from bad_words as vLLM does: each word as written and with a leading
        space (the form it takes mid-sentence), once each; and thinking_end_token_ids ("</think>") for a
        thinking_token_budget."""
        if self.thinking_token_budget is not None and self.thinking_end_token_ids is None:
            if tokenizer is None:
                raise SamplingParamsError("thinking_token_budget needs a tokenizer (not skip_tokenizer_init)",
                                          "thinking_token_budget")
            self.thinking_end_token_ids = tokenizer.encode(THINK_END, add_special_tokens=False)
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        if tokenizer is None:
            raise SamplingParamsError("bad_words need a tokenizer (not skip_tokenizer_init)", "bad_words")
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = seqs
        return self

    @property
    def has_token_masks(self) -> bool:
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids) or self.has_thinking_budget

    @property
    def has_thinking_budget(self) -> bool:
        return self.thinking_token_budget is not None and bool(self.thinking_end_token_ids)

    def _validate_structured_outputs(self) -> None:
        from moeserve.structured.params import compile_params, compiling_allowed
        from moeserve.structured.errors import PatternError
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams", "structured_outputs")
        if not compiling_allowed():  # decoded in an engine process: its builder compiled it (and sent it)
            return
        try:
            compile_params(so)  # a bad pattern is the caller's error, before the engine sees it
        except PatternError as e:
            raise SamplingParamsError(f"structured output ({so.describe()}): {e}", "structured_outputs") from None

    def child_seed(self, i: int) -> int | None:
        """Seed of the i-th of n samples (seed + i, wrapped into 64 bits)."""
        if self.seed is None:
            return None
        return (self.seed + i + 2**63) % 2**64 - 2**63

    def for_sample(self, i: int) -> "SamplingParams":
        """The params of the i-th of n samples: one sample, seeded with child_seed(i)."""
        return SamplingParams(**{**self.__dict__, "n": 1, "seed": self.child_seed(i)})

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def logprobs_processed(self) -> bool:
        """logprobs of the logits sampling draws from (--logprobs-mode processed_*), not the model's own."""
        return self.logprobs_mode in ("processed_logprobs", "processed_logits")

    @property
    def logprobs_as_logits(self) -> bool:
        """logprobs report the logits themselves (--logprobs-mode *_logits), not their log-softmax."""
        return self.logprobs_mode in ("raw_logits", "processed_logits")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def all_stop_token_ids(self, eos_token_ids: list[int]) -> set[int]:
        """Token ids that end this request (EOS unless ignore_eos, plus stop_token_ids)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids
