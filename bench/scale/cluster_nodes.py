"""Expert parallelism across real network addresses: Ray nodes in network namespaces on this
machine (tools/netns_cluster.py), colibri's head as a process on the head node.

1. The hop: decode tok/s and where each MoE layer's time goes (workers computing, transport)
   with 0, 0.1 and 0.5 ms of added round-trip time on the worker nodes' links (a userspace
   delay line or tc netem, as the kernel allows), over each wire (tcp: colibri/cluster/wire.py;
   ray: Ray actor calls). After the first head, each head adopts the workers the one before
   left (their shards already loaded).
   --pin-cores puts each node on a core of its own (the head and one worker node on 2 cores),
   as if each were a machine: the hop without the nodes contending for the same cores.
2. Where it pays (--node-gb G): the same model served by one process streaming its experts
   from disk in a G GiB memory cgroup, against the head plus --budget-workers worker nodes, each
   node (Ray's processes, the worker, on the head node colibri's head too) in a G GiB cgroup of
   its own: decode tok/s of the first pass after start (cold) and of a second (warm), expert
   bytes read from disk per token, and the time to start. `--disk-mbs R` gives every machine a
   disk of its own that reads R MB/s: the model is copied to a loop device (an ext4 image,
   direct I/O), and each machine's processes are throttled to R on it (a block-io cgroup each,
   as bench/io/mirror_drives.py throttles its drives).

Every configuration first generates --greedy greedy tokens, compared with one process's.
All nodes share this machine's cores: the cluster's compute is not faster than one process's
here, only its memory is larger. Each figure is from this machine as printed.

    python -m tools.synthetic_moe /tmp/olmoe-1b-7b --preset olmoe-1b-7b
    python -m bench.scale.cluster_nodes --model /tmp/olmoe-1b-7b --node-gb 2.5
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import add_json_arg, machine_line, write_json

GiB = 1 << 30


def head_child(a) -> None:
    """--role head: in the head node's namespace, join --cluster, and print one JSON line."""
    from bench.peers.expert_streaming import token_sequence
    from colibri import Engine
    from colibri.cluster.head import Transport

    t0 = time.perf_counter()
    e = Engine.load(a.model, max_context=max(a.tokens, 8 + a.greedy) + 16, cluster=a.cluster,
                    expert_workers=a.workers, cluster_wire=a.wire, threads=a.threads)
    out = {"load_s": time.perf_counter() - t0, "adopted": e.experts.adopted,
           "nodes": [(w.info or {}).get("node") for w in e.experts.workers]}
    seq = token_sequence(a.tokens, 0)
    for state in ("cold", "warm"):  # cold: the first pass after start; warm: the same tokens again
        e.reset()
        e.experts.transport = Transport()
        s0 = e.expert_stats
        times = e.feed(seq)
        s1 = e.expert_stats
        steady = times[2:]
        asked = (s1["hits"] - s0["hits"]) + (s1["misses"] - s0["misses"])
        out[state] = {"tok_s": len(steady) / sum(steady), "per_layer": e.experts.transport.as_dict(),
                      "disk_bytes_per_tok": (s1["bytes_read"] - s0["bytes_read"]) / len(seq),
                      "hit_rate": (s1["hits"] - s0["hits"]) / asked if asked else None}
    e.reset()
    out["greedy"] = e.generate(seq[:8], max_tokens=a.greedy, stop_at_eos=False).token_ids
    out["faults"] = e.experts.faults
    if a.close:
        e.experts.close()
    print("@result " + json.dumps(out), flush=True)


def single_greedy(model: Path, n: int, seq8: list[int]) -> list[int]:
    from colibri import Engine

    e = Engine.load(model, max_context=8 + n + 8, stream_experts=False)
    return e.generate(seq8, max_tokens=n, stop_at_eos=False).token_ids


class Disks:
    """--disk-mbs: the model on a loop device, and a read throttle per machine (block-io cgroups
    named colibri-disk-<i>), each with `rate` bytes/s of its own. Removed by close()."""

    def __init__(self, model: Path, workdir: Path, rate: int):
        from bench.io.mirror_drives import LoopDrive, _cgroup2_with_io

        self.rate, self.groups = rate, []
        self.drive = LoopDrive(workdir, "colibri-cluster-disk")
        size = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
        self.drive.create(int(size * 1.15) + (256 << 20))
        self.model = self.drive.mount / model.name
        subprocess.run(["cp", "-r", str(model), str(self.model)], check=True)
        v2 = _cgroup2_with_io()
        self.root = v2 if v2 is not None else Path("/sys/fs/cgroup/blkio")
        self.limit_file = "io.max" if v2 is not None else "blkio.throttle.read_bps_device"
        if v2 is not None and "io" not in (v2 / "cgroup.subtree_control").read_text().split():
            (v2 / "cgroup.subtree_control").write_text("+io\n")

    def machine(self) -> Path:
        """A new throttle group: its cgroup.procs (write a pid there: it and its children read at rate)."""
        group = self.root / f"colibri-disk-{len(self.groups)}"
        group.mkdir()
        self.groups.append(group)
        line = f"{self.drive.majmin} rbps={self.rate}" if self.limit_file == "io.max" else f"{self.drive.majmin} {self.rate}"
        (group / self.limit_file).write_text(line + "\n")
        return group / "cgroup.procs"

    def close(self) -> None:
        from tools.memlimit import remove_cgroup

        for group in self.groups:
            for pid in (group / "cgroup.procs").read_text().split():  # leftovers (Ray daemons)
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            remove_cgroup(group)
        self.drive.remove()


