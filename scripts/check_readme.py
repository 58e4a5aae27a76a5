#!/usr/bin/env python3
"""Keeps the code in README.md and docs/*.md honest.

A fenced block right after `<!-- file: PATH -->` must equal that file; after
`<!-- snippet: PATH#NAME -->`, the lines of PATH between `// [NAME]` and `// [/NAME]`; after
`<!-- diff: A B -->`, the unified diff from file A to file B. --write rewrites the
blocks from the files instead of checking them. Relative links between the pages must lead to
files that exist.
"""
import difflib
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#:]+)(#[^)]*)?\)")
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


def check_page(page, write):
    text = page.read_text()
    name = page.relative_to(ROOT)
    problems = []

    def replace(match):
        kind, args, fence, body, close = match.groups()
        want = expected(kind, args)
        if body != want:
            problems.append(f"{name}: the block after <!-- {kind}: {args} --> is stale")
        return f"<!-- {kind}: {args} -->\n{fence}{want}{close}"

    new_text = MARKER.sub(replace, text)
    if write and new_text != text:
        page.write_text(new_text)
        print(f"{name}: blocks rewritten")
        return []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    for target, _ in LINK.findall(prose):
        if not (page.parent / target).exists():
            problems.append(f"{name}: the link to {target} leads nowhere")
    return problems


def main():
    write = "--write" in sys.argv[1:]
    problems = []
    for page in PAGES:
        problems += check_page(page, write)
    if not MARKER.search(PAGES[0].read_text()):
        problems.append("README.md has no checked code block")
    for p in problems:
        print(p)
    if problems:
        print("run `python3 scripts/check_readme.py --write` after checking the change")
        return 1
    print(f"the code blocks and links of {len(PAGES)} pages are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
