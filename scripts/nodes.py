#!/usr/bin/env python3
"""Several machines on one: network namespaces joined by a bridge, each "node" with its own
hostname and /dev/shm (its TMPDIR), and mpirun started across them (its remote agent enters a node's
namespaces instead of ssh). Between nodes MPI talks TCP over veth links (optionally slowed with a
tc token bucket); within a node, shared memory.

  nodes.py run --nodes 2 --per-node 2 [--rate 1gbit] [--same-hostname] [--torchrun-style | --torchrun]
               [--cut-link NODE@SECONDS | --kill-node NODE@SECONDS] -- PROGRAM ARGS...
      sets the nodes up, runs PROGRAM on every rank under mpirun, takes them down again;
      --torchrun-style starts the ranks without mpirun instead, as torchrun does on each machine:
      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT at node 0;
      --torchrun has torchrun itself start them, one torchrun per node (static rendezvous at node 0);
      --cut-link takes node NODE's link down SECONDS after the start, or after the first output
      line that matches --cut-after REGEX (a machine that vanishes); mpirun, which waits for the
      lost node's daemon, is ended --grace seconds later (default 30), as a scheduler would;
      --kill-node kills the program's processes on node NODE instead (SIGKILL, as the kernel's
      out-of-memory killer does), their node and its MPI daemon left running
  nodes.py up --nodes 2 [--rate 1gbit] [--same-hostname]   /   nodes.py down
  nodes.py check      exit 0 where namespaces can be made here, 77 (and why) where not

Needs root, iproute2 (ip, tc), util-linux (unshare) and Open MPI. One set of nodes at a time per
machine (fixed names): tests that use it take a lock.
"""
import argparse
import json
import os
import pathlib
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

PREFIX = "gsnode"
BRIDGE = "gsbr0"
SUBNET = "10.77.0"
STATE = pathlib.Path("/run/gradsync-nodes.json")
# Each node's /dev/shm, shared by all of its processes (however they were started), as a
# machine's is: a directory per node, bound over /dev/shm in each process's mount namespace.
NODE_SHM = pathlib.Path("/run/gradsync-nodes-shm")
SKIP = 77  # ctest's SKIP_RETURN_CODE


def sh(*args):
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"nodes.py: {' '.join(args)} failed: {out.stderr.strip()}")


def address(i):
    return f"{SUBNET}.{i + 1}"


