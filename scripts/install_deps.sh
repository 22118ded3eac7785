#!/usr/bin/env bash
# Installs the Debian packages pagedlm builds against, only those that are missing.
# --tests adds what the test suite drives (headless Chromium for the chat-page test; clang with
# its sanitizer and libFuzzer runtimes and OpenMP for scripts/fuzz.sh; the Python package's build
# and test requirements, pinned by sha256 in scripts/requirements-python.txt).
set -euo pipefail

packages=(cmake g++ pkg-config libopenblas-dev nlohmann-json3-dev libxxhash-dev libpcre2-dev
          libcli11-dev libboost-dev libgtest-dev libbenchmark-dev python3 python3-pip python3-dev)
[[ "${1:-}" == "--tests" ]] && packages+=(chromium clang libclang-rt-dev libomp-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}" >&2
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The Python package's pinned build and test requirements, into a folder of their own when the
# interpreter lacks them (a Debian python3 refuses pip installs into itself); python/CMakeLists.txt
# and ctest's python_api_py look there.
if [[ "${1:-}" == "--tests" ]]; then
  python_deps="${PAGEDLM_CACHE:-$HOME/.cache/pagedlm}/python-deps"
  if ! PYTHONPATH="$python_deps" python3 -c \
      "import nanobind, scikit_build_core, numpy, pytest, jsonschema, tqdm" 2>/dev/null; then
    echo "installing: scripts/requirements-python.txt into $python_deps" >&2
    python3 -m pip install --quiet --require-hashes --target "$python_deps" \
      -r "$(dirname "$0")/requirements-python.txt"
  fi
fi
