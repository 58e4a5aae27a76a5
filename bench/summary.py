#!/usr/bin/env python3
"""The one table that ends scripts/bench.sh: every benchmark's summary figures (the JSON files
they wrote into the results directory), each beside its ceiling or baseline measured in the same
run, the ratio, the target and whether it was met; all of them in results.json; and plots (PNG,
where matplotlib is installed) of the allreduce bandwidth against memcpy and raw MPI, synchronize() against
the flat allreduce, overlap with backward, and the race with PyTorch DDP.

usage: summary.py RESULTS_DIR
"""
import json
import math
import pathlib
import re
import sys

ORDER = ["local", "mpi", "mpi_busy", "mpi_torchrun", "nodes", "torch_adapter", "compile"]  # then the DDP races
TITLES = {
    "local": "LocalBackend (ranks as threads) and DataParallel, 2 ranks",
    "mpi": "MpiBackend, 2 processes under mpirun",
    "mpi_busy": "MpiBackend, 2 processes under mpirun, beside one busy-looping thread per core",
    "mpi_torchrun": "MpiBackend, 2 processes started torchrun-style (TCP)",
    "nodes": "2 machines of 2 ranks played on one, links slowed to 1 Gbit/s (scripts/nodes.py)",
    "torch_adapter": "The libtorch adapter, 2 ranks",
    "compile": "Compile cost",
}


def title(name):
    if name.startswith("ddp_"):
        return f"The race with PyTorch {name[4:]} DDP (gloo), 2 processes"
    return TITLES.get(name, name)


def load(directory):
    sources = {}
    for path in sorted(directory.glob("*.json")):
        if path.name == "results.json":
            continue
        data = json.loads(path.read_text())
        if "source" in data and "rows" in data:  # not, say, Google Benchmark's own output
            sources[data["source"]] = data
    names = [n for n in ORDER if n in sources] + sorted(n for n in sources if n not in ORDER)
    return {n: sources[n] for n in names}


def number(value, unit):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if unit == "B":
        for step, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= step:
                return f"{value / step:.1f} {name}"
        return f"{value:.0f} B"
    digits = 3 if abs(value) < 1 else 2 if abs(value) < 100 else 1
    return f"{value:.{digits}f} {unit}"


def verdict(row, quick):
    if row.get("target", "-") == "-" or quick:
        return ""
    return "met" if row.get("met") else "MISSED"


def print_table(sources):
    print("\n== Summary: every figure beside its ceiling or baseline measured in the same run ==\n")
    header = f"{'figure':<70} {'measured':>12}  {'same-run reference':<34} {'ratio':>7}  {'target':<9} "
    print(header)
    print("-" * len(header))
    missed, any_quick = 0, False
    for name, data in sources.items():
        quick = data.get("quick", False)
        any_quick = any_quick or quick
        print(f"{title(name)}{' (quick run)' if quick else ''}")
        for row in data["rows"]:
            unit = row.get("unit", "")
            reference = row.get("reference", "")
            if row.get("reference_value") is not None:
                reference_unit = row.get("reference_unit", unit)
                reference = f"{reference} {number(row['reference_value'], reference_unit)}".strip()
            ratio = row.get("ratio")
            ratio_text = f"{ratio:7.3f}" if isinstance(ratio, (int, float)) and math.isfinite(ratio) else "      -"
            v = verdict(row, quick)
            missed += v == "MISSED"
            print(f"  {row['figure'][:68]:<68} {number(row.get('measured'), unit):>12}  {reference[:34]:<34} "
                  f"{ratio_text}  {row.get('target', '-'):<9} {v}")
    if any_quick:
        print("\n(a quick run: its figures are not measurements, and have no verdict)")
    print(f"\n{missed} target(s) missed" if missed else "\nevery target with a verdict met")


