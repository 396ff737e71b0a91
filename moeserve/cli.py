"""The `moeserve` command. Each subcommand lives with its subsystem and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# module -> provides register(subparsers). One line per subsystem.
SUBCOMMANDS = [
    "moeserve.entrypoints.generate_cli",
    "moeserve.planner.cli",
    "moeserve.entrypoints.quantize_cli",
    "moeserve.entrypoints.eval_quant_cli",
    "moeserve.entrypoints.eplb_cli",
    "moeserve.entrypoints.serve_cli",
    "moeserve.disagg.proxy_cli",
    "moeserve.bench.cli",
]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, unless the help text already says what it is ("(default: the bundled model)")."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        return help_text if "default:" in help_text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moeserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from moeserve import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except BrokenPipeError:
        # Output piped into `head` and friends: the reader left; exit quietly like other Unix tools.
        sys.stderr.close()
        return 0
    except (ValueError, FileNotFoundError, TypeError) as e:
        # Bad input (a flag, a path, a prompt): one clear line, not a traceback.
        print(f"moeserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