def why_not():
    """Why namespaces cannot be made here, or None."""
    for tool in ("ip", "tc", "unshare", "mpirun"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return "ip netns add failed: " + made.stderr.strip()
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def down():
    for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(PREFIX):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    # A namespace goes only once nothing holds it; its links are deleted here in any case.
    for line in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.split("\n"):
        link = line.split("@")[0].split(" ")[0]
        if link.startswith("gsv"):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    if NODE_SHM.exists():
        for node in NODE_SHM.iterdir():
            subprocess.run(["umount", "-l", str(node)], capture_output=True)
    shutil.rmtree(NODE_SHM, ignore_errors=True)
    STATE.unlink(missing_ok=True)


def burst_for(rate):
    """A token bucket deep enough for one timer tick at `rate` ("1gbit", "100mbit")."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            bits = float(rate[: -len(unit)]) * scale
            return max(32 * 1024, int(bits / 8 / 250))
    raise SystemExit(f"nodes.py: a rate like 1gbit or 100mbit, got {rate}")


def up(nodes, rate=None, same_hostname=False):
    down()
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for i in range(nodes):
        ns, veth = f"{PREFIX}{i}", f"gsv{i}"
        (NODE_SHM / str(i)).mkdir(parents=True)
        sh("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(NODE_SHM / str(i)))
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", BRIDGE, "up")
        sh("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate:
            # Both directions of the node's link: what it sends (eth0 inside) and receives.
            tbf = ["tbf", "rate", rate, "burst", str(burst_for(rate)), "latency", "100ms"]
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
            sh("tc", "qdisc", "add", "dev", veth, "root", *tbf)
    STATE.write_text(json.dumps({"nodes": nodes, "same_hostname": same_hostname, "rate": rate}))


def cut_link(node):
    """Node `node` vanishes from the network: its link goes down, its processes live on."""
    print(f"nodes.py: node {node}'s link goes down", flush=True)
    sh("ip", "link", "set", f"gsv{node}", "down")


def kill_node(node, program):
    """Node `node`'s ranks die at once: every process of `program` in its namespace gets SIGKILL."""
    print(f"nodes.py: the ranks on node {node} are killed", flush=True)
    pids = subprocess.run(["ip", "netns", "pids", f"{PREFIX}{node}"], capture_output=True, text=True).stdout.split()
    name = pathlib.Path(program).name[:15]  # the kernel's command name is at most 15 characters
    for pid in pids:
        try:
            if pathlib.Path(f"/proc/{pid}/comm").read_text().strip() == name:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # already gone


def agent(argv):
    """Open MPI's remote agent: `agent [ssh options] HOST COMMAND...` runs COMMAND on node HOST,
    in its network namespace with its own hostname and /dev/shm."""
    while argv and argv[0].startswith("-"):
        argv = argv[1:]
    host, command = argv[0], " ".join(argv[1:])
    state = json.loads(STATE.read_text())
    index = next((i for i in range(state["nodes"]) if address(i) == host), None)
    if index is None:
        raise SystemExit(f"nodes.py agent: no node has address {host}")
    hostname = "node" if state["same_hostname"] else f"node{index}"
    # /tmp stays shared (the programs may live there); MPI's session files go to the node's own.
    inner = (f"hostname {hostname} && mount --bind {NODE_SHM / str(index)} /dev/shm && export TMPDIR=/dev/shm && "
             f"exec sh -c {shlex.quote(command)}")
    os.execvp("ip", ["ip", "netns", "exec", f"{PREFIX}{index}", "unshare", "--uts", "--mount",
                     "--propagation", "private", "sh", "-c", inner])


def mpirun_command(nodes, per_node, program, rate=None):
    hosts = ",".join(f"{address(i)}:{per_node}" for i in range(nodes))
    passed = [f"GRADSYNC_TEST_NODES={nodes}", f"GRADSYNC_TEST_RANKS_PER_NODE={per_node}"]
    if rate:
        passed.append(f"GRADSYNC_TEST_LINK_RATE={rate}")
    if os.environ.get("GRADSYNC_BENCH_RESULTS"):
        passed.append("GRADSYNC_BENCH_RESULTS")  # where benchmarks write their figures
    me = pathlib.Path(__file__).resolve()
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--host", hosts, "-np", str(nodes * per_node),
            "--mca", "plm_rsh_agent", f"{sys.executable} {me} agent",
            "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24", "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
            "--mca", "btl", "self,vader,tcp",
            *[x for v in passed for x in ("-x", v)], *program]


TORCHRUN_STYLE_PORT = 29650  # MASTER_PORT of a launch without mpirun


def torchrun_style_command(nodes, per_node, program, rate=None, torchrun=False):
    """The command that starts every rank without mpirun (`nodes.py start-ranks ...`), itself or
    through one torchrun per node."""
    me = pathlib.Path(__file__).resolve()
    how = "torchrun" if torchrun else "direct"
    return [sys.executable, str(me), "start-ranks", how, str(nodes), str(per_node), rate or "", *program]


def torchrun_on_node(node, nodes, per_node, program):
    """torchrun on one node, as a user starts it on each machine (`--redirects 1 --tee 1`: Debian's
    torch 1.13 fails on Python 3.11 with its default of 0)."""
    return ["torchrun", "--nnodes", str(nodes), "--nproc_per_node", str(per_node), "--node_rank", str(node),
            "--master_addr", address(0), "--master_port", str(TORCHRUN_STYLE_PORT), "--redirects", "1", "--tee", "1",
            "--no_python", *program]


def start_ranks(argv):
    """`start-ranks direct|torchrun NODES PER_NODE RATE PROGRAM...`: every rank in its node, each
    told its place as torchrun tells it (direct), or one torchrun per node; their output, each line
    prefixed with the rank (or node); the first failure's status (the others are stopped 5 s after
    it, as torchrun does)."""
    how, nodes, per_node, rate, program = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4:]
    me = pathlib.Path(__file__).resolve()
    env = dict(os.environ, WORLD_SIZE=str(nodes * per_node), LOCAL_WORLD_SIZE=str(per_node),
               MASTER_ADDR=address(0), MASTER_PORT=str(TORCHRUN_STYLE_PORT), GRADSYNC_TEST_NODES=str(nodes),
               GRADSYNC_TEST_RANKS_PER_NODE=str(per_node))
    for unset in ("OMPI_MCA_pmix_server_uri", "GRADSYNC_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(unset, None)
    if rate:
        env["GRADSYNC_TEST_LINK_RATE"] = rate
    procs = []
    if how == "torchrun":  # torchrun sets the places itself
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name)
        starts = [(f"node {node}", address(node), torchrun_on_node(node, nodes, per_node, program), env)
                  for node in range(nodes)]
    else:
        starts = [(f"rank {rank}", address(rank // per_node), program,
                   dict(env, RANK=str(rank), LOCAL_RANK=str(rank % per_node))) for rank in range(nodes * per_node)]
    for _, host, command, environment in starts:
        procs.append(subprocess.Popen([sys.executable, str(me), "agent", host, shlex.join(command)], env=environment,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                      start_new_session=True))
    lock = threading.Lock()

    def relay(name, proc):
        for line in proc.stdout:
            with lock:
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()

    relays = [threading.Thread(target=relay, args=(start[0], p)) for start, p in zip(starts, procs)]
    for t in relays:
        t.start()
    status, stop_at = 0, None
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and stop_at is None:
            status, stop_at = failed[0], time.monotonic() + 5
        if stop_at is not None and time.monotonic() > stop_at:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.05)
    for t in relays:
        t.join()
    return status or next((p.returncode for p in procs if p.returncode != 0), 0)


