#!/usr/bin/env python3
"""The peer race: per-step gradient synchronization of PyTorch DDP (gloo, CPU) on 2 processes,
beside a raw gloo allreduce of one flat buffer of the same bytes, and beside gradsync's
DataParallel over MpiBackend and over SharedMemoryBackend (both from bench_mpi under mpirun) on
the same layouts, bucket cap and machine.

DDP synchronizes inside backward, so its cost is measured as the difference between a backward
with DDP's hooks and the same backward under ddp.no_sync(), interleaved, median of per-iteration
differences. The two libraries run in turn, layout by layout, for several rounds, and the
speed-up is the median of the per-round ratios: on a shared machine speed drifts by tens of
percent within a minute, so only measurements taken close together compare. The model has the gradient layout of ResNet-50 or BERT-base and a forward that
costs almost nothing (the loss is the sum of every parameter), so nothing else is measured.

usage: ddp_peer.py [--bench-mpi PATH] [--rounds 3] [--iterations N] [--bucket-cap-mb 25]
Without PyTorch it says so and exits 0 (scripts/bench.sh installs Debian's python3-torch). Exits 1
when a figure is not a finite positive number (a broken benchmark).
"""
import argparse
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time


def resnet50():
    """torchvision's ResNet-50, in registration order (as bench/model_layouts.hpp)."""
    t = []

    def conv(name, out, inp, k):
        t.append((name + ".weight", out * inp * k * k))

    def bn(name, c):
        t.append((name + ".weight", c))
        t.append((name + ".bias", c))

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    inp = 64
    for layer, blocks in enumerate([3, 4, 6, 3]):
        width = 64 << layer
        out = width * 4
        for b in range(blocks):
            p = f"layer{layer + 1}.{b}"
            conv(p + ".conv1", width, inp, 1)
            bn(p + ".bn1", width)
            conv(p + ".conv2", width, width, 3)
            bn(p + ".bn2", width)
            conv(p + ".conv3", out, width, 1)
            bn(p + ".bn3", out)
            if b == 0:
                conv(p + ".downsample.0", out, inp, 1)
                bn(p + ".downsample.1", out)
            inp = out
    t.append(("fc.weight", 1000 * 2048))
    t.append(("fc.bias", 1000))
    assert len(t) == 161 and sum(c for _, c in t) == 25_557_032
    return t


def bert_base():
    """Hugging Face's bert-base-uncased BertModel (as bench/model_layouts.hpp)."""
    hidden, ffn, vocab, positions, types = 768, 3072, 30522, 512, 2
    t = []

    def dense(name, out, inp):
        t.append((name + ".weight", out * inp))
        t.append((name + ".bias", out))

    def norm(name):
        t.append((name + ".weight", hidden))
        t.append((name + ".bias", hidden))

    t.append(("embeddings.word_embeddings.weight", vocab * hidden))
    t.append(("embeddings.position_embeddings.weight", positions * hidden))
    t.append(("embeddings.token_type_embeddings.weight", types * hidden))
    norm("embeddings.LayerNorm")
    for layer in range(12):
        p = f"encoder.layer.{layer}"
        for sub in ("attention.self.query", "attention.self.key", "attention.self.value",
                    "attention.output.dense"):
            dense(f"{p}.{sub}", hidden, hidden)
        norm(p + ".attention.output.LayerNorm")
        dense(p + ".intermediate.dense", ffn, hidden)
        dense(p + ".output.dense", hidden, ffn)
        norm(p + ".output.LayerNorm")
    dense("pooler.dense", hidden, hidden)
    assert len(t) == 199 and sum(c for _, c in t) == 109_482_240
    return t


LAYOUTS = {"resnet50": resnet50, "bert_base": bert_base}


def LayoutModule(torch, layout):
    """A module with the layout's parameters whose forward (through DDP, so that its hooks are
    armed) is the sum of all of them: backward writes a gradient of ones into every parameter."""

    class Layout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.full((count,), 0.5)) for _, count in layout])

        def forward(self):
            return sum(p.sum() for p in self.params)

    return Layout()


def worker(rank, world, port, args, names, queue):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in names:
        model = LayoutModule(torch, LAYOUTS[name]())
        params = model.params
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        flat = torch.ones(sum(p.numel() for p in params))

        def backward(sync):
            ddp.zero_grad(set_to_none=False)
            if sync:
                ddp().backward()
            else:
                with ddp.no_sync():
                    ddp().backward()

        def timed(f):
            dist.barrier()
            t0 = time.perf_counter()
            f()
            mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            return mine.item()

        sync_s, local_s, raw_s = [], [], []
        for i in range(-2, args.iterations):
            order = [True, False] if i % 2 == 0 else [False, True]
            t = {s: timed(lambda s=s: backward(s)) for s in order}
            r = timed(lambda: dist.all_reduce(flat))
            if i >= 0:
                sync_s.append(t[True])
                local_s.append(t[False])
                raw_s.append(r)
        diffs = [a - b for a, b in zip(sync_s, local_s)]
        results[name] = {
            "ddp_sync_ms": statistics.median(diffs) * 1e3,
            "ddp_step_ms": statistics.median(sync_s) * 1e3,
            "raw_ms": statistics.median(raw_s) * 1e3,
        }
        del ddp, model, params, flat
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def run_ddp(args, names):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args, names, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=1800)
    for p in procs:
        p.join()
    return results


