"""Logits processors, before the filters: OpenAI's logit_bias, vLLM's min_tokens, allowed_token_ids,
bad_words, thinking_token_budget and repetition / frequency / presence penalties, for a step's rows at once."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.sampling_params import SamplingParams


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
    """In place, before sampling: OpenAI's logit_bias; min_tokens (vLLM): the stop
    tokens (EOS unless ignore_eos, and stop_token_ids) are masked while the output is shorter than min_tokens;
    vLLM's allowed_token_ids and bad_words; then vLLM's repetition, frequency and presence penalties.
    Logprobs stay those of the raw model output (the caller keeps a copy), as vLLM reports them.

    Batched: the requests' entries are gathered first (Python lists), then each kind is one tensor op for
    the step: one index_put_ adding every bias, one setting every masked (row, token) to -inf, one
    masked_fill for the allowed_token_ids rows, one penalty pass. Each request's rows are its own, so the
    order across requests does not matter; within a request the order is the per-request one's (bias, then
    masks, then penalties), so the logits are the same bit for bit. A token id outside the vocabulary in
    logit_bias raises (IndexError) as before; the caller retries request by request."""
    V = logits.shape[-1]
    r = 0
    penalised: list[tuple[int, LogitsRows]] = []  # (first row, request)
    bias_rows, bias_ids, bias_vals = [], [], []
    masked_rows, masked_ids = [], []  # entries set to -inf: min_tokens' stop tokens, bad words
    allowed_rows, allowed_ids = [], []  # rows restricted to allowed_token_ids, and each one's allowed ids
    for req in rows:
        p, n_rows, n_out = req.params, req.num_rows, len(req.output_ids)
        if p.logit_bias:
            ids, vals = list(p.logit_bias), list(p.logit_bias.values())
            for j in range(n_rows):
                bias_rows += [r + j] * len(ids)
                bias_ids += ids
                bias_vals += vals
        short = min(n_rows, p.min_tokens - n_out)
        if short > 0 and req.stop_ids:
            ids = sorted(t for t in req.stop_ids if t < V)
            for j in range(short):
                masked_rows += [r + j] * len(ids)
                masked_ids += ids
        forced = [forced_end_of_thinking(p, req.output_ids + req.draft_ids[:j]) for j in range(n_rows)] \
            if p.has_thinking_budget else [None] * n_rows
        for j, token in enumerate(forced):  # the budget is spent: the end of thinking, whatever else allows
            if token is not None and token < V:
                allowed_rows.append(r + j)
                allowed_ids.append([token])
        if p.allowed_token_ids is not None:
            ids = [t for t in p.allowed_token_ids if t < V]
            free = [j for j in range(n_rows) if forced[j] is None]
            allowed_rows += [r + j for j in free]
            allowed_ids += [ids] * len(free)
        if p.bad_words_token_ids:  # a word's last token where the tokens before it end the output so far
            for j in range(n_rows):
                seen = req.output_ids + req.draft_ids[:j]
                for word in p.bad_words_token_ids:
                    head = word[:-1]
                    if word[-1] < V and (not head or seen[len(seen) - len(head):] == head):
                        masked_rows.append(r + j)
                        masked_ids.append(word[-1])
        if p.has_penalties:
            penalised.append((r, req))
        r += n_rows
    dev = logits.device
    if bias_rows:
        logits.index_put_((_long(bias_rows, dev), _long(bias_ids, dev)),
                          torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)
    if masked_rows:
        logits.index_put_((_long(masked_rows, dev), _long(masked_ids, dev)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), V, dtype=torch.bool, device=dev)
        keep[_long([k for k, ids in enumerate(allowed_ids) for _ in ids], dev),
             _long([t for ids in allowed_ids for t in ids], dev)] = True
        sel = _long(allowed_rows, dev)
        logits[sel] = logits.index_select(0, sel).masked_fill(~keep, float("-inf"))
    if penalised:  # rows are disjoint: penalising after every request's bias and mask is the same order
        _apply_penalties(logits, penalised)


def forced_end_of_thinking(p: SamplingParams, seen: list[int]) -> int | None:
    """vLLM's thinking_token_budget: the token the next row must be, once the thinking section that opens the
    output has used its budget and not ended (p.thinking_end_token_ids, possibly several tokens, forced one by
    one); None while it may go on, or once it ended."""
    end = p.thinking_end_token_ids
    if _find(seen, end) >= 0:
        return None
    started = next((k for k in range(min(len(end) - 1, len(seen)), 0, -1) if seen[-k:] == end[:k]), 0)
    return end[started] if len(seen) - started >= p.thinking_token_budget else None


def _find(seen: list[int], seq: list[int]) -> int:
    """Where seq first occurs in seen, or -1."""
    i, n = -1, len(seq)
    while True:  # list.index: the scan runs in C, not a Python loop per token
        try:
            i = seen.index(seq[0], i + 1)
        except ValueError:
            return -1
        if seen[i:i + n] == seq:
            return i


def _long(xs: list[int], device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(xs, dtype=np.int64)).to(device)


def _ids(lists: list[list[int]], n: int) -> torch.Tensor:
    """The concatenation of lists of token ids (n in all) as one int64 tensor (numpy: ~8x torch.tensor)."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=n))


