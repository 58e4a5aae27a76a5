#!/usr/bin/env python3
"""The folders of include/gradsync are the library's layers; a header includes only headers of
its own layer or of the layers below it. This script is where the layers are listed, and the test
that fails when an include runs back up, when a header sits in no layer, when a detail/ header
(the bottom layer's helpers) includes anything but the bottom layer, or when a folder's own
detail/ (backend/detail/, say) is included from outside that folder.

Lowest first. A path ending in / is a folder (and everything under it); otherwise one header.
"""
import pathlib
import re
import sys

LAYERS = [
    ("vocabulary", ["version.hpp", "error.hpp", "bytes.hpp", "dtype.hpp", "half.hpp", "buffer.hpp",
                    "environment.hpp", "detail/", "cuda/"]),
    ("model access", ["model/"]),
    ("bucket planning", ["bucket/"]),
    ("backends", ["backend/"]),
    ("memory policies", ["memory/"]),
    ("AMP and LR policies", ["amp/", "lr.hpp"]),
    ("metrics writers", ["metrics/"]),
    ("communication hooks", ["reduction/"]),
    ("the DataParallel front and its parts", ["data_parallel/", "data_parallel.hpp", "sharded_data_parallel.hpp"]),
    ("launch helpers", ["launch/"]),
    ("checkpoints", ["checkpoint/"]),
    ("the umbrella header", ["gradsync.hpp"]),
    ("framework adapters, opt-in", ["torch.hpp", "eigen.hpp"]),
]

ROOT = pathlib.Path(__file__).resolve().parent.parent / "include" / "gradsync"
INCLUDE = re.compile(r'^\s*#\s*include\s*<gradsync/([^>]+)>', re.M)


def layer_of(relative):
    """The layer index of a header path relative to include/gradsync, or None."""
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if (entry.endswith("/") and relative.startswith(entry)) or relative == entry:
                return index
    return None


def main():
    problems = []
    headers = sorted(p for p in ROOT.rglob("*") if p.suffix in (".hpp", ".cuh"))
    for path in headers:
        relative = path.relative_to(ROOT).as_posix()
        mine = layer_of(relative)
        if mine is None:
            problems.append(f"{relative}: in no layer; add it to LAYERS in scripts/check_layers.py")
            continue
        for included in INCLUDE.findall(path.read_text()):
            theirs = layer_of(included)
            if theirs is None:
                problems.append(f"{relative}: includes {included}, which is in no layer")
            elif theirs > mine:
                problems.append(f"{relative} ({LAYERS[mine][0]}) includes {included} ({LAYERS[theirs][0]}), "
                                "a higher layer")
            elif relative.startswith("detail/") and theirs != 0:
                problems.append(f"{relative}: detail/ holds bottom-layer helpers, but it includes {included}")
            elif "/detail/" in included and not relative.startswith(included.split("/detail/")[0] + "/"):
                owner = included.split("/detail/")[0]
                problems.append(f"{relative} includes {included}: {owner}/detail/ is private to {owner}/ (move "
                                "what is shared down to detail/)")
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(f"{len(headers)} headers, {len(LAYERS)} layers: every include goes down or sideways")
    return 0


if __name__ == "__main__":
    sys.exit(main())