def run_gradsync(args, name):
    """gradsync's in-place synchronize() over MpiBackend, the raw flat MPI_Allreduce, and
    synchronize() over SharedMemoryBackend, in ms, from bench_mpi."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("GRADSYNC_BENCH_RESULTS", None)  # its figures are this race's, written below
    cmd = ["mpirun", "--oversubscribe", "-np", "2", args.bench_mpi, "--iterations", str(args.iterations),
           "--layout", name, "--in-place-only"]
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    m = re.search(rf"^  {name}/in_place\s+synchronize\s+([0-9.]+) ms \([0-9. -]+\) \| raw flat\s+([0-9.]+) ms.*"
                  rf"\| SharedMemoryBackend synchronize\s+([0-9.]+) ms", out, re.M)
    if not m:
        raise SystemExit(f"no figure for {name} in bench_mpi's output:\n{out}")
    return float(m.group(1)), float(m.group(2)), float(m.group(3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench-mpi", default="build/bench/bench/bench_mpi")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skipped: PyTorch is not installed for this python3 (Debian: apt-get install python3-torch)")
        return 0
    if not os.path.exists(args.bench_mpi):
        raise SystemExit(f"{args.bench_mpi} not found: build the bench preset first (scripts/bench.sh does)")
    print(f"PyTorch {torch.__version__} DDP (gloo, CPU, {args.bucket_cap_mb:g} MB buckets) and gradsync "
          f"(MpiBackend, SharedMemoryBackend), 2 processes each, {args.rounds} rounds of {args.iterations} iterations",
          flush=True)
    rows = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name in LAYOUTS:
            ddp = run_ddp(args, [name])[name]
            ours, mpi_flat, shared = run_gradsync(args, name)
            rows[name].append((ddp["ddp_sync_ms"], ddp["raw_ms"], ours, mpi_flat, shared))
            print(f"  round {r + 1} {name:<10} DDP {ddp['ddp_sync_ms']:7.1f} ms   gradsync MPI {ours:6.1f} ms "
                  f"(ratio {ddp['ddp_sync_ms'] / ours:4.1f})   shared memory {shared:6.1f} ms "
                  f"(ratio {ddp['ddp_sync_ms'] / shared:4.1f})", flush=True)
    print()
    print(f"{'layout':<10} {'DDP sync':>10} {'gloo flat':>10} {'gradsync':>10} {'MPI flat':>10} {'DDP/gradsync':>13} "
          f"{'shared mem':>10} {'DDP/shared':>11}")
    ok = True
    med = statistics.median
    summary = []
    # (index of gradsync's figure in a run, its name, the target speed-up)
    contenders = [(2, "MpiBackend", 4.0), (4, "SharedMemoryBackend", 8.0)]
    for name, runs in rows.items():
        speedups = []
        for index, who, target in contenders:
            speedup = med([run[0] / run[index] for run in runs])
            speedups.append(speedup)
            ok = ok and speedup >= target
            summary.append({"figure": f"PyTorch {torch.__version__} DDP step sync / {who}, {name}",
                            "measured": med([r[0] for r in runs]), "unit": "ms", "reference": f"gradsync {who}",
                            "reference_value": med([r[index] for r in runs]), "ratio": speedup,
                            "target": f">= {target:g}", "met": speedup >= target,
                            "gloo_flat_ms": med([r[1] for r in runs]), "mpi_flat_ms": med([r[3] for r in runs])})
        print(f"{name:<10} {med([r[0] for r in runs]):8.1f} ms {med([r[1] for r in runs]):7.1f} ms "
              f"{med([r[2] for r in runs]):7.1f} ms {med([r[3] for r in runs]):7.1f} ms {speedups[0]:11.1f}x "
              f"{med([r[4] for r in runs]):7.1f} ms {speedups[1]:10.1f}x")
    print("(medians over rounds; the speed-up is the median of the per-round ratios)")
    figures = [x for runs in rows.values() for run in runs for x in run]
    if not all(math.isfinite(x) and x > 0 for x in figures):
        print("BROKEN: a time is not a finite positive figure")
        return 1
    print("targets: DDP / gradsync per step synchronization >= 4 over MpiBackend, >= 8 over SharedMemoryBackend: "
          f"{'met' if ok else 'MISSED'}")
    results = os.environ.get("GRADSYNC_BENCH_RESULTS")
    if results:
        name = "ddp_" + torch.__version__.split("+")[0]
        with open(os.path.join(results, name + ".json"), "w") as f:
            json.dump({"source": name, "rows": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
