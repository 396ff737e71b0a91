"""argparse value types for `moeserve plan`: bad values are refused at parse time, so the error names the
flag ("argument --batch: must be an integer >= 1, got '-5'") instead of surfacing later as a nonsense
figure or a traceback."""
from __future__ import annotations

import argparse
import math

from moeserve.perf.hardware import FIGURE_MAX, FIGURE_MIN


# Above any count the planner can use; 10**400 overflowed the first float conversion (OverflowError).
MAX_INT = 10 ** 18


def _int(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}")
    if v > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be an integer <= {MAX_INT:.0e}, got {text[:20]!r}...")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(v):  # inf/nan have no documented meaning for any flag
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _int(text, 1, ">= 1")


def at_most(high: int, why: str):
    """An integer in [1, high]; `why` says what the limit protects (it ends the error)."""
    def check(text: str) -> int:
        v = positive_int(text)
        if v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high} ({why}), got {text!r}")
        return v
    return check


def nonneg_int(text: str) -> int:
    return _int(text, 0, ">= 0")


def positive_float(text: str) -> float:
    """Rates, SLOs, bandwidths: within the range a hardware figure may take (hardware.FIGURE_MIN), where
    every derived time stays finite (1e-320 GB/s divided by zero; 1e-320 req/s put arrivals at inf)."""
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    if not FIGURE_MIN <= v <= FIGURE_MAX:
        raise argparse.ArgumentTypeError(f"must be in [{FIGURE_MIN:g}, {FIGURE_MAX:g}], got {text!r}")
    return v


def fraction(text: str) -> float:
    v = _float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text!r}")
    return v


def hit_rate(text: str) -> float:
    v = _float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"is the share of prompt tokens found cached, in [0, 1), got {text!r}")
    return v


def imbalance(text: str) -> float:
    v = _float(text)
    if v < 1.0:
        raise argparse.ArgumentTypeError(f"is max/mean expert load, so >= 1 (1 = balanced), got {text!r}")
    if v > FIGURE_MAX:  # 1e300 made the MoE time inf, 0 tok/s
        raise argparse.ArgumentTypeError(f"must be <= {FIGURE_MAX:g} (max/mean is at most the EP ranks), got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]."""
    try:
        return [positive_int(t.strip()) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1, got {text!r}") from None
