"""One whole line to stderr in one write. Rank processes share the stream, and print() writes a line's text and
its newline apart: two ranks printing at once could run their lines into one."""
from __future__ import annotations

import sys


def stderr_line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
