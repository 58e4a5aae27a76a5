#!/usr/bin/env python3
"""Runs a command that must fail: nonzero status, output matching a regular expression, and an
end within a time limit (a hang is the failure this guards against).

usage: expect_failure.py --within SECONDS --match REGEX -- command args...
A command that exits 77 (it could not set up what it needs, and said so) is passed on as a skip.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--within", type=float, required=True)
parser.add_argument("--match", action="append", required=True)
parser.add_argument("command", nargs=argparse.REMAINDER)
args = parser.parse_args()
command = args.command[1:] if args.command[:1] == ["--"] else args.command

began = time.monotonic()
# A session of its own, so that a hung job is killed whole: the launcher and every rank.
job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace", start_new_session=True)
try:
    output, _ = job.communicate(timeout=args.within)
except subprocess.TimeoutExpired:
    os.killpg(job.pid, signal.SIGKILL)
    output, _ = job.communicate()
    print(output)
    print(f"FAIL: still running after {args.within:.0f} s: the failure hung the job")
    sys.exit(1)
elapsed = time.monotonic() - began
print(output)
if job.returncode == 77:  # the command could not set up what it needs and said why: a skip
    sys.exit(77)
problems = []
if job.returncode == 0:
    problems.append("the job exited with status 0")
for pattern in args.match:
    if not re.search(pattern, output, re.S):
        problems.append(f"no output matches {pattern!r}")
if problems:
    print("FAIL: " + "; ".join(problems))
    sys.exit(1)
print(f"ok: the job failed (status {job.returncode}) in {elapsed:.1f} s, as expected")
