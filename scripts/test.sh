#!/usr/bin/env bash
# Builds everything (warnings are errors) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --tests
scripts/check_format.sh
scripts/check_layers.sh
scripts/check_words.sh
scripts/fetch_model.sh >/dev/null
# PAGEDLM_PYTHON: the Python package's module and its tests (python_api_py) too.
PAGEDLM_CMAKE_ARGS="-DPAGEDLM_WERROR=ON -DPAGEDLM_PYTHON=ON ${PAGEDLM_CMAKE_ARGS:-}" scripts/build.sh
scripts/check_tidy.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
# The parsers of outside input under libFuzzer (ASan, UBSan), a short run of each target.
scripts/fuzz.sh
