#!/usr/bin/env python3
"""Starts N processes the way torchrun does: each with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, none of them started by mpirun. MPI finds its
peers through a name server: this starts one (Open MPI's ompi-server) and names it to every
process in OMPI_MCA_pmix_server_uri, or with --own-server leaves that to rank 0 (MpiSession
starts one and serves its address on MASTER_PORT + 2).

usage: env_launch.py [--ranks 0,2 | --torchrun] [--jobs K [--stagger SECONDS]] [--bare] [--job-id TEXT]
                     [--own-server] [--timeout SECONDS] N command args...
  --ranks     start only these ranks (the others never arrive)
  --torchrun  let torchrun start them (`--redirects 1 --tee 1` works around Debian's torch 1.13,
              whose torchrun fails on Python 3.11 with its default of 0)
  --jobs      start K jobs of N ranks at once, each with its own MASTER_PORT, sharing the server
  --stagger   start job k that many seconds after job k - 1 instead
  --bare      no MASTER_ADDR or MASTER_PORT: nothing names the job
  --job-id    GRADSYNC_JOB_ID for every process
  --own-server start no name server and name none (OMPI_MCA_pmix_server_uri unset)
Prints every process's output, each line prefixed with its rank. When a process fails, the others
are killed 5 s later, as torchrun does; exits with the first nonzero status, or 1 when the
processes are still running at the timeout (they are killed).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n, command, ranks=None, timeout=300.0, torchrun=False, jobs=1, bare=False, job_id=None, stagger=0.0,
           own_server=False):
    """Runs `command` as ranks of a world of `n` (in `jobs` jobs); returns (status, output)."""
    ranks = list(range(n)) if ranks is None else ranks
    if torchrun:
        command = ["torchrun", "--nproc_per_node", str(n), "--redirects", "1", "--tee", "1", "--no_python", *command]
        ranks = ["torchrun"]
    with tempfile.TemporaryDirectory() as tmp:
        uri = os.path.join(tmp, "ompi-server.uri")
        server = None if own_server else subprocess.Popen(
            ["ompi-server", "--no-daemonize", "-r", uri], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            began = time.monotonic()
            while server and not (os.path.exists(uri) and os.path.getsize(uri) > 0):
                if server.poll() is not None or time.monotonic() - began > 30:
                    return 1, "env_launch: ompi-server did not start\n"
                time.sleep(0.05)
            base = {k: v for k, v in os.environ.items()
                    if k not in ("MASTER_ADDR", "MASTER_PORT", "GRADSYNC_JOB_ID", "TORCHELASTIC_RUN_ID",
                                 "SLURM_JOB_ID", "OMPI_MCA_pmix_server_uri")}
            base.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
            if server:
                base["OMPI_MCA_pmix_server_uri"] = "file:" + uri
            if job_id is not None:
                base["GRADSYNC_JOB_ID"] = job_id
            envs = [base if bare else dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
                    for _ in range(jobs)]
            if jobs > 1:
                ranks = [f"{j}.{r}" for j in range(jobs) for r in ranks]
            procs = []
            for r in ranks:
                job = int(str(r).split(".")[0]) if jobs > 1 else 0
                if stagger and job > 0 and str(r).endswith(".0"):
                    time.sleep(stagger)
                procs.append(subprocess.Popen(command, env=envs[0] if torchrun else
                                              dict(envs[job], RANK=str(r).split(".")[-1],
                                                   LOCAL_RANK=str(r).split(".")[-1]),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              errors="replace", start_new_session=True))
            outputs = [[] for _ in procs]

            def drain(i):
                for line in procs[i].stdout:
                    outputs[i].append(line)

            readers = [threading.Thread(target=drain, args=(i,)) for i in range(len(procs))]
            for t in readers:
                t.start()
            # As torchrun does: when one process fails, the others are stopped (after a grace
            # period in which they may report on their own), since MPI_Abort reaches only the
            # processes one mpirun started.
            deadline = time.monotonic() + timeout
            status, late, notes = 0, False, []
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    late = True
                    break
                failed = [(r, p.returncode) for r, p in zip(ranks, procs) if p.returncode not in (None, 0)]
                if failed and status == 0:
                    status = failed[0][1]
                    notes.append(f"env_launch: rank {failed[0][0]} exited with status {status}; "
                                 "stopping the others in 5 s\n")
                    deadline = min(deadline, time.monotonic() + 5)
                time.sleep(0.05)
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if status == 0:
                status = next((p.returncode for p in procs if p.returncode != 0), 0)
            if late and status == 0:
                status = 1
                notes.append(f"env_launch: still running after {timeout:.0f} s; killed\n")
            for t in readers:
                t.join()
            text = "".join(f"[rank {r}] {line}" for r, out in zip(ranks, outputs) for line in out)
            return status, text + "".join(notes)
        finally:
            if server:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks")
    parser.add_argument("--torchrun", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--stagger", type=float, default=0.0)
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--job-id")
    parser.add_argument("--own-server", action="store_true")
    parser.add_argument("n", type=int)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    status, output = launch(args.n, args.command, ranks, args.timeout, args.torchrun, args.jobs, args.bare,
                            args.job_id, args.stagger, args.own_server)
    sys.stdout.write(output)
    sys.exit(status)
