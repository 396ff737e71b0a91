"""Per-expert load statistics: routed (token, choice) pairs per logical expert, per MoE layer.

`--expert-load-stats PATH` turns recording on. Every MoE block adds the bincount of its router's logical
expert ids (before the placement map, so replicas do not split an expert's count); the model runner writes
the totals as JSON at most every few seconds and when the engine stops. With several ranks each rank
writes PATH.rank<r> with the pairs it routed (its own tokens); the files add up to the whole instance.
`moeserve eplb` turns the statistics into a balanced --expert-placement, and `moeserve plan --eplb-stats`
into the planner's expert-load imbalance.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from moeserve.files import read_text

from moeserve.scoped import Scoped

FORMAT = "moeserve-expert-load"
_CURRENT: Scoped["ExpertLoadRecorder"] = Scoped("expert_load_recorder")


class ExpertLoadRecorder:
    def __init__(self, path: str | None, num_experts: int, rank: int = 0, world_size: int = 1,
                 interval_s: float = 5.0) -> None:
        """path None: counts in memory only (online EPLB reads them), no file."""
        self.path = None if path is None else Path(f"{path}.rank{rank}" if world_size > 1 else path)
        self.num_experts, self.rank, self.world_size = num_experts, rank, world_size
        self.interval_s = interval_s
        self.counts: dict[int, torch.Tensor] = {}
        self.steps = 0
        self._last_write = 0.0

    def record(self, layer_idx: int, expert_ids: torch.Tensor) -> None:
        # Counted on the ids' device: no host sync per MoE layer; write() copies them out.
        c = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts)
        prev = self.counts.get(layer_idx)
        self.counts[layer_idx] = c if prev is None else prev + c

    def step_done(self) -> None:
        """After a forward: write the file if the last write is older than the interval."""
        self.steps += 1
        if self.path is not None and time.monotonic() - self._last_write >= self.interval_s:
            self.write()

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": 1, "num_experts": self.num_experts, "rank": self.rank,
                "world_size": self.world_size, "steps": self.steps,
                "layers": {str(i): self.counts[i].tolist() for i in sorted(self.counts)}}

    def write(self) -> None:
        """Atomically replace the file (a reader never sees half of it)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, self.path)
        self._last_write = time.monotonic()


def recording(recorder: ExpertLoadRecorder | None):
    """MoE blocks run inside record into `recorder` (None: no recording)."""
    return _CURRENT.use(recorder)


def current_recorder() -> ExpertLoadRecorder | None:
    return _CURRENT.get()


def read_loads(paths: list[str], num_experts: int | None = None) -> dict[int, list[float]]:
    """Per-layer loads summed over files: moeserve's own JSON (one file per rank), a list of per-expert
    counts (layer key -1), or a list of such lists (layers 0..n-1). Errors name the file."""
    total: dict[int, list[float]] = {}
    for path in paths:
        text = read_text(path, str(path), "JSON expert-load statistics")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON expert-load statistics ({err})") from None
        if isinstance(data, dict) and data.get("format") == FORMAT:
            if not isinstance(data.get("layers"), dict):
                raise ValueError(f"{path}: {FORMAT} file without a 'layers' mapping (layer -> per-expert counts)")
            layers = {_layer_number(path, k): v for k, v in data["layers"].items()}
        elif isinstance(data, list) and data and isinstance(data[0], list):
            layers = dict(enumerate(data))
        elif isinstance(data, list) and data:
            layers = {-1: data}
        else:
            raise ValueError(f"{path}: expected moeserve --expert-load-stats JSON, a list of per-expert counts, "
                             "or a list of such lists (one per layer)")
        for layer, loads in layers.items():
            _check_counts(path, layer, loads)
            if num_experts is not None and len(loads) != num_experts:
                raise ValueError(f"{path}: layer {layer} lists {len(loads)} expert loads, the model has "
                                 f"{num_experts}")
            acc = total.setdefault(layer, [0.0] * len(loads))
            if len(acc) != len(loads):
                raise ValueError(f"{path}: layer {layer} has {len(loads)} experts, other files {len(acc)}")
            total[layer] = [a + float(b) for a, b in zip(acc, loads)]
    return total


def _layer_number(path, key) -> int:
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"{path}: layer key {key!r} is not a layer number") from None


def _check_counts(path, layer: int, loads) -> None:
    """Counts are (token, choice) pairs: a list of finite numbers >= 0 (a negative total means a broken file)."""
    if not isinstance(loads, list):
        raise ValueError(f"{path}: layer {layer} must be a list of per-expert counts, got {type(loads).__name__}")
    for e, x in enumerate(loads):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise ValueError(f"{path}: layer {layer}, expert {e}: a load is a count >= 0, got {x!r}")
