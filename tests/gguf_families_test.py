"""GGUF files converted the way llama.cpp converts them (scripts/hf_to_gguf.py, with llama.cpp's
own gguf-py for names and keys) load in pagedlm and give Hugging Face's float64 logits: for each
golden fixture, `pagedlm logits` on the GGUF file must match every case of the fixture's
expected.safetensors to a relative Frobenius error below 1e-4 (the float32 criterion of
testdata/fixtures/README.md), and `pagedlm inspect` must report the same per-layer attention
(scale, window, soft-cap, rope theta) and final soft-cap for the GGUF file as for the HF folder.

Gemma 3 GGUF files do not say which layers slide: llama.cpp fixes it (layer i slides unless
i % 6 == 5), and pagedlm follows llama.cpp. Where a fixture's layer_types differ from that
layout (the 2-layer gemma3 fixture slides layer 0 only), the GGUF file describes another model:
its logits are compared with HF's only for the one-token case, which no window or rope theta can
change, and in full with pagedlm's own reading of the HF folder laid out as llama.cpp lays it
out (the HF path is checked against HF's logits by golden_fixtures_test).

Needs numpy and gguf; installs the pinned wheels into the build folder when they are missing,
and exits 77 (skipped) when it cannot."""

import argparse
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from server_harness import install_pinned

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "testdata" / "fixtures"
CONVERTER = ROOT / "scripts" / "hf_to_gguf.py"
NAMES = ["gemma2", "gemma3", "phi3", "llama3-rope", "qwen2-bias", "qwen3-qknorm", "mistral",
         "qwen3-yarn", "qwen3-moe", "mixtral"]
TOLERANCE = 1e-4

# gguf-py 0.19.0 (llama.cpp's GGUF library) and the two packages it imports at load time, as
# wheels for CPython 3.11 to 3.13 on x86-64 Linux. gguf also lists requests and tqdm, which it
# imports only to download files and to draw progress bars, neither of which happens here.
REQUIREMENTS = """\
gguf==0.19.0 \
    --hash=sha256:70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd
numpy==2.4.6 \
    --hash=sha256:89cd468399cfd2504718f0ba50e410dca55a170b61a02ad92bb18c8a65186e93 \
    --hash=sha256:90f9849678c75fe7afa2d348ac842c168b0a4d3d61919687216dfc547976d853 \
    --hash=sha256:a7830bab239b79cda9c08c2da014761cafb48da6150e1da17ac06283f43b6089
pyyaml==6.0.4 \
    --hash=sha256:622aa875fa6533f25fedcffe23079357d65a690d462200afed5d8e9d0e01ebee \
    --hash=sha256:93bfb2459195406a518e2f487a9bbf01df240175f31e06f5a252ac6734c7bbf0 \
    --hash=sha256:50588147ab2c6a59b5f990a4905db80899a6c2bd197e046a6201f1e67587e794
"""


def import_deps(target):
    """numpy and gguf, from the interpreter or else from pinned wheels installed into `target`
    (a folder of the build, so the system's packages are left alone)."""
    if target.is_dir():
        sys.path.insert(0, str(target))
    try:
        import gguf  # noqa: F401
        import numpy  # noqa: F401
        return
    except ImportError:
        pass
    install_pinned(REQUIREMENTS, target, "numpy/gguf are")
    import gguf  # noqa: F401,F811
    import numpy  # noqa: F401,F811


def read_safetensors(path):
    import numpy as np
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    dtypes = {"F32": "<f4", "I32": "<i4", "F64": "<f8", "I64": "<i8"}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[8 + n + start:8 + n + end]
        out[name] = np.frombuffer(raw, dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n"
                             f"{p.stdout[-2000:]}{p.stderr[-3000:]}")
    return p.stdout


def logits(binary, model, prompts, work):
    inp, out = work / "prompts.json", work / "logits.safetensors"
    inp.write_text(json.dumps([[int(t) for t in p] for p in prompts]))
    run([binary, "logits", "--model", model, "--input", inp, "--output", out, "--threads", "2"])
    got = read_safetensors(out)
    return [got[f"logits.{i}"] for i in range(len(prompts))]


def attention_layout(binary, model):
    """Per layer (scale, window, soft-cap, rope theta) and the final soft-cap, from inspect. Rope
    types are left out: a GGUF Llama 3 file carries its scaling as the rope_freqs tensor, which
    inspect reports as plain rope."""
    text = run([binary, "inspect", "--model", model])
    layers = {}
    for m in re.finditer(r"^layers (\d+)-(\d+)\s+scale (\S+), window (\S+), soft-cap (\S+); "
                         r"rope \S+ theta (\S+)", text, re.M):
        for i in range(int(m[1]), int(m[2]) + 1):
            layers[i] = (m[3], m[4], m[5], m[6])
    final = re.search(r"logit soft-cap (\S+)", text)
    assert layers and final, "unexpected inspect output:\n" + text
    return [layers[i] for i in sorted(layers)], final[1]


