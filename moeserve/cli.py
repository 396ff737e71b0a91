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
    _defaults_in_help(parser)
    return parser


def _defaults_in_help(parser: argparse.ArgumentParser) -> None:
    """Every flag's --help entry states its default, also flags registered without a help text."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                fc = sub.formatter_class
                if not issubclass(fc, argparse.ArgumentDefaultsHelpFormatter):  # e.g. RawDescriptionHelpFormatter
                    sub.formatter_class = HelpFormatter if fc is argparse.HelpFormatter else \
                        type(f"{fc.__name__}WithDefaults", (fc, HelpFormatter), {})
                _defaults_in_help(sub)
        elif action.option_strings and action.default is not argparse.SUPPRESS and not (action.help or "").strip():
            action.help = "(default: %(default)s)"


def _version() -> str:
    from moeserve import __version__
    return __version__


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (nested) subcommand parser the words of argv select, e.g. `bench serve`."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            if word.startswith("-") or subs:
                continue
            break
        parser = subs[0].choices[word]
    return parser


# vLLM flags moeserve does not take, with what to do instead: a table, not string distance (which would
# point --data-parallel-address at --data-parallel-size). Issue 33 extends it to all of vLLM's flags.
_MULTI_NODE = "multi-node DP is spelled --nnodes / --node-rank / --master-addr / --master-port here"
VLLM_FLAG_HINTS = {
    "--data-parallel-size-local": _MULTI_NODE,
    "--data-parallel-address": _MULTI_NODE,
    "--data-parallel-rpc-port": _MULTI_NODE,
    "--data-parallel-start-rank": _MULTI_NODE,
    "--data-parallel-backend": _MULTI_NODE,
    "--headless": _MULTI_NODE + " (every node runs `moeserve serve`)",
    "--enable-sleep-mode": "not needed: LLM.sleep() / wake_up() work without it",
}


def _unknown_flags(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]) -> None:
    """Exit 2 naming each unknown flag: what to use instead for vLLM flags moeserve lacks (VLLM_FLAG_HINTS),
    else the closest known spelling (argparse alone says only 'unrecognized'). No usage dump: one line each."""
    import difflib

    sub = _subparser(parser, argv)
    known = [o for a in sub._actions for o in a.option_strings]
    lines = []
    for flag in (e.split("=", 1)[0] for e in extras if e.startswith("-")):
        if flag in VLLM_FLAG_HINTS:
            lines.append(f"unknown flag {flag}: {VLLM_FLAG_HINTS[flag]}")
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        lines.append(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))
    if not lines:
        lines = [f"unexpected argument(s): {' '.join(extras)}"]
    print("\n".join(f"{sub.prog}: error: {line}" for line in lines), file=sys.stderr)
    print(f"(`{sub.prog} --help` lists the flags)", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    from moeserve.config_file import expand_config_file

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config_file(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"moeserve: error: {e}", file=sys.stderr)
        return 2
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_flags(parser, argv, extras)
    try:
        return args.func(args) or 0
    except BrokenPipeError:
        # Output piped into `head` and friends: the reader left; exit quietly like other Unix tools.
        sys.stderr.close()
        return 0
    except (ValueError, FileNotFoundError, TypeError, MemoryError) as e:
        # Bad input (a flag, a path, a prompt): one clear line, not a traceback.
        print(f"moeserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
