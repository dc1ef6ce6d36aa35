"""tools/netns_cluster.py: a 3-node Ray cluster, each node in its own network namespace with its own
IP, really is one: a task pinned to each node runs there, nothing listens outside the namespaces, a
cut link makes its node unreachable (and restore + start_node brings it back), netem adds the
latency it says, a driver without the token is refused, a killed node comes back, and close() and
the CLI leave nothing behind. One cluster for the module (~12 s to start on 2 cores), used by the
tests in file order; ~55 s in all."""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import netns_cluster
from tools.netns_cluster import FAST_FAILURE_DETECTION, NetnsCluster

pytestmark = pytest.mark.slow  # ~55 s: a cluster start, a node marked dead, restarts

GIB = 1 << 30
MEMORY = [3 * GIB, 2 * GIB, 1 * GIB]  # the "memory" resource per node
CGROUP_LIMIT = 2 * GIB  # a real limit on node 2 only


def _root_listeners_with_owners() -> list[tuple[str, int, list[int]]]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        addr, port = fields[3].rsplit(":", 1)
        rows.append((addr.strip("[]").split("%")[0], int(port), [int(p) for p in re.findall(r"pid=(\d+)", line)]))
    return rows


@pytest.fixture(scope="module")
def cluster():
    reason = netns_cluster.why_unavailable()
    if reason:
        pytest.skip(reason)
    root_before = _root_listeners_with_owners()
    # a memory cgroup for node 2 where this machine offers a writable memory controller
    cgroups = [None, None, CGROUP_LIMIT] if netns_cluster.cgroup_base() is not None else None
    c = NetnsCluster(3, cpus=1, memory_bytes=MEMORY, cgroup_bytes=cgroups, ray_env=FAST_FAILURE_DETECTION)
    c.start()
    c.root_before = root_before
    print(f"\nnetns cluster {c.tag} started in {c.start_seconds:.1f} s")
    yield c
    c.close()


# A driver on the head's "machine": RAY_ADDRESS and the token come from cluster.env().
DRIVER = """
import json, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(logging_level="ERROR", log_to_driver=False)
node_ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
memory = {n["NodeManagerAddress"]: n["Resources"].get("memory") for n in ray.nodes() if n["Alive"]}

@ray.remote(max_retries=0)
def where():
    return ray.util.get_node_ip_address()

def on(ip, timeout):
    if ip not in node_ids:
        return "not alive"
    ref = where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[ip], soft=False)).remote()
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as e:
        return type(e).__name__

def result(value):
    print("RESULT " + json.dumps(value), flush=True)
"""


