"""The per-request sampling loop moeserve had before the batched package (moeserve/layers/sampler.py at
commit 22b2f4d), copied unchanged except for the names: what the batched code must reproduce."""
from __future__ import annotations

import torch

from moeserve.sampling_params import SamplingParams


def old_apply_filters(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = torch.where(torch.isinf(logits), logits, logits / p.temperature)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class OldSamplingError(ValueError):
    pass


def old_draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise OldSamplingError("not finite")
    return int(torch.multinomial(probs, 1, generator=generator))


def old_sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               shared: torch.Generator) -> list[int | None]:
    """The old Sampler.__call__'s tokens (None where it recorded an error)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            try:
                tokens[i] = old_draw(old_apply_filters(logits[i], p).softmax(-1), generators[i] or shared)
            except OldSamplingError:
                tokens[i] = None
    return tokens


def old_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list:
    logp = logits.log_softmax(dim=-1)
    out = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        top = logp[i].topk(min(p.logprobs, logp.shape[-1])) if p.logprobs else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out.append((tokens[i], float(logp[i, tokens[i]]), pairs))
    return out


def old_rejection_sample(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                         generator: torch.Generator) -> list[int]:
    probs = torch.stack([old_apply_filters(row, params).softmax(-1) for row in logits])
    accept_u = torch.rand(len(drafts), generator=generator)
    out: list[int] = []
    for j, x in enumerate(drafts):
        if accept_u[j] * 1.0 < probs[j, x]:
            out.append(x)
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        if float(residual.sum()) <= 0.0:
            residual = probs[j]
        out.append(old_draw(residual, generator))
        return out
    out.append(old_draw(probs[len(drafts)], generator))
    return out


def old_apply_logits_processors(logits: torch.Tensor, rows) -> None:
    """apply_logits_processors' request-by-request loop (bias, min_tokens and token masks per request),
    with the dense per-request penalties of benchmarks/penalties.py."""
    r = 0
    for req in rows:
        p, n_rows, n_out = req.params, req.num_rows, len(req.output_ids)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            logits[r:r + n_rows, ids] += bias
        short = min(n_rows, p.min_tokens - n_out)
        if short > 0 and req.stop_ids:
            ids = torch.tensor(sorted(t for t in req.stop_ids if t < logits.shape[-1]), dtype=torch.long)
            logits[r:r + short, ids] = float("-inf")
        if p.has_token_masks:
            V = logits.shape[-1]
            if p.allowed_token_ids is not None:
                keep = torch.zeros(V, dtype=torch.bool)
                keep[torch.tensor([t for t in p.allowed_token_ids if t < V], dtype=torch.long)] = True
                logits[r:r + req.num_rows].masked_fill_(~keep, float("-inf"))
            for j in range(req.num_rows):
                seen = req.output_ids + req.draft_ids[:j]
                for word in p.bad_words_token_ids or ():
                    head = word[:-1]
                    if word[-1] < V and (not head or seen[len(seen) - len(head):] == head):
                        logits[r + j, word[-1]] = float("-inf")
        if p.has_penalties:
            _old_penalties(logits[r:r + n_rows], req)
        r += n_rows


def _old_penalties(logits: torch.Tensor, req) -> None:
    p = req.params
    generated = torch.tensor(req.output_ids + req.draft_ids, dtype=torch.long)
    n_out = len(req.output_ids)
    counts = torch.zeros(logits.shape, dtype=logits.dtype)
    for j in range(logits.shape[0]):
        counts[j].scatter_add_(0, generated[: n_out + j], torch.ones(n_out + j, dtype=logits.dtype))
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(req.prompt_ids, dtype=torch.long)] = True
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty,
                                                   logits * p.repetition_penalty), logits))
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
