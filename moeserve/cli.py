"""The `moeserve` command. Each subcommand lives with its subsystem and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

from moeserve.help_format import HelpFormatter
from moeserve.version import __version__

# module -> provides register(subparsers). One line per subsystem.
SUBCOMMANDS = [
    "moeserve.entrypoints.generate_cli",
    "moeserve.planner.cli",
    "moeserve.entrypoints.quantize_cli",
    "moeserve.entrypoints.eval_quant_cli",
    "moeserve.entrypoints.eplb_cli",
    "moeserve.entrypoints.serve_cli",
    "moeserve.entrypoints.pd_proxy_cli",
    "moeserve.bench.cli",
]


class Parser(argparse.ArgumentParser):
    """argparse's errors (a missing value, a bad choice) in one line and a pointer to --help, not the usage
    (~65 lines for serve) before the line that matters. Subcommand parsers are of the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moeserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moeserve {__version__}")
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


def _unknown_flags(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]) -> None:
    """Exit 2 naming each unknown flag: for a vLLM flag moeserve refuses, why and what to use instead (the
    written table entrypoints/vllm_flag_table.py, not string distance: that would point --data-parallel-rank at
    --data-parallel-size); else the closest known spelling. No usage dump: one line each."""
    import difflib

    from moeserve.entrypoints.vllm_flag_table import hint

    sub = _subparser(parser, argv)
    known = [o for a in sub._actions for o in a.option_strings]
    lines = []
    for flag in (e.split("=", 1)[0] for e in extras if e.startswith("-")):
        why = hint(flag)
        if why is not None:
            lines.append(f"unknown flag {flag} (vLLM's): {why}")
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        lines.append(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))
    if not lines:
        lines = [f"unexpected argument(s): {' '.join(extras)}"]
    print("\n".join(f"{sub.prog}: error: {line}" for line in lines), file=sys.stderr)
    print(f"(`{sub.prog} --help` lists the flags)", file=sys.stderr)
    sys.exit(2)


def vllm_argv(argv: list[str]) -> list[str]:
    """vLLM's flag syntax (its FlexibleArgumentParser): `--max_model_len` is `--max-model-len`, and dotted JSON
    flags `--speculative-config.method mtp --speculative-config.num_speculative_tokens 1` (also `--x.k=v`, and
    `--x.k+ a,b` for a list) merge into one `--speculative-config '{...}'`. A dotted value is JSON, else a
    vLLM integer (32k), else the text."""
    import json

    from moeserve.engine_flags import human_readable_int

    out: list[str] = []
    merged: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            out += argv[i - 1:]
            break
        if not arg.startswith("--"):
            out.append(arg)
            continue
        key, eq, value = arg.partition("=")
        name, dot, path = key.partition(".")
        name = name.replace("_", "-")
        if not dot:
            out.append(name + eq + value)
            continue
        if not eq:
            if i >= len(argv):
                raise ValueError(f"{key} needs a value")
            value, i = argv[i], i + 1
        keys = path.split(".")
        def parse(text: str):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                try:
                    return human_readable_int(text)
                except argparse.ArgumentTypeError:
                    return text

        if keys[-1].endswith("+"):
            keys[-1] = keys[-1][:-1]
            parsed = [parse(x) for x in value.split(",")]
        else:
            parsed = parse(value)
        if not all(keys):
            raise ValueError(f"{key}: an empty key in a dotted flag")
        node = merged.setdefault(name, {})
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {k} is given both as a value and as an object")
        node[keys[-1]] = parsed
    for name, value in merged.items():
        if name in out:
            raise ValueError(f"{name} is given both whole and as dotted keys ({name}.KEY); pass one form")
        out += [name, json.dumps(value)]
    return out


def main(argv: list[str] | None = None) -> int:
    from moeserve.config_file import expand_config_file

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = vllm_argv(expand_config_file(argv))
    except (ValueError, FileNotFoundError) as e:
        print(f"moeserve: error: {e}", file=sys.stderr)
        return 2
    args, extras = parser.parse_known_args(argv)
    # argparse matches an unknown short flag by prefix even without allow_abbrev (vLLM's -dc as -dcp): a
    # spelling the vLLM flag table refuses is unknown whatever it matched
    from moeserve.entrypoints.vllm_flag_table import hint
    words = argv[:argv.index("--")] if "--" in argv else argv
    extras += [w for w in words if w.startswith("-") and w not in extras and hint(w) is not None]
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
