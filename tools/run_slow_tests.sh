#!/usr/bin/env bash
# The exhaustive matrices the default test run leaves out (marked slow): today the trainer's
# whole combination matrix (tests/test_combinations.py), about 20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -m slow "$@" tests/test_combinations.py
