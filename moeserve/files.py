"""Reading a file a user named on the command line: one error that names the flag (or its label) and the
file, instead of an OSError or UnicodeDecodeError traceback (or a bare "'utf-8' codec can't decode")."""
from __future__ import annotations

from pathlib import Path


def read_text(path, label: str, expected: str) -> str:
    """The file's text. `label` starts every error (e.g. "--model config.json"); `expected` says what the
    file should hold ("YAML or JSON")."""
    try:
        return Path(path).read_text()
    except OSError as err:
        raise ValueError(f"{label}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{label}: not UTF-8 text (byte {err.start}); expected {expected}") from None
