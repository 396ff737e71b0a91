"""`--config FILE.yaml` (vLLM's): a YAML mapping of flag names to values, read as if typed before the
command line's own flags, so the command line wins.

Keys are flag names without dashes, with - or _ (`max_model_len: 32k`, `tensor-parallel-size: 2`);
true switches a flag on, false writes its --no- form; lists become several values
(`served_model_name: [a, b]`); mappings become JSON (`speculative_config: {method: mtp}`).
"""
from __future__ import annotations

import json
import os

CONFIG_COMMANDS = ("serve", "generate")  # the commands with engine flags
CONFIG_HELP = "YAML file of flags (vLLM's --config), e.g. 'max_model_len: 32k'; the command line's flags win"


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    out, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML file")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return path, out


def flags_from_mapping(data: dict, source: str) -> list[str]:
    args: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{source}: keys must be flag names, got {key!r}")
        flag = "--" + key.replace("_", "-").lstrip("-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, list):
            args += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def expand_config_file(argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by FILE's flags, placed after the subcommand (serve, generate)."""
    if not argv or argv[0] not in CONFIG_COMMANDS:
        return argv
    path, rest = _config_path(argv)
    if path is None:
        return argv
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path!r} is not a file")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if data is None:
        return rest
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flag names to values")
    return rest[:1] + flags_from_mapping(data, f"--config {path}") + rest[1:]