def plots(sources, directory):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (Debian: python3-matplotlib)")
        return []
    made = []

    def save(fig, name):
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    local = sources.get("local", {})
    seconds = local.get("seconds", {})
    counters = local.get("counters", {})

    def sweep(prefix):
        points = []
        for key, s in seconds.items():
            m = re.fullmatch(prefix + r"/bytes:(\d+)", key)
            if m and s:
                points.append((int(m.group(1)), int(m.group(1)) / s / 1e9))
        return sorted(points)

    allreduce, memcpy = sweep("allreduce_2_ranks"), sweep("memcpy")
    # Across processes (bench_mpi): raw MPI_Allreduce and MpiBackend's, 2 processes.
    mpi_points = sources.get("mpi", {}).get("bandwidth", [])
    raw_mpi = [(p["bytes"], p["bytes"] / p["raw_s"] / 1e9) for p in mpi_points if p.get("raw_s")]
    ours_mpi = [(p["bytes"], p["bytes"] / p["gradsync_s"] / 1e9) for p in mpi_points if p.get("gradsync_s")]
    sharded_mpi = [(p["bytes"], p["bytes"] / p["gradsync_sharded_s"] / 1e9)
                   for p in mpi_points if p.get("gradsync_sharded_s")]
    if allreduce and memcpy:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(*zip(*allreduce), "o-", label="LocalBackend allreduce, 2 ranks (busbw)")
        ax.plot(*zip(*memcpy), "s--", label="memcpy, one thread (the ceiling)")
        if raw_mpi and ours_mpi:
            ax.plot(*zip(*ours_mpi), "^-", label="MpiBackend allreduce, 2 processes")
            ax.plot(*zip(*raw_mpi), "v:", label="raw MPI_Allreduce, 2 processes")
        if sharded_mpi:
            ax.plot(*zip(*sharded_mpi), "x-.", label="MpiBackend reduce_scatter + all_gather, 2 processes")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # memcpy in cache is tens of times the rest
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title("Allreduce bandwidth against memcpy and raw MPI, same run")
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "allreduce_bandwidth.png")

    bars = []  # (label, synchronize ms, flat ms)
    for layout in ("resnet50", "bert_base"):
        for mode in ("in_place", "packed"):
            c = counters.get(f"synchronize_vs_flat/{layout}/{mode}", {})
            if "sync_ms" in c and "flat_ms" in c:
                bars.append((f"{layout}\nLocal {mode}", c["sync_ms"], c["flat_ms"]))
    for row in sources.get("mpi", {}).get("rows", []):
        m = re.fullmatch(r"MpiBackend synchronize\(\) (\w+)/(\w+) / raw per tensor", row["figure"])
        if m and row.get("measured") and row.get("reference_value"):
            bars.append((f"{m.group(1)}\nMPI {m.group(2)}", row["measured"], row["reference_value"]))
    if bars:
        fig, ax = plt.subplots(figsize=(max(7, len(bars) * 1.1), 4))
        x = range(len(bars))
        ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="synchronize()")
        ax.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="the ceiling (Local: one flat allreduce; MPI: raw MPI_Allreduce of the same gradients)")
        ax.set_xticks(list(x), [b[0] for b in bars], fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title("synchronize() against the flat allreduce, 2 ranks, same run")
        ax.legend()
        save(fig, "synchronize_vs_flat.png")

    overlap = {}  # (layout, comm/compute) -> {cap: exposed ms}
    floors = {}  # (layout, comm/compute) -> the least exposure any plan leaves, ms
    caps = []
    for key, c in counters.items():
        # One benchmark per layout and ratio; its counters per plan, "<cap>.exposed_ms".
        m = re.fullmatch(r"overlap/(\w+)/comm_to_compute:([0-9.]+)", key)
        if not m:
            continue
        short = {"resnet50": "ResNet-50", "bert_base": "BERT-base"}.get(m.group(1), m.group(1))
        where = (short, m.group(2))
        for name, value in c.items():
            if not name.endswith(".exposed_ms"):
                continue
            cap = name[: -len(".exposed_ms")]
            overlap.setdefault(where, {})[cap] = value
            caps += [cap] if cap not in caps else []
        if "floor_ms" in c:
            floors[where] = c["floor_ms"]
    if overlap:
        caps.sort(key=lambda cap: (cap == "auto", -int(cap) if cap.isdigit() else 0))
        fig, ax = plt.subplots(figsize=(max(8, len(overlap) * 1.2), 4))
        groups = list(overlap.items())
        width = 0.8 / len(caps)
        for k, cap in enumerate(caps):
            label = ("autotuned from 8 MiB growing (the default here)" if cap == "auto" else
                     f"{cap[:-4]} MiB growing along backward" + (", untuned" if cap == "8grow" else "")
                     if cap.endswith("grow") else
                     f"{cap} MiB filled forward" + (" (PyTorch DDP's)" if cap == "25" else ""))
            ax.bar([i + (k - (len(caps) - 1) / 2) * width for i in range(len(groups))],
                   [g.get(cap, 0) for _, g in groups], width, label=label)
        for i, (where, _) in enumerate(groups):
            if where in floors:
                ax.hlines(floors[where], i - 0.45, i + 0.45, colors="black", linewidths=1.5,
                          label="floor: the least any plan leaves" if i == 0 else None)
        ax.set_xticks(range(len(groups)), [f"{layout}\ncomm/compute\n{ratio}" for (layout, ratio), _ in groups],
                      fontsize=7)
        ax.set_ylabel("ms of communication left after backward")
        ax.set_title("Exposed communication by bucket plan, synthetic backward, 2 ranks")
        ax.legend(fontsize=7)
        save(fig, "overlap.png")

    trace = directory / "timeline_resnet50.json"
    if trace.exists():
        plot_timeline(plt, json.loads(trace.read_text()), save)

    races = [(n, d) for n, d in sources.items() if n.startswith("ddp_")]
    if races:
        labels, ddp, ours = [], [], []
        for name, data in races:
            for row in data["rows"]:
                layout = row["figure"].rsplit(", ", 1)[-1]
                backend = "shared memory" if "SharedMemory" in row.get("reference", "") else "MPI"
                labels.append(f"{layout}\n{backend}\nPyTorch {name[4:]}")
                ddp.append(row["measured"])
                ours.append(row["reference_value"])
        fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.3), 4))
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], ddp, 0.4, label="PyTorch DDP (gloo)")
        ax.bar([i + 0.2 for i in x], ours, 0.4, label="gradsync (the backend named below)")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("ms per step's gradient synchronization")
        ax.set_title("The race with PyTorch DDP, 2 processes, same machine")
        ax.legend()
        save(fig, "ddp_race.png")
    return made