def run(command, args, program):
    """Runs mpirun, its output passed on line by line; cuts a link or kills a node's ranks when
    told, and ends a job that waits on a vanished node past the grace period, as a scheduler
    would."""
    began = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                           start_new_session=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in job.stdout] + [lines.put(None)], daemon=True).start()
    fault = args.cut_link or args.kill_node
    cut_node, cut_delay = (int(x) for x in fault.split("@")) if fault else (None, 0)
    timer_from = began if fault and not args.cut_after else None
    cut_at = None
    while True:
        now = time.monotonic()
        if timer_from is not None and cut_at is None and now >= timer_from + cut_delay:
            if args.kill_node:
                kill_node(cut_node, program[0])
            else:
                cut_link(cut_node)
            cut_at = now
        deadline = began + args.timeout
        if cut_at is not None:
            deadline = min(deadline, cut_at + args.grace)
        if now >= deadline:
            why = (f"mpirun still waits for the vanished node {args.grace:g} s after its link went down; ending it, "
                   "as a scheduler would" if cut_at is not None and cut_at + args.grace <= began + args.timeout
                   else f"the program ran past {args.timeout:g} s")
            print(f"nodes.py: {why}", flush=True)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            return 124
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            return job.wait()
        sys.stdout.write(line)
        sys.stdout.flush()
        if timer_from is None and fault and re.search(args.cut_after, line):
            timer_from = time.monotonic()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        return agent(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "start-ranks":
        return start_ranks(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "up", "down", "check"])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--rate", help="slow every node's link to this rate (tc tbf): 1gbit, 100mbit")
    parser.add_argument("--same-hostname", action="store_true", help="every node named 'node'")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the program may run")
    parser.add_argument("--cut-link", metavar="NODE@SECONDS", help="take a node's link down after a while")
    parser.add_argument("--kill-node", metavar="NODE@SECONDS", help="kill the program's processes on a node")
    parser.add_argument("--cut-after", metavar="REGEX",
                        help="count the seconds of --cut-link or --kill-node from the first line matching")
    parser.add_argument("--torchrun-style", action="store_true",
                        help="start the ranks without mpirun, as torchrun does (MPI joins them)")
    parser.add_argument("--torchrun", action="store_true", help="start them with torchrun, one per node")
    parser.add_argument("--grace", type=float, default=30,
                        help="seconds after a cut that mpirun may go on waiting for the lost node")
    argv = sys.argv[1:]
    program = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.command == "check":
        reason = why_not()
        if reason:
            print(f"nodes.py: cannot play several machines here: {reason}")
            return SKIP
        return 0
    if args.command == "down":
        return down()
    if args.command == "up":
        return up(args.nodes, args.rate, args.same_hostname)
    if not program:
        parser.error("run needs a program after --")
    if args.cut_link and args.kill_node:
        parser.error("--cut-link and --kill-node: one fault at a time")
    reason = why_not()
    if reason:
        print(f"nodes.py: cannot play several machines here, so this test is skipped: {reason}")
        return SKIP
    try:
        up(args.nodes, args.rate, args.same_hostname)
        print(f"nodes.py: {args.nodes} nodes x {args.per_node} ranks" + (f", links at {args.rate}" if args.rate else ""),
              flush=True)
        if args.torchrun_style or args.torchrun:
            command = torchrun_style_command(args.nodes, args.per_node, program, args.rate, args.torchrun)
        else:
            command = mpirun_command(args.nodes, args.per_node, program, args.rate)
        return run(command, args, program)
    finally:
        down()


if __name__ == "__main__":
    sys.exit(main())
