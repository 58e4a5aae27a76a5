"""A gradsync checkpoint of a libtorch model read by Python's safetensors and PyTorch, and a state
dict Python wrote read by gradsync into the libtorch model.

usage: checkpoint_interop.py PROGRAM DIR   (PROGRAM: the checkpoint_interop binary)

1. PROGRAM write DIR trains the model on 2 ranks and saves a gradsync checkpoint;
   safetensors.torch.load_file gives every tensor its shape and dtype, and
   module.load_state_dict(..., strict=True) takes it into the same model defined here, whose output
   on the probe input equals the one libtorch computed;
2. a model of other weights is saved here with safetensors.torch.save_file(module.state_dict());
   PROGRAM read DIR loads it through gradsync and checks its output against this one's.
"""
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

INPUTS, HIDDEN, CLASSES, BATCH = 6, 5, 3, 4


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(INPUTS, HIDDEN)
        self.bn = torch.nn.BatchNorm1d(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def probe():
    return ((torch.arange(BATCH * INPUTS, dtype=torch.float32) - 10.0) * 0.1).reshape(BATCH, INPUTS)


def output_of(net):
    net.eval()
    with torch.no_grad():
        return net(probe())


def main():
    program, folder = sys.argv[1], sys.argv[2]
    failures = []

    subprocess.run([program, "write", folder], check=True)
    state = load_file(f"{folder}/gradsync.safetensors")
    net = Net()
    expected_shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    got_shapes = {k: tuple(v.shape) for k, v in state.items()}
    if got_shapes != expected_shapes:
        failures.append(f"shapes in the gradsync checkpoint {got_shapes}, the state dict's {expected_shapes}")
    if state["bn.num_batches_tracked"].dtype != torch.int64 or state["bn.num_batches_tracked"].item() != 3:
        failures.append(f"bn.num_batches_tracked is {state['bn.num_batches_tracked']!r}, not int64 3")
    net.load_state_dict(state, strict=True)
    theirs = torch.from_numpy(np.fromfile(f"{folder}/gradsync_output.bin", dtype=np.float32)).reshape(BATCH, CLASSES)
    ours = output_of(net)
    if not torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6):
        failures.append(f"outputs differ: Python {ours.tolist()}, libtorch {theirs.tolist()}")
    else:
        print("the gradsync checkpoint loads into PyTorch (strict) and gives libtorch's outputs")

    torch.manual_seed(2026)
    other = Net()
    other.train()
    with torch.no_grad():
        other(torch.randn(16, INPUTS))  # running statistics of their own
    save_file(other.state_dict(), f"{folder}/python.safetensors")
    output_of(other).numpy().astype(np.float32).tofile(f"{folder}/python_output.bin")
    first_ok = not failures
    second_ok = subprocess.run([program, "read", folder]).returncode == 0
    if not second_ok:
        failures.append("gradsync did not load Python's state dict into libtorch with Python's outputs")

    for f in failures:
        print("FAILED:", f)
    print(f"{int(first_ok) + int(second_ok)} of 2 directions passed")
    sys.exit(0 if first_ok and second_ok else 1)


if __name__ == "__main__":
    main()
