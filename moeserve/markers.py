"""Finding a marker (`</think>`, DeepSeek's tool-call start) in text that arrives in pieces."""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"  # a thinking model's reasoning section (DeepSeek R1 / V3.1)


def partial_marker_len(text, marker) -> int:
    """Length of the longest end of `text` that begins `marker` (shorter than the marker): what a
    stream must hold back until the next piece says whether the marker follows. str or bytes alike."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
