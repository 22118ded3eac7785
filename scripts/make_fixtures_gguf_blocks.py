#!/usr/bin/env python3
"""The llama-gqa fixture converted to each GGUF block format the GPU keeps in its blocks, by
llama.cpp's own quantizer: testdata/gguf_blocks/llama-gqa.<TYPE>.gguf, for
tests/cuda_model_test.cc's CudaGgufBlocks (the GPU's logits on the blocks against the CPU's exact
kernels on the same file).

  1. scripts/hf_to_gguf.py writes the fixture as an F32 GGUF (gguf-py's names and keys).
  2. llama.cpp's llama_model_quantize (llama-cpp-python 0.3.36, scripts/requirements-cpu-peer.txt)
     quantizes it with `pure` set: every matrix in the one type (token_embd and output too; the
     1-D norms stay F32). llama-gqa's rows are 256 and 512 wide, so the K-quants' 256-weight
     super-blocks fit every matrix and nothing falls back to another type.

Types: Q8_0 Q4_0 Q4_1 Q4_K (llama.cpp's Q4_K_S, pure) Q5_K (Q5_K_S, pure) Q6_K.

  pip install --require-hashes --no-binary llama-cpp-python -r scripts/requirements-cpu-peer.txt
  python3 scripts/make_fixtures_gguf_blocks.py [--out testdata/gguf_blocks]
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_formats_accuracy import requantize  # noqa: E402  (llama.cpp's quantizer)
from hf_to_gguf import convert  # noqa: E402

# The type in the file name -> llama.cpp's file type (with pure: every matrix in that type).
TYPES = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S",
         "Q6_K": "Q6_K"}
FIXTURE = "llama-gqa"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    repo = os.path.dirname(HERE)
    parser.add_argument("--out", default=os.path.join(repo, "testdata", "gguf_blocks"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from gguf import GGUFReader

    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, f"{FIXTURE}.F32.gguf")
        convert(os.path.join(repo, "testdata", "fixtures", FIXTURE), f32, "f32")
        for name, ftype in TYPES.items():
            out = os.path.join(args.out, f"{FIXTURE}.{name}.gguf")
            requantize(f32, out, f"{ftype}-pure")
            types = sorted({t.tensor_type.name for t in GGUFReader(out).tensors if len(t.shape) > 1})
            if types != [name]:
                sys.exit(f"{out}: matrices in {types}, not all in {name}")
            print(f"{out}: every matrix {name}, {os.path.getsize(out)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
