#!/usr/bin/env python3
"""Where one engine decode step goes, kernel by kernel.

Runs `cuda_decode_step_bench` under Nsight Compute (`ncu --profile-from-start off`: only the
one step the bench brackets with cudaProfilerStart/Stop is profiled, each of its kernels timed
alone with its caches flushed, so short kernels read longer than they run inside a graph) and
prints the number of kernels in the step, their summed time, and the kernels grouped by name and
grid, longest first.

  scripts/gpu_host/step_kernels.py build-gpu/cuda_decode_step_bench configs/llama-3.1-8b.json \\
      1 128 --quantization q4_k --csv OUT/q4k.csv
  scripts/gpu_host/step_kernels.py --from-csv OUT/q4k.csv      # the table again, no GPU

Arguments after the bench are the bench's own: config, batch, context, then its options.
"""
import argparse
import collections
import csv
import io
import subprocess
import sys

# Nsight Compute names the duration's unit "ns" / "us" / "ms" (older releases "nsecond", ...).
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
          "s": 1e6, "second": 1e6}
_METRIC = "gpu__time_duration.sum"


def kernel_times(csv_text):
    """[(kernel name, grid, microseconds)] of the rows of ncu's --csv output that time a kernel.

    ncu prints its own lines (starting with "==") around the table; only quoted lines are rows.
    """
    rows = [line for line in csv_text.splitlines() if line.startswith('"')]
    out = []
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        if r.get("Metric Name") != _METRIC:
            continue
        unit = r["Metric Unit"]
        if unit not in _TO_US:
            raise ValueError(f"unknown time unit {unit!r} for {r['Kernel Name']}")
        value = float(r["Metric Value"].replace(",", ""))
        out.append((r["Kernel Name"], r.get("Grid Size", ""), value * _TO_US[unit]))
    return out


def table(times, top):
    """The step's kernel count and time, then the kernels by (name, grid), longest first."""
    groups = collections.defaultdict(lambda: [0, 0.0])
    for name, grid, us in times:
        g = groups[(name, grid)]
        g[0] += 1
        g[1] += us
    total = sum(us for _, _, us in times)
    lines = [f"{len(times)} kernels, {total:.1f} us of kernels",
             "| us a step | calls | us each | kernel (grid) |", "| --- | --- | --- | --- |"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    for (name, grid), (calls, us) in ranked[:top]:
        short = name.split("(")[0][:72]
        lines.append(f"| {us:.1f} | {calls} | {us / calls:.2f} | {short} {grid} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-csv", help="read a saved ncu CSV instead of running the bench")
    ap.add_argument("--csv", help="where to save ncu's CSV")
    ap.add_argument("--top", type=int, default=16, help="kernel groups to list")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("bench", nargs=argparse.REMAINDER,
                    help="cuda_decode_step_bench and its arguments")
    args = ap.parse_args()
    if args.from_csv:
        with open(args.from_csv) as f:
            text = f.read()
    else:
        if not args.bench:
            ap.error("give the bench and its arguments, or --from-csv")
        cmd = [args.ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics",
               _METRIC, "--csv"] + args.bench
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"step_kernels: {' '.join(cmd)} exited {run.returncode}:\n"
                     f"{run.stderr[-2000:]}")
        text = run.stdout
        if args.csv:
            with open(args.csv, "w") as f:
                f.write(text)
        # The bench's own lines (its step time under the profiler is not the step's time).
        print("\n".join(l for l in text.splitlines() if not l.startswith(('"', "=="))))
    times = kernel_times(text)
    if not times:
        sys.exit("step_kernels: no kernel times in the profile (was the step bracketed?)")
    print(table(times, args.top))


if __name__ == "__main__":
    main()
