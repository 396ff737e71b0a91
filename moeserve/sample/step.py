"""A model runner step's sampling: logits of the rows that sample -> tokens, logprobs, failures.

The model runner calls StepSampler.sample(hidden, sample_rows, result) after the forward and
StepSampler.prompt_logprobs for the prompt rows; everything between the final hidden states and the
tokens is here: the non-finite checks that fail one request alone, the logits processors (with their
request-by-request retry), grammar masks, the batched draw (plain or MTP rejection sampling) and logprobs.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from moeserve.sample.logprobs import TokenLogprobs, token_logprobs
from moeserve.sample.processors import LogitsRows, apply_logits_processors
from moeserve.sample.sampler import Sampler, path_order, processed_logits
from moeserve.structured.grammar import apply_grammar_masks

logger = logging.getLogger(__name__)


class StepSampler:
    """compute_logits: final hidden states [n, H] -> float32 logits [n, V] (the model's lm_head)."""

    PROMPT_LOGITS_ROWS = 512  # logits rows per slice: a long prompt's [T, vocab] would not fit at once

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor], seed: int = 0,
                 speculative: bool = False) -> None:
        self.compute_logits = compute_logits
        self.sampler = Sampler(seed)
        self.rejection_sampler = None
        if speculative:
            from moeserve.sample.rejection import RejectionSampler
            self.rejection_sampler = RejectionSampler(seed)
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def generator(self, req, vocab_size: int) -> torch.Generator | None:
        """The request's own generator (seeded requests), created at its first draw."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        if req.request_id not in self.generators:
            g = self.generators[req.request_id] = torch.Generator().manual_seed(seed)
            if req.output_token_ids and self.rejection_sampler is None and not req.sampling_params.greedy:
                # Resumed after an engine restart (protocol.EngineCoreRequest.output_token_ids): each earlier
                # token drew one row of Exp(1) noise (draw.exponential_noise); drawing them again puts the generator
                # where the dead engine's was, so the seed gives the same tokens (not with MTP's rejection
                # sampler, whose draws depend on the drafts: docs/serving.md).
                row = torch.empty(vocab_size)
                for _ in req.output_token_ids:
                    row.exponential_(1, generator=g)
        return self.generators[req.request_id]

    def sample(self, hidden: torch.Tensor, sample_rows: list, result) -> None:
        """sample_rows: (rows, ScheduledRequest), rows = [d + 1] logits rows of a request with d drafts;
        fills result.sampled, .logprobs and .failed (a model_runner.StepResult).

        What one request carries can only fail that request (result.failed): logits that are not finite
        from the model, or after its processors and grammar, a grammar that raises, a row that cannot be
        sampled. Its rows are dropped before sampling; the other requests are sampled as if it was absent."""
        if self.rejection_sampler is None:  # each sampling path's rows together: slices of the logits, not copies
            sample_rows = [sample_rows[i] for i in path_order([s.request.sampling_params for _, s in sample_rows])]
        row_ids = torch.tensor([r for rows, _ in sample_rows for r in rows])
        logits = self.compute_logits(hidden[row_ids])
        reqs = [s.request for _, s in sample_rows]
        params = [r.sampling_params for r in reqs]
        spans = _spans([len(rows) for rows, _ in sample_rows])
        failed: dict[int, tuple[str, str]] = {}  # request index -> (kind, message)
        for i in _requests_with(non_finite_rows(logits), spans):
            failed[i] = ("internal", "the model's logits for this request are not finite (NaN or inf)")
        raw, processed = logits, False
        # raw logprobs report the model's own distribution: the logits are copied first only when a request that
        # wants them has processors or a grammar (the others' rows are never written)
        touched = [bool(p.logit_bias or p.min_tokens or p.has_penalties or p.has_token_masks) for p in params]
        if any(touched):
            if any(t and _wants_raw(p) for t, p in zip(touched, params)):
                raw = logits.clone()
            logits = self._logits_processors(logits, hidden[row_ids], sample_rows, spans, failed)
            processed = True
        if any(r.grammar is not None for r in reqs):
            if raw is logits and any(r.grammar is not None and _wants_raw(p) for r, p in zip(reqs, params)):
                raw = logits.clone()
            errors: dict[int, str] = {}
            apply_grammar_masks(logits, [(s.request.grammar, s.request.output_token_ids, s.draft_token_ids,
                                          sorted(s.request.stop_ids), s.request.eos_token_ids)
                                         for _, s in sample_rows], errors)
            failed.update({i: ("internal", m) for i, m in errors.items() if i not in failed})
            processed = True
        if processed:  # the model's own logits were checked above
            for i in _requests_with(non_finite_rows(logits), spans):
                if i not in failed:
                    failed[i] = ("invalid", _non_finite_message(logits[spans[i][0]:spans[i][1]], params[i]))
        if failed:
            keep = [i for i in range(len(reqs)) if i not in failed]
            for i, (kind, message) in failed.items():
                result.failed[reqs[i].request_id] = (kind, message)
            if not keep:
                return
            rows = torch.tensor([r for i in keep for r in range(*spans[i])])
            logits, raw = logits[rows], (raw[rows] if raw is not logits else None)
            sample_rows, reqs, params = ([x[i] for i in keep] for x in (sample_rows, reqs, params))
            raw = logits if raw is None else raw
        if any(p.logprobs is not None and p.logprobs_processed for p in params):
            raw = _with_processed(logits, raw, [len(rows) for rows, _ in sample_rows], params)
        self._draw(logits, raw, sample_rows, reqs, params, result)

    def _draw(self, logits: torch.Tensor, raw: torch.Tensor, sample_rows: list, reqs: list, params: list,
              result) -> None:
        gens = [self.generator(r, logits.shape[-1]) for r in reqs]
        errors: dict[int, str] = {}
        if self.rejection_sampler is None:
            tokens, lps = self.sampler(logits, params, gens, raw, errors, writable=True)  # logits: this step's own
            emitted = [[t] for t in tokens]
        else:
            emitted = self.rejection_sampler(logits, [s.draft_token_ids for _, s in sample_rows], params, gens,
                                             errors)
            lps = _spec_logprobs(raw, [len(rows) for rows, _ in sample_rows], emitted, params)
        i = 0
        for j, (req, toks) in enumerate(zip(reqs, emitted)):
            if j in errors:
                result.failed[req.request_id] = ("invalid", errors[j])
            else:
                result.sampled[req.request_id] = toks
                if req.sampling_params.logprobs is not None:
                    result.logprobs[req.request_id] = lps[i: i + len(toks)]
            i += len(toks)

    def _logits_processors(self, logits: torch.Tensor, hidden: torch.Tensor, sample_rows: list, spans: list,
                           failed: dict) -> torch.Tensor:
        """logit_bias, min_tokens and penalties for all rows at once; should that raise, again from fresh
        logits one request at a time, so only the request whose data raised fails."""
        rows = [LogitsRows(s.request.sampling_params, s.request.stop_ids, s.request.prompt_token_ids,
                           s.request.output_token_ids, s.draft_token_ids) for _, s in sample_rows]
        try:
            apply_logits_processors(logits, rows)
            return logits
        except Exception:  # noqa: BLE001 - find the request that raised below
            logger.exception("logits processors failed for a batch; retrying request by request")
        logits = self.compute_logits(hidden)
        for i, ((a, b), row) in enumerate(zip(spans, rows)):
            try:
                apply_logits_processors(logits[a:b], [row])
            except Exception as e:  # noqa: BLE001
                failed.setdefault(i, ("internal", f"its logits processors failed: {type(e).__name__}: {e}"))
        return logits

    def prompt_logprobs(self, out, hidden: torch.Tensor, result) -> None:
        """prompt_logprobs: position p's logits score prompt token p + 1, for every request of the step at
        once (in slices of PROMPT_LOGITS_ROWS rows). Positions whose entry the request already has (a
        recompute after preemption) are skipped."""
        segments = []  # (request, first hidden row, first prompt position, end position)
        row = 0
        for s in out.scheduled:
            req, first_row = s.request, row
            row += s.num_tokens
            if req.sampling_params.prompt_logprobs is None:
                continue
            lo = max(s.start, len(req.prompt_logprobs))
            hi = min(s.start + s.num_tokens - len(s.draft_token_ids), req.num_prompt_tokens - 1)
            if lo < hi:
                segments.append((req, first_row - s.start, lo, hi))
        if not segments:
            return
        rows, targets, num_top, owner, as_logits = [], [], [], [], []
        for k, (req, offset, lo, hi) in enumerate(segments):
            rows.extend(range(offset + lo, offset + hi))
            targets.extend(req.prompt_token_ids[lo + 1: hi + 1])
            num_top.extend([req.sampling_params.prompt_logprobs] * (hi - lo))
            # processed_* as raw_*: no processor applies to the prompt (vLLM's rule)
            as_logits.extend([req.sampling_params.logprobs_as_logits] * (hi - lo))
            owner.extend([k] * (hi - lo))
        entries: list[TokenLogprobs] = []
        for a in range(0, len(rows), self.PROMPT_LOGITS_ROWS):
            b = min(len(rows), a + self.PROMPT_LOGITS_ROWS)
            logits = self.compute_logits(hidden[torch.tensor(rows[a:b])])
            entries += token_logprobs(logits, targets[a:b], num_top[a:b], as_logits=as_logits[a:b])
        for k, (req, *_rest) in enumerate(segments):
            result.prompt_logprobs[req.request_id] = [e for e, o in zip(entries, owner) if o == k]


def _spec_logprobs(logits: torch.Tensor, num_rows: list[int], emitted: list[list[int]], params: list) -> list:
    """Emitted token j of a request comes from its row j (the distribution it was drawn from)."""
    if all(p.logprobs is None for p in params):
        return [None] * sum(len(t) for t in emitted)
    first = _spans(num_rows)
    sel = [f + j for (f, _), toks in zip(first, emitted) for j in range(len(toks))]
    return token_logprobs(logits[sel], [t for toks in emitted for t in toks],
                          [p.logprobs for p, toks in zip(params, emitted) for _ in toks],
                          as_logits=[p.logprobs_as_logits for p, toks in zip(params, emitted) for _ in toks])


def _wants_raw(p) -> bool:
    """The request reports logprobs of the model's own logits (--logprobs-mode raw_*)."""
    return p.logprobs is not None and not p.logprobs_processed


