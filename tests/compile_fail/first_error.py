#!/usr/bin/env python3
"""Compiles code that must not compile and checks what the user reads first: the compiler fails,
its first error (with the notes after it) matches a regular expression, and no more than a few
errors follow it.

usage: first_error.py --expect REGEX [--most N] -- compiler args...
"""
import argparse
import re
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--expect", required=True)
parser.add_argument("--most", type=int, default=2, help="the most errors allowed in all")
parser.add_argument("command", nargs=argparse.REMAINDER)
args = parser.parse_args()
command = args.command[1:] if args.command[:1] == ["--"] else args.command

result = subprocess.run(command, capture_output=True, text=True, errors="replace")
output = result.stdout + result.stderr
# An error is a diagnostic line "file:line[:column]: [fatal ]error: ..."; the notes and source
# excerpts after it, up to the next error, belong to it.
is_error = re.compile(r"^\S.*?:\d+(:\d+)?: (fatal )?error: ")
blocks = []
for line in output.splitlines():
    if is_error.match(line):
        blocks.append([line])
    elif blocks:
        blocks[-1].append(line)
problems = []
if result.returncode == 0:
    problems.append("it compiled")
elif not blocks:
    problems.append("no error line in the output")
else:
    if not re.search(args.expect, "\n".join(blocks[0])):
        problems.append(f"the first error does not match {args.expect!r}: {blocks[0][0]}")
    if len(blocks) > args.most:
        problems.append(f"{len(blocks)} errors, more than {args.most}")
if problems:
    print(output)
    print("FAIL: " + "; ".join(problems))
    sys.exit(1)
print(f"ok ({len(blocks)} errors): {blocks[0][0]}")
