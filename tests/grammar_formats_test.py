"""The string formats pagedlm builds (src/pagedlm/grammar/string_format.h) against a validator it
did not write: grammar_test's random walks through each format, alone and with a length bound
(Grammar.FormatWalksEndWithinTheirBounds, which writes every finished string), each validated
with `jsonschema` and its format checkers (rfc3339-validator for date-time and time,
rfc3986-validator for uri, Python's ipaddress, uuid and date for the rest; email is only checked
for an "@"). Exits 77 (skipped) when jsonschema cannot be installed."""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from server_structured_test import import_jsonschema

FORMATS = {"email", "date", "time", "date-time", "uuid", "ipv4", "ipv6", "uri"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grammar-test", required=True, help="the grammar_test binary")
    args = parser.parse_args()
    jsonschema = import_jsonschema(Path(args.grammar_test).parent / "python-deps")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "samples.jsonl")
        run = subprocess.run(
            [args.grammar_test, "--gtest_filter=Grammar.FormatWalksEndWithinTheirBounds"],
            env={**os.environ, "PAGEDLM_FORMAT_SAMPLES": path}, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        samples = [json.loads(line) for line in Path(path).read_text().splitlines()]
    validator = jsonschema.Draft202012Validator
    checked = collections.Counter()
    invalid = []
    for sample in samples:
        schema, value = sample["schema"], sample["value"]
        checked[schema["format"]] += 1
        errors = list(validator(schema, format_checker=validator.FORMAT_CHECKER)
                      .iter_errors(value))
        if errors:
            invalid.append((schema, value, errors[0].message))
    for fmt in sorted(checked):
        print(f"     {fmt}: {checked[fmt]} strings")
    assert set(checked) == FORMATS, f"walks of {sorted(FORMATS - set(checked))} wrote nothing"
    # The gtest holds each of its 16 schemas to 10 finished walks or more.
    assert len(samples) >= 16 * 10, len(samples)
    assert not invalid, f"{len(invalid)} of {len(samples)} strings invalid: {invalid[:10]}"
    print(f"{len(samples)} passed, 0 failed")


if __name__ == "__main__":
    sys.exit(main())