def _entries(tokens: torch.Tensor, rows: list[int], starts: list[int], lengths: list[int], V: int) -> torch.Tensor:
    """Flat indices row * V + token into contiguous [R, V] logits: segment k gives row rows[k] the tokens
    tokens[starts[k]:starts[k] + lengths[k]]."""
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    k = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
    offset = torch.arange(k.numel()) - (lengths_t.cumsum(0) - lengths_t).index_select(0, k)
    start = torch.tensor(starts, dtype=torch.long).index_select(0, k)
    return torch.tensor(rows, dtype=torch.long).index_select(0, k) * V + tokens.index_select(0, start + offset)


def _apply_penalties(logits: torch.Tensor, penalised: list[tuple[int, LogitsRows]]) -> None:
    """logits [R, V], in place at the rows of the penalised requests ((first row, request)): row j of a
    request sees its outputs plus drafts 0..j-1 as generated (vLLM's definitions: repetition over prompt +
    generated, frequency and presence over the generated only).

    All the step's penalised rows at once, reading and writing only the (row, token) entries a penalty
    changes: the repetition penalty by one gather / where / scatter over the prompt and generated entries
    (an entry listed twice is written twice with the same value, computed from the logit before), then
    frequency and presence by one gather / subtract / scatter at the distinct generated entries with their
    counts. Per entry the arithmetic is the dense per-row formula's (divide or multiply by the penalty, then
    minus frequency x count + presence, in the logits' dtype), so the logits are the same bit for bit, and
    entries no penalty reaches are not touched. Token ids must be in the vocabulary (a larger one would
    index the next row): outputs and drafts are sampled from it, prompts are checked at admission."""
    R, V, dev, dtype = logits.shape[0], logits.shape[-1], logits.device, logits.dtype
    rep, freq, pres = [1.0] * R, [0.0] * R, [0.0] * R  # per row of logits
    gen_lists, g_rows, g_starts, g_lens, n_gen = [], [], [], [], 0
    prompt_lists, p_rows, p_starts, p_lens, n_prompt = [], [], [], [], 0
    for r, req in penalised:
        p, n_out, n_rows = req.params, len(req.output_ids), req.num_rows
        rep[r:r + n_rows] = [p.repetition_penalty] * n_rows
        freq[r:r + n_rows] = [p.frequency_penalty] * n_rows
        pres[r:r + n_rows] = [p.presence_penalty] * n_rows
        gen_lists += [req.output_ids, req.draft_ids]
        g_rows += range(r, r + n_rows)
        g_starts += [n_gen] * n_rows
        g_lens += range(n_out, n_out + n_rows)  # row j: the outputs and drafts 0..j-1
        n_gen += n_out + len(req.draft_ids)
        if p.repetition_penalty != 1.0:
            prompt_lists.append(req.prompt_ids)
            p_rows += range(r, r + n_rows)
            p_starts += [n_prompt] * n_rows
            p_lens += [len(req.prompt_ids)] * n_rows
            n_prompt += len(req.prompt_ids)
    work = logits if logits.is_contiguous() else logits.contiguous()
    flat = work.view(-1)
    gen = _entries(_ids(gen_lists, n_gen), g_rows, g_starts, g_lens, V).to(dev)
    if prompt_lists:
        entry = torch.cat([_entries(_ids(prompt_lists, n_prompt), p_rows, p_starts, p_lens, V).to(dev), gen])
        # rows whose request has repetition_penalty 1 (their generated entries are here) divide by 1: a no-op
        penalty = torch.tensor(rep, dtype=dtype, device=dev).index_select(0, entry // V)
        x = flat.index_select(0, entry)
        flat[entry] = torch.where(x > 0, x / penalty, x * penalty)
    if gen.numel() and (any(freq) or any(pres)):
        entry, count = torch.unique(gen, return_counts=True)
        row = entry // V
        f = torch.tensor(freq, dtype=dtype, device=dev).index_select(0, row)
        pp = torch.tensor(pres, dtype=dtype, device=dev).index_select(0, row)
        flat[entry] = flat.index_select(0, entry) - (f * count.to(dtype) + pp)
    if work is not logits:
        logits.copy_(work)