def _with_processed(logits: torch.Tensor, raw: torch.Tensor, num_rows: list[int], params: list) -> torch.Tensor:
    """What logprobs read: raw, with the rows of the requests that report processed logprobs replaced by the
    logits their tokens are drawn from (sampler.processed_logits). A copy when raw is logits: the draw writes
    logits."""
    out = raw.clone() if raw is logits else raw
    rows = [r for (a, b), p in zip(_spans(num_rows), params) if p.logprobs is not None and p.logprobs_processed
            for r in range(a, b)]
    sel = torch.tensor(rows)
    row_params = [p for p, n in zip(params, num_rows) for _ in range(n)]
    out[sel] = processed_logits(logits.index_select(0, sel), [row_params[r] for r in rows])
    return out


def non_finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [R]: rows that cannot be sampled: a NaN or +inf entry, or every entry -inf (masked). A -inf
    entry alone is a masked token, not an error. All three show in the row's maximum (max propagates NaN):
    one reduction instead of three elementwise passes."""
    return ~torch.isfinite(logits.amax(-1))


def _spans(num_rows: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each request's logits rows."""
    out, r = [], 0
    for n in num_rows:
        out.append((r, r + n))
        r += n
    return out


def _requests_with(bad_rows: torch.Tensor, spans: list[tuple[int, int]]) -> list[int]:
    """Indices of the requests that have a bad row."""
    if not bool(bad_rows.any()):
        return []
    bad = set(torch.nonzero(bad_rows).flatten().tolist())
    return [i for i, (a, b) in enumerate(spans) if any(r in bad for r in range(a, b))]


def _non_finite_message(rows: torch.Tensor, p) -> str:
    """Why a request's processed logits cannot be sampled, naming what it can change."""
    if bool(torch.isnan(rows).any() | torch.isposinf(rows).any()):
        return (f"its sampling parameters made its logits non-finite (repetition_penalty={p.repetition_penalty}, "
                f"frequency_penalty={p.frequency_penalty}, presence_penalty={p.presence_penalty}, "
                f"logit_bias of {len(p.logit_bias)} tokens); use values closer to the defaults")
    return ("every token is masked, so nothing can be sampled (allowed_token_ids, bad_words, logit_bias, "
            "min_tokens and the structured output together allow no token); widen allowed_token_ids or drop "
            "one of them")
