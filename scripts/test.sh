#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. pytest's "no tests ran" (exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
