#!/usr/bin/env bash
# Run kvbridge's real-vLLM end-to-end tests (and optionally the benchmark).
#
#   scripts/run_e2e.sh [--bench] [pytest arguments...]
#
# Builds the e2e environment first when it is missing or incomplete
# (scripts/setup_e2e_env.sh; a no-op check otherwise), then runs
# tests/e2e with that environment's Python (or only the test files and
# node ids given, e.g. tests/e2e/test_vllm_push.py::test_x, when any
# argument names an existing path). With --bench it then runs
# bench/bench_vllm.py and prints its figures. Honours KVB_E2E_VENV and
# KVB_E2E_WORKDIR (keep engine logs and results there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVB_E2E_VENV:-$ROOT/.e2e/venv}"
BENCH=0
if [[ "${1:-}" == "--bench" ]]; then
    BENCH=1
    shift
fi
"$ROOT/scripts/setup_e2e_env.sh" --venv "$VENV"
cd "$ROOT"
# run the whole directory unless an argument already names a test path
TARGET=(tests/e2e)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        TARGET=()
        break
    fi
done
rc=0
KVB_E2E_VENV="$VENV" "$VENV/bin/python" -m pytest "${TARGET[@]}" -q -rfEs "$@" || rc=$?
if [[ $BENCH -eq 1 ]]; then
    KVB_E2E_VENV="$VENV" "$VENV/bin/python" bench/bench_vllm.py || rc=$?
fi
exit $rc
