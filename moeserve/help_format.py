"""How every `moeserve` subcommand's --help reads: below cli.py, so a subcommand module that registers itself
there (entrypoints/*_cli.py, planner/cli.py, bench/cli.py) never imports the command that loads it."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, unless the help text already says what it is ("(default: the bundled model)")."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        return help_text if "default:" in help_text else super()._get_help_string(action)
