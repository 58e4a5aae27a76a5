#!/usr/bin/env python3
"""The fault-scenario suite: every way a job can go wrong that gradsync must turn into a clear
error on every rank, in bounded time. Each scenario runs a command that must fail (nonzero
status, output matching its expectation, within its time limit: a hang is the failure this
guards against), or for in-process scenarios a doctest case that asserts the failure itself.
Prints one line per scenario and "N passed, N failed" last; exits 1 when any failed.

usage: fault_suite.py --mpirun MPIEXEC --faults MPI_FAULTS [--tests GRADSYNC_TESTS]
                      [--env-launch ENV_LAUNCH_PY] [--only SUBSTRING]
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

# Processes of mpi_faults (tests/mpi/mpi_faults.cpp) under mpirun -np 3: rank 1 misbehaves in
# step 4; (name, scenario, what the output must say, seconds).
MPI = [
    ("mpi: a gradient reported twice", "throw",
     r"rank 1 aborts the job: .*step 4: grad_ready for parameter 'fc2.bias' was called twice in one step", 120),
    ("mpi: a gradient never reported", "missing",
     r"rank 1 aborts the job: .*step 4: synchronize\(\) found no grad_ready for 1 parameter: 'fc1.bias'", 120),
    ("mpi: a rank exits without a word", "exit", r"process rank 1 .*exiting improperly", 120),
    ("mpi: a rank stops calling collectives (peers name it, between steps)", "hang",
     r"rank [02] of 3: allreduce #[0-9]+ .* has not completed after 2 s \(MpiOptions::timeout\); this rank is in "
     r"synchronize\(\) of step 4.* Where the peers stand:.*rank 1 has completed [0-9]+ collectives and is in none: "
     r"in step 4, before any grad_ready\(\) or synchronize\(\).*Behind: rank 1", 120),
    # Either deadline may end the wait first (the backend's or DataParallel's, both 2 s): the
    # message then starts "rank 0 of 3: allreduce #N ..." or "rank 0, step 4: bucket B ...".
    ("mpi: a rank stuck in its backward (peers name the parameter it waits for)", "stuck",
     r"rank [02](?: of 3|, step 4).* Where the peers stand:.*rank 1 has completed [0-9]+ collectives and is in none: in the "
     r"backward of step 4, [0-9]+ of 4 buckets launched; bucket [0-9]+ waits for grad_ready of 'fc1.bias'.*"
     r"Behind: rank 1", 120),
    ("mpi: a stopped rank (SIGSTOP; peers say it did not answer)", "stop",
     r"rank [02] of 3.* Where the peers stand:.*rank 1 did not answer within [0-9]+ ms.*Behind: rank 1", 120),
    ("mpi: a rank leaves cleanly while its peers wait (they learn at once, not at 60 s)", "leave",
     r"rank 1 has left the group \(destroyed its MpiBackend\) after its collective #[0-9]+; allreduce #[0-9]+ .*, "
     r"which this rank is in, needs it and can never complete", 30),
    ("mpi: a ShardedDataParallel destroyed with reduce_scatters in flight (peers learn at once, not at 60 s)",
     "sharded-leave", r"rank 1 destroyed its ShardedDataParallel in step 4 with collectives in flight", 30),
]

# Processes started torchrun-style (tests/mpi/env_launch.py), joined through a name server:
# (name, env_launch arguments before the program, scenario, expectation, seconds).
ENV = [
    ("torchrun-style: rank 1 never arrives (the join's deadline)", ["--ranks", "0", "2"], "alone",
     r"rank 0 of 2 \(RANK/WORLD_SIZE\): the ranks have not all joined after 10 s \(1 of 2 are in\)", 120),
    ("torchrun-style, no name server: rank 0 never arrives (the others' deadline)",
     ["--own-server", "--ranks", "1", "2"], "alone",
     r"rank 1 of 2 \(RANK/WORLD_SIZE\): rank 0 did not serve MPI's name server at 127\.0\.0\.1:[0-9]+ "
     r"\(MASTER_ADDR, MASTER_PORT \+ 2\) in time", 120),
    ("torchrun-style, no name server: rank 1 never arrives (the join's deadline)",
     ["--own-server", "--ranks", "0", "2"], "alone",
     r"rank 0 of 2 \(RANK/WORLD_SIZE\): the ranks have not all joined after 10 s \(1 of 2 are in\)", 120),
    ("torchrun-style: two processes given RANK=1", ["--ranks", "0,1,1", "3"], "throw",
     r"rank 1 of 3 \(RANK/WORLD_SIZE\): (two processes were given RANK=1: process [^ ]+ of this job already holds it"
     r"|the joined processes were given the ranks 0, 1, 1. each of 0..2 must be given once)", 120),
    ("torchrun-style: a rank stops calling collectives", ["3"], "hang",
     r"rank [02] of 3: allreduce #[0-9]+ .* has not completed after 2 s.*Behind: rank 1", 120),
    ("torchrun-style: a rank exits without a word", ["3"], "exit",
     r"rank [02] of 3: allreduce #[0-9]+ .* has not completed after 2 s", 120),
    ("torchrun-style: nothing names the job", ["--bare", "2"], "throw",
     r"rank [01] of 2 \(RANK/WORLD_SIZE\): nothing names this job", 120),
    ("torchrun-style: two jobs given one job id never train together",
     ["--bare", "--jobs", "2", "--job-id", "one-name-for-two-jobs", "2"], "throw",
     r"two processes were given RANK=[01]: process [^ ]+ of this job already holds it", 120),
    # The first job has joined (and runs until its rank 1 hangs and the others give up) when the
    # second starts: each rank holds its claim while its job runs, not only while it joins.
    ("torchrun-style: a job given a running job's id is refused after that job has joined",
     ["--bare", "--jobs", "2", "--stagger", "3", "--job-id", "one-name-for-two-jobs", "2"], "hang",
     r"\[rank 1\.[01]\] .*two processes were given RANK=[01]: process [^ ]+ of this job already holds it", 120),
]

# In-process (LocalBackend ranks as threads): doctest cases of gradsync_tests that assert the
# failure on every rank themselves.
IN_PROCESS = [
    "a rank whose collective throws fails every rank, and they name it",
    "a rank that vanishes in a collective: every rank's error names it as the one behind",
    "a rank stuck in backward: peers name the parameters it has not produced",
    "a rank that reorders its collectives is caught at the first one out of place",
    "two DataParallel objects of one layout on one backend never average each other's gradients",
    "a NaN planted in one rank's gradient reaches every rank alike",
    "an exception in one rank's backward releases the others at once",
    "misused grad_ready is an error on the caller and on its peers",
    "a parameter without grad_ready is an error naming it and the step, on every rank",
    "no_sync after grad_ready on one rank fails the peer's step too, though its buckets completed",
    "step() under no_sync on one rank fails the peer at once, not at its deadline",
    "moved storage: a parameter that changes size, or a gradient that is gone, is an error naming it",
    "moved storage: a list read again with tensors renamed, reordered or replaced on one rank is refused on every rank",
    "moved storage: a parameter empty when wrapped that gets elements later is refused, not left unaveraged",
    "a ShardedDataParallel destroyed with reduce_scatters in flight fails its peers at once, naming it",
    "sharded: a rank that skipped an iteration is caught at that very step by its number, before any update",
    "sharded: a peer that waits past the deadline names the step and the bucket of its collective",
    "sharded: grad_ready twice on one rank fails its peers at once, naming the rank and the step",
    "sharded checkpoint: a missing, stale or foreign shard fails every rank alike and changes nothing",
    "sharded checkpoint: two trainers saving one path and a reader loading it meanwhile all succeed",
]


def run_failing(command, pattern, within):
    """Runs a command that must fail; returns (passed, seconds, why)."""
    began = time.monotonic()
    # A session of its own, so that a hung job is killed whole: the launcher and every rank.
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        return False, time.monotonic() - began, f"still running after {within} s: the failure hung the job", output
    seconds = time.monotonic() - began
    if job.returncode == 0:
        return False, seconds, "the job exited with status 0", output
    if not re.search(pattern, output, re.S):
        return False, seconds, f"no output matches {pattern!r}", output
    return True, seconds, "", output


def run_doctest(binary, case):
    began = time.monotonic()
    escaped = case.replace(",", "\\,")  # doctest splits filters on commas
    job = subprocess.run([binary, f"--test-case={escaped}", "--no-colors"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace", timeout=600)
    seconds = time.monotonic() - began
    ran = re.search(r"test cases:\s+(\d+) \|\s+(\d+) passed", job.stdout)
    if not ran or ran.group(1) != "1":
        return False, seconds, "no such test case ran", job.stdout
    if job.returncode != 0:
        return False, seconds, "its assertions failed", job.stdout
    return True, seconds, "", job.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--faults", required=True)
    parser.add_argument("--tests")
    parser.add_argument("--env-launch")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    mpirun = [args.mpirun, "--oversubscribe"]
    scenarios = []
    for name, scenario, pattern, within in MPI:
        scenarios.append((name, lambda s=scenario, p=pattern, w=within:
                          run_failing([*mpirun, "-np", "3", args.faults, s], p, w)))
    if args.env_launch:
        for name, launch, scenario, pattern, within in ENV:
            command = [sys.executable, args.env_launch, "--timeout", "100", *launch, args.faults, scenario]
            scenarios.append((name, lambda c=command, p=pattern, w=within: run_failing(c, p, w)))
    if args.tests:
        for case in IN_PROCESS:
            scenarios.append(("in-process: " + case, lambda c=case: run_doctest(args.tests, c)))
    scenarios = [(n, f) for n, f in scenarios if args.only in n]
    passed = failed = 0
    for i, (name, attempt) in enumerate(scenarios, 1):
        ok, seconds, why, output = attempt()
        if ok:
            passed += 1
            print(f"[{i}/{len(scenarios)}] passed  {name} ({seconds:.1f} s)", flush=True)
        else:
            failed += 1
            print(output)
            print(f"[{i}/{len(scenarios)}] FAILED  {name} ({seconds:.1f} s): {why}", flush=True)
    print(f"fault scenarios: {passed} passed, {failed} failed")
    return 1 if failed or not scenarios else 0


if __name__ == "__main__":
    sys.exit(main())
