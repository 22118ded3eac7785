#!/usr/bin/env bash
# Fetches xgrammar's source distribution (its C++ core: grammar compiler and token-mask matcher)
# from PyPI at a pinned version, verifies its sha256 and unpacks it into the cache
# (PAGEDLM_CACHE, default ~/.cache/pagedlm). Prints the unpacked folder, which CMake builds as
# the xgrammar target. The sdist carries the headers xgrammar needs (3rdparty/dlpack,
# 3rdparty/picojson), so nothing else is fetched.
set -euo pipefail

VERSION="0.2.9"
SHA256="87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90"
CACHE="${PAGEDLM_CACHE:-$HOME/.cache/pagedlm}"
TARGET="$CACHE/xgrammar-$VERSION"
STAMP="$TARGET/.pagedlm-sha256"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SHA256" ]]; then
  echo "$TARGET"
  exit 0
fi

mkdir -p "$CACHE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching the xgrammar $VERSION source distribution from PyPI ..." >&2
# The sdist itself (--no-binary xgrammar); pip reads its metadata with its build requirements
# (scikit-build-core, setuptools-scm, apache-tvm-ffi) installed from wheels, so nothing is compiled
# here. (--no-binary :all: would build those from source too.)
python3 -m pip download --quiet --no-deps --no-binary xgrammar --dest "$work" "xgrammar==$VERSION" >&2
sdist="$work/xgrammar-$VERSION.tar.gz"
if [[ ! -f "$sdist" ]] || ! echo "$SHA256  $sdist" | sha256sum --check --status; then
  echo "sha256 mismatch (or no file) for xgrammar-$VERSION.tar.gz: expected $SHA256" >&2
  exit 1
fi
tar -xzf "$sdist" -C "$work"
for header in 3rdparty/picojson/picojson.h 3rdparty/dlpack/include/dlpack/dlpack.h \
              include/xgrammar/xgrammar.h; do
  [[ -f "$work/xgrammar-$VERSION/$header" ]] || { echo "the sdist lacks $header" >&2; exit 1; }
done
rm -rf "$TARGET"
mv "$work/xgrammar-$VERSION" "$TARGET"
echo "$SHA256" >"$STAMP"
echo "$TARGET"
