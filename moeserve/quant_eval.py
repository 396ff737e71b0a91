"""Accuracy of a quantized model against its high-precision original on the same inputs.

- Teacher-forced, on held-out text (windows scored with EngineCore.score, all-position logits): cosine
  similarity of the logit vectors, top-1 (argmax) agreement, and each model's perplexity.
- Greedy: the reference's greedy continuation of each prompt (default 256 tokens). greedy_agreement is the
  fraction of its positions where both models pick the same next token given the same context (both scored
  along the reference's output, so one near-tie does not make every later comparison meaningless, and both
  sides take the same attention path); the free-running
  figures compare the two models' own continuations: same token at the same position, and the fraction
  before the first difference.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from moeserve.sampling_params import SamplingParams


@dataclass
class QuantAccuracy:
    logit_cosine_mean: float
    logit_cosine_min: float
    top1_agreement: float  # teacher-forced
    ppl_reference: float
    ppl_quantized: float
    greedy_agreement: float  # quantized argmax == reference greedy token, along the reference's output
    greedy_free_running: float  # same token at the same position, each model on its own output
    greedy_prefix: float  # free-running: mean fraction of tokens before the first difference
    scored_tokens: int
    generated_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping windows of `size` tokens (a shorter tail of >= 2 tokens is kept)."""
    out = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [w for w in out if len(w) >= 2]


def score_windows(ref_engine, q_engine, chunks: list[list[int]]) -> dict:
    cos, agree, nll_r, nll_q, n = [], 0, 0.0, 0.0, 0
    for ids in chunks:
        lr, lq = ref_engine.score(ids), q_engine.score(ids)  # [L, V] float32 each
        cos.append(F.cosine_similarity(lr, lq, dim=-1))
        agree += (lr.argmax(-1) == lq.argmax(-1)).sum().item()
        target = torch.tensor(ids[1:])
        nll_r += F.cross_entropy(lr[:-1], target, reduction="sum").item()
        nll_q += F.cross_entropy(lq[:-1], target, reduction="sum").item()
        n += len(ids)
    c = torch.cat(cos)
    pred = n - len(chunks)  # positions with a next token
    return dict(logit_cosine_mean=c.mean().item(), logit_cosine_min=c.min().item(), top1_agreement=agree / n,
                ppl_reference=float(torch.tensor(nll_r / pred).exp()),
                ppl_quantized=float(torch.tensor(nll_q / pred).exp()), scored_tokens=n)


def greedy_match(ref_llm, q_llm, prompts: list[list[int]], num_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    got = [o.outputs[0].token_ids for o in q_llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    same, forced, prefix, total = 0, 0, 0.0, 0
    for p, r, g in zip(prompts, ref, got):
        eq = [a == b for a, b in zip(r, g)]
        same += sum(eq)
        prefix += (eq.index(False) if False in eq else len(eq)) / max(len(r), 1)
        total += len(r)
        seq, rows = list(p) + list(r), slice(len(p) - 1, len(p) + len(r) - 1)  # positions predicting r
        forced += (ref_llm.engine.score(seq)[rows].argmax(-1) == q_llm.engine.score(seq)[rows].argmax(-1)).sum().item()
    n = max(total, 1)
    return dict(greedy_agreement=forced / n, greedy_free_running=same / n,
                greedy_prefix=prefix / max(len(prompts), 1), generated_tokens=total)


def evaluate(ref_llm, q_llm, text_ids: list[int], prompts: list[list[int]], num_tokens: int = 256,
             window: int = 256) -> QuantAccuracy:
    chunks = windows(text_ids, window)
    if not chunks:
        raise ValueError("the held-out text has fewer than 2 tokens")
    scores = score_windows(ref_llm.engine, q_llm.engine, chunks)
    return QuantAccuracy(**scores, **greedy_match(ref_llm, q_llm, prompts, num_tokens))
