#!/usr/bin/env python3
"""Keeps README.md's code honest.

A fenced block right after `<!-- file: PATH -->` must equal that file; after
`<!-- snippet: PATH#NAME -->`, the lines of PATH between `// [NAME]` and `// [/NAME]`; after
`<!-- diff: A B -->`, the unified diff from file A to file B. --write rewrites the
blocks from the files instead of checking them.
"""
import difflib
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- (file|snippet|diff): ([^>]+?) -->\n(```[a-z]*\n)(.*?)(```)", re.S)


def expected(kind, args):
    if kind == "file":
        return (ROOT / args).read_text()
    if kind == "snippet":
        path, name = args.split("#")
        lines = (ROOT / path).read_text().splitlines(keepends=True)
        stripped = [line.strip() for line in lines]
        if f"// [{name}]" not in stripped or f"// [/{name}]" not in stripped:
            raise SystemExit(f"{path} has no region [{name}]")
        begin, end = stripped.index(f"// [{name}]"), stripped.index(f"// [/{name}]")
        return textwrap.dedent("".join(lines[begin + 1:end]))
    a, b = args.split()
    lines = difflib.unified_diff(
        (ROOT / a).read_text().splitlines(keepends=True),
        (ROOT / b).read_text().splitlines(keepends=True),
        fromfile=a, tofile=b)
    return "".join(lines)


def main():
    text = README.read_text()
    problems = []

    def replace(match):
        kind, args, fence, body, close = match.groups()
        want = expected(kind, args)
        if body != want:
            problems.append(f"README.md: the block after <!-- {kind}: {args} --> is stale")
        return f"<!-- {kind}: {args} -->\n{fence}{want}{close}"

    new_text = MARKER.sub(replace, text)
    if "--write" in sys.argv[1:]:
        README.write_text(new_text)
        print("README.md blocks rewritten")
        return 0
    if not MARKER.search(text):
        problems.append("README.md has no checked code block")
    for p in problems:
        print(p)
    if problems:
        print("run `python3 scripts/check_readme.py --write` after checking the change")
        return 1
    print("README.md code blocks are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
