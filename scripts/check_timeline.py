#!/usr/bin/env python3
"""Checks a gradsync timeline: valid JSON in Chrome's trace format, with a process per rank and,
per rank and step, a ready, a launched and an allreduce event for every bucket.

Usage: check_timeline.py TIMELINE RANKS STEPS
"""
import collections
import json
import sys


def main():
    path, ranks, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    names = {e["pid"] for e in events if e["name"] == "process_name"}
    problems = []
    if names != set(range(ranks)):
        problems.append(f"process_name events for ranks {sorted(names)}, expected 0..{ranks - 1}")
    per = collections.Counter((e["pid"], e["args"]["step"], e["name"]) for e in events if "args" in e and "step" in e["args"])
    buckets = collections.defaultdict(set)
    for e in events:
        if e["name"] == "allreduce":
            buckets[(e["pid"], e["args"]["step"])].add(e["args"]["bucket"])
    for rank in range(ranks):
        for step in range(1, steps + 1):
            n = len(buckets[(rank, step)])
            if n == 0:
                problems.append(f"rank {rank} step {step}: no allreduce events")
            for name in ("ready", "launched", "allreduce"):
                if per[(rank, step, name)] != n:
                    problems.append(f"rank {rank} step {step}: {per[(rank, step, name)]} {name} events, expected {n}")
            if per[(rank, step, "step")] != 1:
                problems.append(f"rank {rank} step {step}: {per[(rank, step, 'step')]} step spans, expected 1")
    for e in events:
        if e["ph"] == "X" and e["dur"] < 0:
            problems.append(f"negative duration: {e}")
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"{path}: {len(events)} events, {ranks} ranks x {steps} steps, consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