def _driver(cluster, code: str, timeout: float = 90) -> dict:
    """Run DRIVER + code in node 0's namespace; code calls result(dict), returned here. (Ray prints
    messages, e.g. that a node was marked dead, on the driver's stdout too.)"""
    p = cluster.run(0, [sys.executable, "-c", DRIVER + code], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, p.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_three_nodes_alive_with_their_ips(cluster):
    ips = ["10.213.7.1", "10.213.7.2", "10.213.7.3"]
    assert [cluster.ip(k) for k in range(3)] == ips
    assert cluster.address == "10.213.7.1:6379"
    assert cluster.alive() == ips
    # node 2's Ray processes are in its memory cgroup, under its limit
    group = cluster.cgroup(2)
    if group is None:
        pytest.skip("no writable cgroup memory controller: the cluster runs without node 2's limit")
    limit_file = group / ("memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes")
    assert int(limit_file.read_text()) == CGROUP_LIMIT
    members = {int(p) for p in (group / "cgroup.procs").read_text().split()}
    ns_pids = set(netns_cluster.namespace_pids(cluster.ns(2)))
    assert ns_pids and ns_pids <= members
    assert cluster.cgroup(0) is None and cluster.cgroup(1) is None


def test_task_pinned_to_each_node_runs_there(cluster):
    r = _driver(cluster, "result({'where': {ip: on(ip, 60) for ip in node_ids}, 'memory': memory})")
    assert r["where"] == {cluster.ip(k): cluster.ip(k) for k in range(3)}
    # --memory per node: the scheduler (and colibri's planner) sees different RAM per node
    assert r["memory"] == {cluster.ip(k): float(MEMORY[k]) for k in range(3)}


def test_nothing_listens_outside_the_namespaces(cluster):
    # The root namespace: no new listener belongs to a process of this cluster (matched by its token
    # in the process's environment or its temp dir on the command line: another test's local Ray
    # may open root listeners meanwhile, and that is not ours).
    before = {(a, p) for a, p, _ in cluster.root_before}
    for addr, port, pids in _root_listeners_with_owners():
        if (addr, port) in before:
            continue
        for pid in pids:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert cluster.auth_token.encode() not in environ, (addr, port, cmdline)
            assert f"cbr-{cluster.tag}-".encode() not in cmdline, (addr, port, cmdline)
    listening = cluster.listening()
    assert set(listening) == {"root", cluster.switch, *(cluster.ns(k) for k in range(3))}
    assert listening[cluster.switch] == []
    assert not any(addr.startswith(cluster.subnet + ".") for addr, _ in listening["root"])
    for k in range(3):
        sockets = listening[cluster.ns(k)]
        assert sockets, f"nothing listens on node {k}"
        for addr, port in sockets:
            assert addr in (cluster.ip(k), "127.0.0.1", "*", "0.0.0.0", "::"), (k, addr, port)
        # a wildcard inside the namespace covers lo and eth0 only
        links = subprocess.run(["ip", "-n", cluster.ns(k), "-o", "link"], capture_output=True, text=True,
                               check=True).stdout
        assert sorted(re.findall(r"^\d+: ([^:@]+)", links, re.M)) == ["eth0", "lo"]
    # the subnet exists only inside the namespaces: no address, route or veth in the root namespace
    root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    root += subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    assert cluster.subnet + "." not in root
    assert "veth" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_driver_without_the_token_is_refused(cluster, tmp_path):
    # ~20 s of connection retries by default; one here. HOME without ~/.ray/auth_token.
    probe = "import ray; ray.init(logging_level='ERROR'); print('CONNECTED')"
    fast = {"RAY_gcs_server_port_wait_time_s": "1", "HOME": str(tmp_path)}
    for env in ({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": ""},  # no token at all
                {"RAY_AUTH_TOKEN": "0" * 64}):  # a wrong one
        p = cluster.run(0, [sys.executable, "-c", probe], env={**fast, **env}, capture_output=True, text=True,
                        timeout=60)
        assert p.returncode != 0 and "CONNECTED" not in p.stdout
        # refused for the token, not for the short wait: the drivers above, with it, connect
        assert "InvalidAuthToken" in p.stderr, p.stderr[-2000:]


RTT = """
import socket, sys, time
def rtt_ms():  # a TCP connect to a closed port: SYN out, RST back, one round trip
    s = socket.socket()
    t = time.perf_counter()
    try:
        s.connect((sys.argv[1], 9))
    except ConnectionRefusedError:
        pass
    s.close()
    return (time.perf_counter() - t) * 1000
print(min(rtt_ms() for _ in range(7)))
"""


def _rtt_ms(cluster, k_from: int, k_to: int) -> float:
    p = cluster.run(k_from, [sys.executable, "-c", RTT, cluster.ip(k_to)], capture_output=True, text=True,
                    timeout=30, check=True)
    return float(p.stdout)


def test_netem_adds_round_trip_time(cluster):
    base = _rtt_ms(cluster, 0, 1)
    cluster.netem(40, nodes=[1])
    try:
        delayed = _rtt_ms(cluster, 0, 1)
        other = _rtt_ms(cluster, 0, 2)  # node 2's link is untouched
    finally:
        cluster.clear_netem()
    after = _rtt_ms(cluster, 0, 1)
    print(f"\nround trip 0->1: {base:.2f} ms, with netem(40) on node 1 ({cluster.netem_method}) {delayed:.2f} ms")
    assert 38 <= delayed - base <= 80, (base, delayed)
    assert other < 20 and after < 20, (other, after)


def test_cut_partitions_a_node_and_restore_start_node_brings_it_back(cluster):
    ip1, ip2 = cluster.ip(1), cluster.ip(2)
    cluster.cut(2)
    t_cut = time.monotonic()
    try:
        r = _driver(cluster, f"result({{'n1': on({ip1!r}, 60), 'n2': on({ip2!r}, 3)}})")
        assert r["n1"] == ip1
        assert r["n2"] != ip2  # a timeout, or unschedulable once the GCS marked node 2 dead
        # FAST_FAILURE_DETECTION: the GCS declares the unreachable node dead within seconds
        waited = cluster.wait_dead(2, timeout=30)
        print(f"\ncut node 2: {r['n2']}, marked dead {time.monotonic() - t_cut:.1f} s after the cut "
              f"({waited:.1f} s after the driver)")
        assert cluster.alive() == [cluster.ip(0), ip1]
    finally:
        cluster.restore(2)
    t = time.monotonic()
    cluster.start_node(2)  # the old raylet exits once it hears it was declared dead
    print(f"start_node(2) took {time.monotonic() - t:.1f} s")
    assert cluster.alive() == [cluster.ip(k) for k in range(3)]  # tasks on it: the next test


def test_kill_node_and_start_node(cluster):
    killed = cluster.kill_node(1)
    assert killed and not netns_cluster.namespace_pids(cluster.ns(1))
    # The health checks now fail at once (connection refused): threshold x period, ~3 s here
    waited = cluster.wait_dead(1, timeout=30)
    print(f"\nkilled node 1 marked dead after {waited:.1f} s")
    cluster.start_node(1)
    assert cluster.alive() == [cluster.ip(k) for k in range(3)]
    # node 1 (killed) and node 2 (cut, declared dead) restarted: tasks run on every node again
    r = _driver(cluster, "result({ip: on(ip, 60) for ip in node_ids})")
    assert r == {cluster.ip(k): cluster.ip(k) for k in range(3)}


def test_close_leaves_nothing(cluster):
    namespaces = [cluster.ns(k) for k in range(3)] + [cluster.switch]
    groups = [g for g in (cluster.cgroup(2),) if g is not None]
    cluster.close()
    cluster.close()  # idempotent
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not set(namespaces) & {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert netns_cluster.tagged_pids(cluster.tag) == []
    assert not any(cluster.temp_dir(k).exists() for k in range(3))
    assert not any(g.exists() for g in groups)
    assert cluster.tag not in netns_cluster.tags()


def test_cli_up_and_down():
    """`up` prints the address and the environment, and cleans up on SIGTERM; `down --tag` removes
    what a crashed run left behind."""
    if reason := netns_cluster.why_unavailable():
        pytest.skip(reason)
    tag = "cli" + os.urandom(3).hex()
    up = subprocess.Popen([sys.executable, "-m", "tools.netns_cluster", "up", "--nodes", "1", "--tag", tag],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = b""
        deadline = time.monotonic() + 90
        while b"Ctrl-C" not in out:  # its last line, once the cluster is up
            ready, _, _ = select.select([up.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready or not (chunk := os.read(up.stdout.fileno(), 65536)):
                break
            out += chunk
        text = out.decode()
        assert "address 10.213.7.1:6379" in text and "export RAY_AUTH_TOKEN=" in text, text
        assert f"cbr{tag}n0" in netns_cluster.namespace_names()
    finally:
        up.terminate()
        up.wait(timeout=60)
        up.stdout.close()
        up.stderr.close()
    assert up.returncode == 0
    assert tag not in netns_cluster.tags() and not netns_cluster.tagged_pids(tag)

    # what a crashed cluster leaves: a namespace with a process in it, a temp dir
    subprocess.run(["ip", "netns", "add", f"cbr{tag}n0"], check=True)
    Path(f"/tmp/cbr-{tag}-n0").mkdir()
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"cbr{tag}n0", "sleep", "600"])
    try:
        assert tag in netns_cluster.tags()
        subprocess.run([sys.executable, "-m", "tools.netns_cluster", "down", "--tag", tag], check=True, timeout=60)
        assert sleeper.wait(timeout=10) == -9
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    assert tag not in netns_cluster.tags() and not Path(f"/tmp/cbr-{tag}-n0").exists()
