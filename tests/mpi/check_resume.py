#!/usr/bin/env python3
"""The example's checkpoint round trip under mpirun: 20 steps straight, then 10 steps saved to a
checkpoint and 10 more resumed from it, must end with the same weights (fingerprints printed by
rank 0). The checkpoint is read here by an independent safetensors reader (standard library
only), so that what we write is what Python tools expect.

With --env the processes are started torchrun-style (env_launch.py) instead of by mpirun, with
--torchrun by torchrun itself, and the straight run must also end with the same weights as mpirun's.

usage: check_resume.py [--env | --torchrun] NP EXAMPLE [mpirun args...]
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import env_launch

launcher = sys.argv[1][2:] if sys.argv[1] in ("--env", "--torchrun") else "mpirun"
np, example, *extra = sys.argv[1:] if launcher == "mpirun" else sys.argv[2:]
mpirun = ["mpirun", "--oversubscribe", "-np", np, *extra, example]


def run(*args, launcher=launcher):
    if launcher != "mpirun":
        status, out = env_launch.launch(int(np), [example, *args], timeout=600, torchrun=launcher == "torchrun")
        print(out)
        assert status == 0, f"the {launcher} launch failed with status {status}"
    else:
        out = subprocess.run(mpirun + list(args), check=True, stdout=subprocess.PIPE, text=True, timeout=600).stdout
        print(out)
    m = re.search(r"weights fingerprint ([0-9a-f]{16})", out)
    assert m, "no fingerprint in the output"
    return m.group(1)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    data = blob[8 + length:]
    assert (8 + length) % 8 == 0, "the data section is not 8-byte aligned"
    return header, data


with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt.safetensors")
    straight = run("--steps", "20")
    run("--steps", "10", "--save", ckpt)
    header, data = read_safetensors(ckpt)
    meta = header.pop("__metadata__")
    assert meta["gradsync.step"] == "10", meta
    assert meta["gradsync.world_size"] == np, meta
    assert meta["gradsync.sampler.seed"] == "7", meta
    w1 = header["fc1.weight"]
    assert w1["dtype"] == "F32" and w1["shape"] == [784, 512], w1  # the shape the model states
    begin, end = w1["data_offsets"]
    assert end - begin == 4 * 784 * 512
    values = struct.unpack_from("<4f", data, begin)
    assert all(abs(v) < 1.0 for v in values), values  # trained weights, not garbage
    names = sorted(header)
    assert "optimizer.velocity.0" in names and "fc2.bias" in names, names
    resumed = run("--steps", "20", "--resume", ckpt)
    print(f"straight {straight}, resumed {resumed}")
    if straight != resumed:
        print("FAIL: the resumed run ended with other weights than the straight one")
        sys.exit(1)
    if launcher != "mpirun":
        under_mpirun = run("--steps", "20", launcher="mpirun")
        if under_mpirun != straight:
            print(f"FAIL: mpirun's run ended with other weights ({under_mpirun}) than the {launcher} one")
            sys.exit(1)
        print(f"ok: the {launcher} launch trained exactly as mpirun's")
    print(f"ok: resumed bit for bit; checkpoint holds {len(names)} tensors")
