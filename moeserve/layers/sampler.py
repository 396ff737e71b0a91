"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, top-N logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def apply_filters(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled, filtered logits [V] for one request (masked entries are -inf)."""
    # Masked (-inf) entries stay masked: -inf / a temperature that overflows float32 would be NaN.
    logits = torch.where(torch.isinf(logits), logits, logits / p.temperature)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # and always the best token (a top_p that rounds to 0 in float32 would drop all)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


@dataclass
class LogitsRows:
    """One request's rows of a step's logits: row j samples its output token number len(output_ids) + j,
    after the drafts before it (MTP: row j is used only when drafts 0..j-1 were accepted)."""

    params: SamplingParams
    stop_ids: set[int]
    prompt_ids: list[int]
    output_ids: list[int]
    draft_ids: list[int]  # one fewer than the rows

    @property
    def num_rows(self) -> int:
        return len(self.draft_ids) + 1


def apply_logits_processors(logits: torch.Tensor, rows: list[LogitsRows]) -> None:
    """In place, before sampling: OpenAI's logit_bias; min_tokens (vLLM): the stop tokens (EOS unless
    ignore_eos, and stop_token_ids) are masked while the output is shorter than min_tokens; then vLLM's
    repetition, frequency and presence penalties. Logprobs stay those of the raw model output (the caller
    keeps a copy), as vLLM reports them."""
    r = 0
    for req in rows:
        p, n_rows, n_out = req.params, req.num_rows, len(req.output_ids)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[r:r + n_rows, ids] += bias
        short = min(n_rows, p.min_tokens - n_out)
        if short > 0 and req.stop_ids:
            ids = torch.tensor(sorted(t for t in req.stop_ids if t < logits.shape[-1]), dtype=torch.long,
                               device=logits.device)
            logits[r:r + short, ids] = float("-inf")
        if p.has_penalties:
            _apply_penalties(logits[r:r + n_rows], req)
        r += n_rows


def _apply_penalties(logits: torch.Tensor, req: LogitsRows) -> None:
    """logits [rows, V]: row j sees the outputs plus drafts 0..j-1 as generated (vLLM's definitions:
    repetition over prompt + output, frequency and presence over the output only)."""
    p = req.params
    generated = torch.tensor(req.output_ids + req.draft_ids, dtype=torch.long)  # sampled: all in vocabulary
    n_out = len(req.output_ids)
    counts = torch.zeros(logits.shape, dtype=logits.dtype)
    for j in range(logits.shape[0]):
        counts[j].scatter_add_(0, generated[: n_out + j], torch.ones(n_out + j, dtype=logits.dtype))
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(req.prompt_ids, dtype=torch.long)] = True  # checked against the vocabulary
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty,
                                                   logits * p.repetition_penalty), logits))
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 raw_logits: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [B, V] float32 -> one token per row, plus logprobs (of raw_logits, default logits)."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                probs = apply_filters(logits[i], p).softmax(-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i] or self.generator))
        return tokens, self.logprobs(logits if raw_logits is None else raw_logits, params, tokens)

    @staticmethod
    def logprobs(logits: torch.Tensor, params: list[SamplingParams],
                 tokens: list[int]) -> list[TokenLogprobs | None]:
        """Logprobs of the raw model distribution (as vLLM and OpenAI report them)."""
        want = [p.logprobs is not None for p in params]
        if not any(want):
            return [None] * len(params)
        logp = logits.log_softmax(dim=-1)
        out: list[TokenLogprobs | None] = []
        for i, p in enumerate(params):
            if not want[i]:
                out.append(None)
                continue
            top = logp[i].topk(p.logprobs) if p.logprobs else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out.append(TokenLogprobs(tokens[i], float(logp[i, tokens[i]]), pairs))
        return out