def throttled(procs: Path | None, argv: list[str]) -> list[str]:
    """argv joining the throttle group `procs` first (None: as it is)."""
    return argv if procs is None else ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *argv]


def run_head(cluster, a, wire: str, close: bool, cgroup: Path | None = None, workers: int | None = None,
             disk: Path | None = None) -> dict:
    argv = [sys.executable, "-m", "bench.scale.cluster_nodes", "--role", "head", "--model", str(a.model),
            "--cluster", cluster.address, "--workers", str(workers or a.workers), "--tokens", str(a.tokens),
            "--greedy", str(a.greedy), "--wire", wire] + ["--close"] * close
    if a.threads:
        argv += ["--threads", str(a.threads)]
    if a.pin_cores:
        argv = ["taskset", "-c", "0", *argv]
    if cgroup is not None:  # the head joins its node's memory cgroup (before `ip netns exec`: its /sys has none)
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"),
                *throttled(disk, ["ip", "netns", "exec", cluster.ns(0), *argv])]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=a.child_timeout,
                           env={**cluster.env(), "PYTHONPATH": str(Path.cwd())})
    else:
        p = cluster.run(0, argv, capture_output=True, text=True, timeout=a.child_timeout,
                        env={"PYTHONPATH": str(Path.cwd())})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("@result ")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    return json.loads(lines[-1][len("@result "):])


def describe(r: dict, expected: list[int]) -> str:
    if "error" in r:
        return f"FAILED: {r['error']}"
    same = "identical" if r["greedy"] == expected else "DIFFERENT"
    warm, cold = r["warm"], r["cold"]
    p = warm["per_layer"]
    return (f"start {r['load_s']:.1f} s{' (workers adopted)' if r['adopted'] else ''}; cold {cold['tok_s']:.2f} tok/s, "
            f"warm {warm['tok_s']:.2f} tok/s; per MoE layer {p['wall_ms_per_layer']:.2f} ms = workers "
            f"{p['compute_ms_per_layer']:.2f} + transport {p['transport_ms_per_layer']:.2f} (+ head "
            f"{p['local_ms_per_layer']:.2f}); of the last answer: network and head "
            f"{p['network_ms_per_layer']:.2f}, worker I/O {p['worker_io_ms_per_layer']:.2f}; disk {cold['disk_bytes_per_tok'] / 1e6:.1f} / "
            f"{warm['disk_bytes_per_tok'] / 1e6:.1f} MB/token cold/warm; greedy tokens {same}")


def pin_nodes(cluster) -> None:
    """Every process of node k on core k (the workers Ray starts later inherit it)."""
    from tools.netns_cluster import namespace_pids

    if cluster.nodes > os.cpu_count():
        sys.exit(f"--pin-cores: {cluster.nodes} nodes, {os.cpu_count()} cores")
    for k in range(cluster.nodes):
        for pid in namespace_pids(cluster.ns(k)):
            subprocess.run(["taskset", "-a", "-p", "-c", str(k), str(pid)], capture_output=True)


