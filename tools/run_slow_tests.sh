#!/usr/bin/env bash
# The tests the default run leaves out (marked slow): the trainer's whole combination
# matrix (tests/test_combinations.py, about 20 minutes on 2 cores), the FSDP continuations,
# and the kill trials' own check, struck 20 times under a CPU hog (a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -m slow "$@" tests
