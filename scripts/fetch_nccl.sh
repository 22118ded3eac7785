#!/usr/bin/env bash
# Fetches NCCL (headers and libnccl.so.2) from the PyPI wheel nvidia-nccl-cu13, pinned by version
# and sha256, unpacks it into the cache (PAGEDLM_CACHE, default ~/.cache/pagedlm) and prints the
# folder to pass as -DPAGEDLM_NCCL_ROOT. The pin is the manylinux x86_64 wheel.
set -euo pipefail

VERSION="2.32.3"
SHA256="1459723080ac889d73a26edfa3e04383a7928ab31ac8f0ec43b3ea9548b04ff3"
CACHE="${PAGEDLM_CACHE:-$HOME/.cache/pagedlm}"
TARGET="$CACHE/nccl-$VERSION"

if [[ -f "$TARGET/include/nccl.h" && -f "$TARGET/lib/libnccl.so.2" ]]; then
  echo "$TARGET"
  exit 0
fi

mkdir -p "$CACHE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching nvidia-nccl-cu13==$VERSION from PyPI ..." >&2
echo "nvidia-nccl-cu13==$VERSION --hash=sha256:$SHA256" >"$work/requirements.txt"
python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: \
  --platform manylinux_2_27_x86_64 --python-version 3 --dest "$work" -r "$work/requirements.txt" >&2
wheel=$(ls "$work"/*.whl)
python3 - "$wheel" "$work/nccl" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for m in z.namelist():
        if m.startswith("nvidia/nccl/include/") or m == "nvidia/nccl/lib/libnccl.so.2":
            dst = os.path.join(out, m[len("nvidia/nccl/"):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(m) as src, open(dst, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
PY
rm -rf "$TARGET"
mv "$work/nccl" "$TARGET"
echo "$TARGET"