@contextlib.contextmanager
def _nothing():
    yield None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=2, help="worker nodes (one expert worker each) in part 1")
    ap.add_argument("--tokens", type=int, default=32, help="forced tokens per pass")
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--delays", default="0,0.1,0.5", help="added round-trip ms per worker link, part 1 "
                    "(empty: no part 1)")
    ap.add_argument("--wires", default="tcp,ray")
    ap.add_argument("--node-gb", type=float, default=None, help="part 2: each node's memory cgroup (GiB)")
    ap.add_argument("--budget-workers", type=int, default=3, help="worker nodes in part 2")
    ap.add_argument("--disk-mbs", type=float, default=None, help="part 2: each machine's disk reads this many MB/s")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"), help="where --disk-mbs puts its disk image")
    ap.add_argument("--child-timeout", type=float, default=1800)
    ap.add_argument("--pin-cores", action="store_true",
                    help="part 1: node k (its Ray processes, its worker; the head's on node 0) on core k only, as "
                         "if each node were a machine of its own (needs as many cores as nodes; --threads 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="kernel threads of the head and of each worker (default: each its machine's cores)")
    ap.add_argument("--role", choices=["head"], help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--wire", default="tcp", help=argparse.SUPPRESS)
    ap.add_argument("--close", action="store_true", help=argparse.SUPPRESS)
    add_json_arg(ap)
    a = ap.parse_args()
    if a.pin_cores and a.threads is None:
        a.threads = 1  # a node with one core: one kernel thread
    if a.role == "head":
        return head_child(a)

    from bench.peers.expert_streaming import token_sequence
    from colibri.io.container import Container
    from tools.memlimit import drop_caches
    from tools.netns_cluster import NetnsCluster, why_unavailable

    if (why := why_unavailable()) is not None:
        sys.exit(f"cannot run: {why}")
    c = Container(a.model)
    print(machine_line())
    print(f"{a.model.name}: {len(c.expert_layouts)} MoE layers, experts {c.expert_bytes / GiB:.2f} GiB, "
          f"dense {c.dense_bytes / GiB:.2f} GiB; {a.tokens} forced tokens per pass", flush=True)
    expected = single_greedy(a.model, a.greedy, token_sequence(a.tokens, 0)[:8])
    report = {"model": str(a.model), "tokens": a.tokens, "hop": []}

    delays = [float(d) for d in a.delays.split(",") if d]
    wires = a.wires.split(",")
    if delays:
        print(f"\n1. head + {a.workers} worker nodes, every expert resident; added round trip per worker link",
              flush=True)
    with NetnsCluster(a.workers + 1, cpus=2) if delays else _nothing() as cluster:
        if a.pin_cores:
            pin_nodes(cluster)
        runs = [(d, w) for d in delays for w in wires]
        for i, (delay, wire) in enumerate(runs):
            if delay:
                cluster.netem(delay, nodes=range(1, a.workers + 1))
            else:
                cluster.clear_netem()
            r = run_head(cluster, a, wire, close=i == len(runs) - 1)
            print(f"   +{delay:g} ms, {wire} wire: {describe(r, expected)}", flush=True)
            report["hop"].append({"delay_ms": delay, "wire": wire, "delay_method": cluster.netem_method, **r})

    if a.node_gb:
        disks = Disks(a.model, a.workdir, int(a.disk_mbs * 1e6)) if a.disk_mbs else None
        try:
            where_it_pays(a, c, expected, report, disks)
        finally:
            if disks is not None:
                disks.close()
    write_json(a.json, report, args=a)


def where_it_pays(a, c, expected: list[int], report: dict, disks: Disks | None) -> None:
    """Part 2: one process streaming in a --node-gb cgroup against the head and --budget-workers
    worker nodes, each node in a cgroup of that size (and, with --disk-mbs, a disk of its own)."""
    from bench.peers.expert_streaming import module_command
    from tools.memlimit import drop_caches, run_limited
    from tools.netns_cluster import NetnsCluster, namespace_pids

    model = disks.model if disks is not None else a.model  # with --disk-mbs: the copy on the loop device
    limit = int(a.node_gb * GiB)
    disk = f", each with a disk of {a.disk_mbs:g} MB/s" if disks is not None else ""
    print(f"\n2. each machine {a.node_gb:g} GiB (memory cgroup){disk}; experts {c.expert_bytes / GiB:.2f} GiB",
          flush=True)
    ram_gb = a.node_gb - (0.45 if a.node_gb < 4 else 1.5)  # as bench/peers/expert_streaming.py leaves
    drop_caches()
    t0 = time.perf_counter()
    cmd = [*module_command("bench.peers.expert_streaming", sys.executable), "--child", "colibri", "--model",
           str(model), "--tokens", str(a.tokens), "--ram-gb", str(ram_gb)]
    r = run_limited(throttled(disks.machine() if disks else None, cmd), limit, timeout=a.child_timeout)
    single = {"wall_s": time.perf_counter() - t0}
    if r.returncode == 0:
        single.update(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"   one process streaming (--ram-gb {ram_gb:.2f}): cold {single['cold']['tok_s']:.2f} tok/s "
              f"({single['cold']['disk_bytes_per_tok'] / 1e6:.1f} MB/token read), warm "
              f"{single['warm']['tok_s']:.2f} tok/s ({single['warm']['disk_bytes_per_tok'] / 1e6:.1f} MB/token), "
              f"hit rate {single['warm']['hit_rate']:.3f}; {single['wall_s']:.1f} s in all", flush=True)
    else:
        single["error"] = (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"   one process streaming: FAILED ({single['error']}; oom {r.oom_killed})", flush=True)
    report["single_streaming"] = single
    drop_caches()
    n = a.budget_workers
    with NetnsCluster(n + 1, cpus=2, memory_bytes=limit, cgroup_bytes=limit) as cluster:
        head_disk = None
        if disks is not None:  # each node's processes (and the workers its raylet starts) on its own disk
            for k in range(cluster.nodes):
                procs = disks.machine()
                head_disk = head_disk or procs
                for pid in namespace_pids(cluster.ns(k)):
                    try:
                        procs.write_text(f"{pid}\n")
                    except OSError:  # exited meanwhile
                        pass
        a_model, a.model = a.model, model
        try:
            r = run_head(cluster, a, "tcp", close=True, cgroup=cluster.cgroup(0), workers=n, disk=head_disk)
        finally:
            a.model = a_model
        print(f"   head + {n} worker nodes: {describe(r, expected)}", flush=True)
        report["cluster"] = {"workers": n, **r}


if __name__ == "__main__":
    main()
