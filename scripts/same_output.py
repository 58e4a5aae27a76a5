#!/usr/bin/env python3
"""Runs two programs and fails unless both succeed and print the same standard output, which
contains the --expect text: how a twin example proves it computes exactly what the original does.

    same_output.py --expect TEXT PROGRAM_A PROGRAM_B
"""
import argparse
import subprocess
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect", required=True)
    parser.add_argument("a")
    parser.add_argument("b")
    args = parser.parse_args()
    outputs = []
    for program in (args.a, args.b):
        run = subprocess.run([program], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            print(f"{program} exited with {run.returncode}:\n{run.stdout}{run.stderr}")
            return 1
        outputs.append(run.stdout)
    print(outputs[1], end="")
    if args.expect not in outputs[0]:
        print(f"{args.a} did not print {args.expect!r}")
        return 1
    if outputs[0] != outputs[1]:
        print(f"the outputs differ; {args.a} printed:\n{outputs[0]}", end="")
        return 1
    print(f"same output as {args.a}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
