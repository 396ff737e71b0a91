"""Sampling: logits -> tokens for a whole step at once (design and figures: docs/sampling.md).

sampler.SamplingBatch holds a step's parameters per logits row and applies the temperature; processors applies
logit_bias, min_tokens, token masks and penalties; filters does top-k / top-p / min-p; draw picks the tokens;
logprobs reports them; step.StepSampler is what the model runner calls.
"""
from moeserve.sample.draw import SamplingError, draw
from moeserve.sample.filters import exact_filter
from moeserve.sample.logprobs import TokenLogprobs, token_logprobs
from moeserve.sample.processors import LogitsRows, apply_logits_processors
from moeserve.sample.sampler import SamplingBatch, Sampler, apply_filters, filtered_probs, sample

__all__ = ["SamplingBatch", "SamplingError", "draw", "apply_filters", "exact_filter",
           "TokenLogprobs", "token_logprobs", "LogitsRows", "apply_logits_processors", "Sampler",
           "filtered_probs", "sample"]
