"""Step-time model of one engine: the cost model (moeserve/perf/) as the prior, calibrated online by measured steps.

A step's seconds are linear in five features of its batch (StepFeatures): a fixed cost, the decodes, their
KV context (attention reads), the prefill tokens (GEMMs) and the prefill attention pairs (new x past).
The prior weights are a least-squares fit of the cost model (perf/step.py run_step) over a
grid of batches of the served model on a nominal device; every measured step then updates the weights by
recursive least squares with forgetting, so the model follows this machine (and its load) within tens
of steps. Pure CPU arithmetic on five numbers: the scheduler consults it every step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import cpu_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import Batch, run_step

logger = logging.getLogger(__name__)

FORGET = 0.98  # RLS forgetting factor: the last ~50 steps weigh most (load and noise drift)
NUM_FEATURES = 5
NOISE = 0.1  # a measured step's typical relative noise (the weighted fit's unit)
CALIBRATION_STEPS = 10  # measured steps before the admission policy trusts the fit (slow start until then)


@dataclass(frozen=True)
class StepFeatures:
    """One step's batch: decodes (each one position), their summed KV context, prefill tokens and the
    prefill attention pairs sum(new * (past + new / 2))."""
    decodes: float = 0.0
    decode_context: float = 0.0
    prefill_tokens: float = 0.0
    prefill_pairs: float = 0.0

    def vector(self) -> np.ndarray:
        # scaled so every weight is of order seconds-per-unit near 1e-3..1e-1
        return np.array([1.0, self.decodes, self.decode_context / 1e3, self.prefill_tokens / 1e3,
                         self.prefill_pairs / 1e6])

    def plus(self, decodes: float = 0.0, decode_context: float = 0.0, prefill_tokens: float = 0.0,
             prefill_pairs: float = 0.0) -> "StepFeatures":
        return StepFeatures(self.decodes + decodes, self.decode_context + decode_context,
                            self.prefill_tokens + prefill_tokens, self.prefill_pairs + prefill_pairs)


def chunk_pairs(new: float, past: float) -> float:
    """Attention pairs of a prefill chunk of `new` tokens after `past` computed ones."""
    return new * (past + new / 2.0)


def features_of(scheduled) -> StepFeatures:
    """StepFeatures of a SchedulerOutput.scheduled list (a decode: a request past its prompt taking few
    tokens; anything else counts as prefill)."""
    dec = ctx = pre = pairs = 0.0
    for s in scheduled:
        if s.start >= s.request.num_prompt_tokens and s.num_tokens <= 1 + len(s.draft_token_ids):
            dec += s.num_tokens
            ctx += s.start + s.num_tokens
        else:
            pre += s.num_tokens
            pairs += chunk_pairs(s.num_tokens, s.start)
    return StepFeatures(dec, ctx, pre, pairs)


class StepTimeModel:
    """seconds = weights . features, fitted online (recursive least squares starting from `prior`)."""

    def __init__(self, prior: np.ndarray, prior_scale: float = 10.0) -> None:
        prior = np.asarray(prior, dtype=float)
        if prior.shape != (NUM_FEATURES,) or not np.all(np.isfinite(prior)):
            raise ValueError(f"the step-time prior needs {NUM_FEATURES} finite weights, got {prior!r}")
        self.weights = prior.copy()
        # The prior is a nominal device: trust it little (each weight may be off by ~prior_scale x).
        self._p0 = np.diag((np.abs(prior) * prior_scale) ** 2 + 1e-4)
        self.cov = self._p0.copy()
        self.num_steps = 0
        self.warmed_up = False  # the engine's first forward (allocations, kernel selection) is not a sample
        self.abs_rel_error = 0.0  # summed |predicted - measured| / measured over observed steps
        self.recent_error = 0.0  # the same, as a moving average over the last ~20 steps

    def predict(self, f: StepFeatures) -> float:
        return max(float(self.weights @ f.vector()), 1e-5)

    def observe(self, f: StepFeatures, seconds: float) -> None:
        """One measured step. Non-finite or non-positive times (a clock glitch) are ignored."""
        if not (seconds > 0 and np.isfinite(seconds)):
            return
        if not self.warmed_up:
            self.warmed_up = True
            return
        x = f.vector()
        pred = self.predict(f)
        err = abs(pred - seconds) / seconds
        self.abs_rel_error += err
        self.recent_error = err if not self.num_steps else 0.95 * self.recent_error + 0.05 * err
        self.num_steps += 1
        # Weighted least squares on relative errors (a step's noise scales with its length): the sample
        # is divided by NOISE x the prediction. A step slowed by something else on the machine should not
        # throw the fit: its residual counts at most twice the prediction (a prior 10x too low is still
        # caught up with in a few steps).
        scale = NOISE * pred
        x = x / scale
        residual = float(np.clip((seconds - pred) / scale, -2.0 / NOISE, 2.0 / NOISE))
        px = self.cov @ x
        gain = px / (FORGET + x @ px)
        self.weights = self.weights + gain * residual
        self.cov = (self.cov - np.outer(gain, px)) / FORGET
        # Forgetting inflates the covariance along directions no step excites (no prefills for a while):
        # keep it within the prior's, so one odd step cannot throw the weights far.
        tr, tr0 = np.trace(self.cov), np.trace(self._p0)
        if tr > tr0:
            self.cov *= tr0 / tr

    @property
    def calibrated(self) -> bool:
        return self.num_steps >= CALIBRATION_STEPS

    @property
    def mean_step_error(self) -> float:
        """Mean relative error of the prediction made before each observed step."""
        return self.abs_rel_error / self.num_steps if self.num_steps else 0.0


# A nominal one-card device for the prior (a laptop-class CPU): the online fit replaces its scale.
NOMINAL_PROFILE = {"gemm_decode_gflops": 100.0, "gemm_stream_gbs": 20.0}
NOMINAL_OVERHEAD_MS = 5.0


def fit_prior(m, hw, inst) -> np.ndarray:
    """Weights fitted to the cost model (moeserve/perf/, shared with the planner) (perf/step.py run_step) of model spec `m` on `hw`
    with layout `inst`, over a grid of decode, prefill and mixed batches."""
    rows, ys = [], []
    for seqs in (0, 1, 4, 16, 64):
        for ctx in (128.0, 1024.0):
            for new, past in ((0, 0), (256, 0), (2048, 0), (512, 1024)):
                if not seqs and not new:
                    continue
                prefill = ((1.0, float(new), float(past)),) if new else ()
                ys.append(run_step(m, hw, inst, Batch(float(seqs), 1.0, ctx, prefill)).total)
                rows.append(StepFeatures(seqs, seqs * ctx, new, chunk_pairs(new, past)).vector())
    w, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return np.maximum(w, 0.0)


def planner_prior(model_path: str | None) -> np.ndarray:
    """fit_prior for the checkpoint at `model_path` (its config.json) on one nominal card; a generic
    prior when the planner cannot read the model."""
    fallback = np.array([NOMINAL_OVERHEAD_MS * 1e-3, 2e-4, 1e-4, 5e-3, 1e-3])
    if model_path is None:
        return fallback
    try:
        return fit_prior(load_model(model_path), cpu_hardware(NOMINAL_PROFILE, NOMINAL_OVERHEAD_MS),
                         Instance(cards=1, quantization="bf16"))
    except (ValueError, KeyError, OSError) as err:  # a checkpoint the planner's presets do not describe
        logger.info("step-time prior: the planner cannot model %s (%s); using a generic prior", model_path, err)
        return fallback