def llama_cpp_layer_types(config):
    """The layers llama.cpp slides in a GGUF file of this config, as HF layer_types, or None when
    the file records it as the config does."""
    if config["architectures"][0] != "Gemma3ForCausalLM":
        return None
    return ["full_attention" if i % 6 == 5 else "sliding_attention"
            for i in range(config["num_hidden_layers"])]


def rel_error(got, ref):
    import numpy as np
    ref = ref.astype(np.float64)
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def check_fixture(binary, converter, name, work):
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    gguf_path = work / f"{name}.gguf"
    converter.convert(folder, gguf_path)

    expected = read_safetensors(folder / "expected.safetensors")
    n_cases = len([k for k in expected if k.endswith(".prompt")])
    prompts = [expected[f"case{i}.prompt"] for i in range(n_cases)]
    refs = [expected[f"case{i}.logits"] for i in range(n_cases)]
    got = logits(binary, gguf_path, prompts, work)

    relaid = llama_cpp_layer_types(config)
    reference_model = folder
    failures = []
    if relaid is not None and relaid != config.get("layer_types"):
        # The file describes the fixture's weights under llama.cpp's layout: HF's logits hold
        # only for the one-token case; pagedlm's HF path gives the rest.
        relaid_dir = work / f"{name}-llama-cpp-layout"
        relaid_dir.mkdir()
        shutil.copy(folder / "model.safetensors", relaid_dir)
        (relaid_dir / "config.json").write_text(json.dumps(dict(config, layer_types=relaid)))
        reference_model = relaid_dir
        one_token = [i for i in range(n_cases) if len(prompts[i]) == 1]
        assert one_token, f"{name}: no one-token case"
        for i in one_token:
            err = rel_error(got[i], refs[i])
            print(f"  {name} case {i} (1 token) vs HF: rel err {err:.2e}")
            if not err < TOLERANCE:
                failures.append(f"{name} case {i}: rel err {err:.2e} vs HF")
        refs = logits(binary, relaid_dir, prompts, work)
        source = "pagedlm on the HF folder in llama.cpp's layout"
    else:
        source = "HF float64"
    errors = [rel_error(g, r) for g, r in zip(got, refs)]
    print(f"  {name} vs {source}: rel err per case " + " ".join(f"{e:.1e}" for e in errors))
    failures += [f"{name} case {i}: rel err {e:.2e} vs {source}" for i, e in enumerate(errors)
                 if not e < TOLERANCE]

    if "num_experts_per_tok" in config:
        # Experts quantized to Q8_0 by gguf-py, which pagedlm keeps in blocks and splits per
        # expert, against the same values dequantized by gguf-py and stored as F32 (Q8_0's own
        # error would flip routing decisions, so HF's logits are no reference for it).
        q8_path, q8_f32_path = work / f"{name}-q8_0.gguf", work / f"{name}-q8_0-f32.gguf"
        converter.convert(folder, q8_path, "q8_0")
        converter.convert(folder, q8_f32_path, "q8_0-as-f32")
        q8_refs = logits(binary, q8_f32_path, prompts, work)
        q8_errors = [rel_error(g, r) for g, r in zip(logits(binary, q8_path, prompts, work),
                                                     q8_refs)]
        print(f"  {name} Q8_0 blocks vs their F32 values: rel err per case " +
              " ".join(f"{e:.1e}" for e in q8_errors))
        failures += [f"{name} Q8_0 case {i}: rel err {e:.2e} vs its F32 values"
                     for i, e in enumerate(q8_errors) if not e < TOLERANCE]

    hf_layout, gguf_layout = (attention_layout(binary, m) for m in (reference_model, gguf_path))
    if hf_layout != gguf_layout:
        failures.append(f"{name}: inspect of the GGUF file gives {gguf_layout}, of "
                        f"{reference_model} {hf_layout}")
    else:
        print(f"  {name} inspect: {len(gguf_layout[0])} layers (scale, window, soft-cap, theta) "
              f"{sorted(set(gguf_layout[0]))}, final soft-cap {gguf_layout[1]}")
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pagedlm", required=True, help="the pagedlm binary")
    parser.add_argument("--fixture", action="append", help="only these fixtures")
    args = parser.parse_args()
    binary = os.path.abspath(args.pagedlm)
    import_deps(Path(binary).parent / "python-deps")

    spec = importlib.util.spec_from_file_location("hf_to_gguf", CONVERTER)
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)

    names = args.fixture or NAMES
    failed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            try:
                failures = check_fixture(binary, converter, name, work)
            except AssertionError as e:
                failures = [f"{name}: {e}"]
            if failures:
                failed[name] = failures
    for name, failures in failed.items():
        for f in failures:
            print("FAIL " + f, file=sys.stderr)
    print(f"{len(names) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
