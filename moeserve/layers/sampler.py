"""Token sampling: moved to moeserve/sample/ (issue 38); these names stay importable from here."""
from __future__ import annotations

from moeserve.sample.draw import SamplingError, draw
from moeserve.sample.filters import apply_filters
from moeserve.sample.logprobs import TokenLogprobs
from moeserve.sample.processors import LogitsRows, _apply_penalties, apply_logits_processors
from moeserve.sample.sampler import Sampler
from moeserve.sample.step import non_finite_rows

__all__ = ["SamplingError", "draw", "apply_filters", "TokenLogprobs", "LogitsRows", "apply_logits_processors",
           "Sampler", "non_finite_rows", "_apply_penalties"]
