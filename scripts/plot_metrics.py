#!/usr/bin/env python3
"""Draws gradsync's training scalars to a PNG, one panel per scalar over the steps.

Usage: plot_metrics.py SOURCE OUT.png [NAME ...]
SOURCE is a JSON lines file (StepMetrics' default format) or a TensorBoard log directory
(MetricsFormat::tensorboard; read with TensorBoard's reader). NAMEs pick the scalars (default:
every one). Needs matplotlib (and tensorboard for a log directory): pip install matplotlib tensorboard
"""
import json
import math
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def from_json_lines(path):
    series = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        step = record.pop("step")
        for name, value in record.items():
            series.setdefault(name, []).append((step, math.nan if value is None else value))
    return series


def from_event_dir(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(path), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    source, out, names = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    series = from_event_dir(source) if source.is_dir() else from_json_lines(source)
    if names:
        missing = [n for n in names if n not in series]
        if missing:
            print(f"no scalar named {', '.join(missing)} in {source}; it has {', '.join(sorted(series))}",
                  file=sys.stderr)
            return 1
        series = {n: series[n] for n in names}
    if not series:
        print(f"{source} holds no scalars", file=sys.stderr)
        return 1
    columns = min(3, len(series))
    rows = math.ceil(len(series) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    for ax, (name, points) in zip(axes.flat, sorted(series.items())):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    print(f"{out}: {len(series)} scalars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
