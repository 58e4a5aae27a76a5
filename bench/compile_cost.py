#!/usr/bin/env python3
"""What including gradsync costs a translation unit, beside its ceiling measured in the same run:
the standard headers the umbrella header itself includes (what any C++20 code using them pays).

  syntax only   #include <gradsync/gradsync.hpp>  vs  the same standard headers alone (-fsyntax-only)
  a trainer     examples/train_mlp_dp.cpp  vs  examples/train_mlp.cpp, its single-process twin (-O2)

Median of --runs compiles each, with the compiler the build uses (g++ unless CXX says otherwise).
Exits 1 when a figure is not a finite positive number (a broken benchmark).
"""
import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
OURS = re.compile(r"^\s*#\s*include\s*<(gradsync/[^>]+)>", re.M)
STANDARD = re.compile(r"^\s*#\s*include\s*<([a-z_]+)>", re.M)


def standard_headers(header, seen=None, found=None):
    """The standard headers included by `header` and everything of ours it includes."""
    seen = set() if seen is None else seen
    found = set() if found is None else found
    if header in seen:
        return found
    seen.add(header)
    text = (INCLUDE / header).read_text()
    found.update(STANDARD.findall(text))
    for ours in OURS.findall(text):
        standard_headers(ours, seen, found)
    return found


def timed(command, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cxx = os.environ.get("CXX", "g++")
    base = [cxx, "-std=c++20", f"-I{INCLUDE}", f"-I{ROOT / 'examples'}"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        umbrella = tmp / "umbrella.cpp"
        umbrella.write_text("#include <gradsync/gradsync.hpp>\nint main() { return 0; }\n")
        std_only = tmp / "standard.cpp"
        headers = sorted(standard_headers("gradsync/gradsync.hpp"))
        std_only.write_text("".join(f"#include <{h}>\n" for h in headers) + "int main() { return 0; }\n")
        print(f"compile cost, {cxx}, median of {args.runs}:", flush=True)
        ours = timed(base + ["-fsyntax-only", str(umbrella)], args.runs)
        ceiling = timed(base + ["-fsyntax-only", str(std_only)], args.runs)
        print(f"  #include <gradsync/gradsync.hpp>, syntax only   {ours:6.2f} s   "
              f"its {len(headers)} standard headers alone {ceiling:6.2f} s   ratio {ours / ceiling:5.2f}", flush=True)
        out = tmp / "a.o"
        dp = timed(base + ["-O2", "-c", str(ROOT / "examples/train_mlp_dp.cpp"), "-o", str(out)], args.runs)
        single = timed(base + ["-O2", "-c", str(ROOT / "examples/train_mlp.cpp"), "-o", str(out)], args.runs)
        print(f"  examples/train_mlp_dp.cpp at -O2               {dp:6.2f} s   "
              f"train_mlp.cpp (no gradsync)        {single:6.2f} s   ratio {dp / single:5.2f}", flush=True)
    if not all(math.isfinite(x) and x > 0 for x in (ours, ceiling, dp, single)):
        print("BROKEN: a compile time is not a finite positive figure")
        return 1
    results = os.environ.get("GRADSYNC_BENCH_RESULTS")
    if results:
        rows = [{"figure": "compile: #include <gradsync/gradsync.hpp>, syntax only", "measured": ours, "unit": "s",
                 "reference": f"its {len(headers)} standard headers", "reference_value": ceiling,
                 "ratio": ours / ceiling, "target": "<= 1.50", "met": ours / ceiling <= 1.5},
                {"figure": "compile: data-parallel MLP example at -O2", "measured": dp, "unit": "s",
                 "reference": "its single-process twin", "reference_value": single, "ratio": dp / single,
                 "target": "<= 2.50", "met": dp / single <= 2.5}]
        with open(os.path.join(results, "compile.json"), "w") as f:
            # One compile each is the tests' smoke run: figures without a verdict.
            json.dump({"source": "compile", "quick": args.runs == 1, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
