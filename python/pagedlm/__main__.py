"""python -m pagedlm serve|generate|bench|logits|inspect ...: the pagedlm command line, from the
binary the wheel carries (or $PAGEDLM_BINARY)."""

import os
import sys
from pathlib import Path


def main() -> None:
    binary = os.environ.get("PAGEDLM_BINARY") or str(Path(__file__).parent / "bin" / "pagedlm")
    if not os.access(binary, os.X_OK):
        sys.exit(f"pagedlm: no binary at {binary} (install the package with pip, or set "
                 "PAGEDLM_BINARY to a built one)")
    os.execv(binary, [binary] + sys.argv[1:])


if __name__ == "__main__":
    main()