def plot_timeline(plt, trace, save):
    """Rank 0's last step of a Chrome trace from Options::timeline: each bucket's allreduce
    (launched to done) and the moment its last gradient was ready, against the step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("pid") == 0 and "args" in e]
    steps = [e for e in events if e.get("name") == "step"]
    if not steps:
        return
    last = max(steps, key=lambda e: e["args"]["step"])
    number = last["args"]["step"]
    start = last["ts"]
    spans = [e for e in events if e.get("name") == "allreduce" and e["args"].get("step") == number]
    ready = {e["args"]["bucket"]: e["ts"] for e in events if e.get("name") == "ready" and e["args"].get("step") == number}
    if not spans:
        return
    fig, ax = plt.subplots(figsize=(9, max(3, len(spans) * 0.06 + 2)))
    end_of_backward = (max(ready.values()) - start) / 1e3 if ready else None
    if end_of_backward is not None:
        ax.axvspan(0, end_of_backward, color="0.9", label="backward (until its last gradient)")
    for e in spans:
        b = e["args"]["bucket"]
        ax.barh(b, e["dur"] / 1e3, left=(e["ts"] - start) / 1e3, height=0.8, color="tab:blue")
        if b in ready:
            ax.plot((ready[b] - start) / 1e3, b, "|", color="tab:red", markersize=4)
    ax.plot([], [], "|", color="tab:red", label="bucket complete")
    ax.barh([], [], color="tab:blue", label="its allreduce")
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first gradient")
    ax.set_ylabel("bucket, in launch order")
    ax.set_title(f"One overlapped step (rank 0, step {number}): ResNet-50, autotuned buckets, comm/compute 0.5")
    ax.legend(fontsize=7, loc="upper right")
    save(fig, "overlap_timeline.png")


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    directory = pathlib.Path(sys.argv[1])
    sources = load(directory)
    if not sources:
        print(f"no results in {directory}", file=sys.stderr)
        return 1
    print_table(sources)
    rows = [dict(row, source=name) for name, data in sources.items() for row in data["rows"]]
    (directory / "results.json").write_text(json.dumps({"rows": rows, "sources": sources}, indent=1))
    print(f"\nresults: {directory / 'results.json'}")
    for path in plots(sources, directory):
        print(f"plot:    {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
