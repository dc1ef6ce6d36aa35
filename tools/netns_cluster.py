"""A real multi-node Ray cluster on one machine: every Ray node runs in its own Linux network
namespace with its own private IP, wired to the others through a bridge in a "switch" namespace,
so tests and benchmarks can cut a node's link, add latency to it, or kill the node.

    with NetnsCluster(3, cpus=1, ray_env=FAST_FAILURE_DETECTION) as cluster:
        cluster.run(0, [sys.executable, "driver.py"])   # a driver on the head's "machine"
        cluster.cut(2); ...; cluster.restore(2)
        cluster.kill_node(1); cluster.start_node(1)

    python -m tools.netns_cluster up --nodes 3 [--tag T]    # foreground until Ctrl-C / SIGTERM
    python -m tools.netns_cluster down --tag T | --all      # remove a cluster's leftovers
    python -m tools.netns_cluster list                      # tags with leftovers

Needs root, iproute2 (`ip`, `tc`, `ss`) and Ray; the standard library only here (Ray is imported in
the helper subprocesses). Layout, for tag T, subnet S (default 10.213.7) and n nodes:

    namespace cbrTsw        a bridge br0, one port vK per node (the switch side of node K's cable)
    namespace cbrTnK        eth0 = S.(K+1)/24 (the node side), lo, a default route through eth0;
                            node 0 runs the Ray head (GCS on S.1:6379), the others `ray start --address`
    /tmp/cbr-T-nK           node K's Ray temp dir (sessions, logs, sockets, its ray_start.log)
    cgroup cbr-T-nK         node K's memory limit, only with cgroup_bytes

The initial ("root") namespace gets no veth, no address and no route of the subnet, and nothing of
the cluster listens there: a process outside the namespaces cannot reach the cluster at all, and
two clusters (two tags) can even use the same subnet. Run drivers with popen()/run() (`ip netns exec`).

What was found out with Ray 2.60 on a 2-core machine (the reasons behind the code below):

- Temp dirs. `ray start --temp-dir` is honoured per node, worker nodes included (`ray start --help`:
  "Can be specified per node"; a worker node's session directory is created under its own temp dir,
  named after the head's session). Without it every node would use /tmp/ray: Ray gives the raylet
  and plasma sockets of a second node on one host numbered names (raylet.1), so they would not
  collide, but the logs directory, session_latest and ray_current_cluster would be shared between
  the nodes and with any other local Ray on the machine (another test's). So: one short temp dir per
  node (unix socket paths must stay under 107 characters; /tmp/cbr-T-nK/session_<date>_<pid>/
  sockets/plasma_store is ~85), removed by close().
- Token authentication works for a multi-node cluster: RAY_AUTH_MODE=token plus RAY_AUTH_TOKEN=<the
  token> in the environment of every `ray start` (head and workers) and of every driver. A driver
  without the token, or with another one, is refused by the GCS ("Unauthenticated: InvalidAuthToken")
  and ray.init raises ConnectionError, after ~20 s of retries (RAY_gcs_server_port_wait_time_s=1
  makes it ~2 s). The token in the environment takes precedence over ~/.ray/auth_token. Careful with
  auth_token=None: with RAY_AUTH_MODE unset, `ray start --head` turns token mode on by itself if a
  ~/.ray/auth_token exists (ray.init() writes one), so the harness then sets RAY_AUTH_MODE=disabled.
- Failure detection. The GCS health-checks each raylet: RAY_health_check_period_ms=3000,
  RAY_health_check_timeout_ms=10000, RAY_health_check_failure_threshold=5 by default, so a cut node
  is marked dead ~63 s after the cut (5 checks x (10 s timeout + 3 s period), measured), a killed
  one after ~15 s (its checks fail at once, connection refused: 5 x 3 s). These are read from the
  environment of the gcs_server, i.e. of `ray start --head`: pass them in `ray_env`.
  FAST_FAILURE_DETECTION below: a cut node is marked dead ~6 s after the cut (3 x (1 s + 1 s)),
  a killed one after ~3 s (measured); do not go much lower on 2 busy cores, or a node that is
  merely slow gets declared dead.
- After a cut. While the link is down the node's raylet keeps running (still there 100 s into a
  cut, measured); a task pinned to it hangs (its lease request is never answered) until the GCS
  marks the node dead, then fails. A cut shorter than that heals by itself (a 15 s cut with the
  default settings: the next pinned task ran in 1 s). When the link comes back after the node was
  marked dead, the raylet hears so from the GCS and exits within seconds ("Exiting because this
  node manager has mistakenly been marked as dead by the GCS" in its raylet.out), leaving its log
  monitor behind; it never rejoins. So the way back is restore(k) then start_node(k), which first
  kills those leftovers and starts a new raylet (a new node id, same IP).
- Killing one node. `ray stop` kills every Ray process on the machine whatever its namespace (and
  another test's local Ray with them), so kill_node() kills the processes `ip netns pids` lists for
  the node's namespace: the raylet, its workers and agents, and, on node 0, the GCS. That is the node
  "machine" crashing: a driver you started in that namespace dies too. The nodes are started with
  plain (daemonizing) `ray start`, whose exit status says whether the node came up; the daemons are
  then reparented to init, so a process group would not find them, the namespace does.
- Listening sockets. gcs_server and raylet listen on the wildcard address, the runtime-env agent on
  the node IP, the autoscaler monitor on 0.0.0.0; inside a namespace whose only interfaces are lo
  and eth0 a wildcard covers exactly 127.0.0.1 and the node IP.
- Node IP. Ray finds a driver's node IP by "connecting" a UDP socket to 8.8.8.8 and reading the
  source address, else from the hostname (127.0.0.1 here). The default route through eth0 makes
  that probe return the node IP (no packet is sent; none could leave anyway: the switch has no
  uplink). `ray start` is given --node-ip-address explicitly.
- Memory. `--memory` sets the "memory" resource the scheduler (and colibri's planner) sees per node.
  A cgroup limit is real memory; Ray's own memory monitor does not see it (`ip netns exec` mounts a
  fresh /sys, hiding /sys/fs/cgroup), so over the limit the kernel OOM killer acts, not Ray.
- Latency. The kernel this was written on (a Firecracker VM's, no modules) lacks sch_netem
  (CONFIG_NET_SCH_NETEM unset: "Specified qdisc kind is unknown"), and iptables/NFQUEUE are not
  installed either, so netem() falls back to a userspace delay relay (_RELAY below) where `tc
  netem` fails; both give the same added round trip (measured: 40.6 ms for netem(40) with the relay).
- Startup: ~11-13 s for 3 nodes on 2 cores, ~6 s of it the head's `ray start`, then the worker
  nodes in parallel (importing ray.scripts.scripts alone costs 1.8 s of a core per `ray start`;
  starting the workers together with the head was not faster, nor was --include-log-monitor=false).
- Two clusters on one subnet are isolated (separate namespaces) but Ray still sees the other one
  in one place: `ray start --head` greps `ps` for gcs_server processes, see _launch().
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "cbr"  # every namespace, temp dir and cgroup of this tool starts with it (down --all)
GCS_PORT = 6379
TEMP_ROOT = Path("/tmp")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# ray_env for tests that cut links or kill nodes: the GCS declares a cut node dead ~6 s after the cut
# instead of ~63 s, a killed one after ~3 s instead of ~15 s. Read by the gcs_server at
# `ray start --head`; given to the worker nodes too (harmless).
FAST_FAILURE_DETECTION = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

# `ray start` through the interpreter running this module, not the `ray` console script: same Ray,
# same Python for the raylet's workers, and no pyenv-shim start-up cost.
_RAY_CLI = "import sys; sys.argv[0] = 'ray'; from ray.scripts.scripts import main; main()"

# The GCS's node table, for alive(): a long-lived helper in node 0's namespace (importing ray costs
# ~0.6 s of a core, too much to pay per poll). A bare GcsClient, not ray.init(): a driver would make
# the head's raylet prestart workers. One request per stdin line (its timeout), one JSON reply line.
_PROBE = r"""
import json, sys
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
client = None
for line in sys.stdin:
    try:
        if client is None:
            client = GcsClient(address=sys.argv[1])
        infos = client.get_all_node_info(timeout=float(line)).values()
        reply = {"nodes": [{"ip": i.node_manager_address, "node_id": i.node_id.hex(),
                            "alive": i.state == GcsNodeInfo.GcsNodeState.ALIVE, "head": i.is_head_node,
                            "resources": dict(i.resources_total)} for i in infos]}
    except Exception as e:
        client = None
        reply = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""

# netem() where the kernel has no sch_netem (CONFIG_NET_SCH_NETEM unset, as on the Firecracker
# VMs this was written on, whose kernel has no modules either): a userspace "delay line" in the
# switch namespace. Node k's switch port vK leaves the bridge; a veth pair rK-bK takes its place
# (bK on the bridge) and this relay copies every frame between vK and rK after the one-way delay.
# AF_PACKET sockets with PACKET_VNET_HDR carry each frame's offload state (GSO super-frames,
# checksums left to the hardware) through unchanged: ~1.1 GB/s with no delay on one core,
# measured, so with a delay a TCP flow is limited by its window, as behind netem.
# PACKET_IGNORE_OUTGOING: a socket does not read back the frames the relay itself sends.
# argv: the two devices and the one-way delay in ms; a new delay per stdin line; EOF ends it.
_RELAY = r"""
import collections, select, socket, sys, time
SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING, ETH_P_ALL, SO_RCVBUFFORCE = 263, 15, 23, 3, 33
def open_dev(dev):
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: no frames before bind
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # bursts wait here, not dropped
    s.bind((dev, ETH_P_ALL))
    s.setblocking(False)
    return s
a, b = open_dev(sys.argv[1]), open_dev(sys.argv[2])
delay = float(sys.argv[3]) / 1000
pending = {a: (b, collections.deque()), b: (a, collections.deque())}  # FIFO: one delay for all
print("ready", flush=True)
while True:
    now = time.monotonic()
    wait = None
    for dst, queue in pending.values():
        while queue and queue[0][0] <= now:
            try:
                dst.send(queue.popleft()[1])
            except OSError:  # the link is cut (ENETDOWN) or the queue full: lost, as on a wire
                pass
        if queue:
            wait = queue[0][0] - now if wait is None else min(wait, queue[0][0] - now)
    ready, _, _ = select.select([a, b, sys.stdin], [], [], wait)
    now = time.monotonic()
    for s in ready:
        if s is sys.stdin:
            line = sys.stdin.readline()
            if not line:
                sys.exit(0)
            delay = float(line) / 1000
            continue
        dst, queue = pending[s]
        for _ in range(256):
            try:
                queue.append((now + delay, s.recv(1 << 18)))
            except OSError:  # BlockingIOError: drained; ENETDOWN once after a cut
                break
"""

# Signals after which waiting for the processes to exit makes no sense.
_NO_WAIT_SIGNALS = {signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP}


class ClusterError(RuntimeError):
    pass


def _cmd(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


# --- namespaces, processes, cgroups: module level, so that `down` finds a crashed run's leftovers --

def namespace_names() -> list[str]:
    """Every network namespace of this tool (any tag)."""
    p = _cmd(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(rf"{PREFIX}[a-z0-9]+(?:sw|n\d+)", n)]


def _tag_namespaces(tag: str) -> list[str]:
    # Unambiguous between tags: tags are [a-z0-9]+ and a node number is digits only.
    return [n for n in namespace_names() if n == f"{PREFIX}{tag}sw" or re.fullmatch(rf"{PREFIX}{tag}n\d+", n)]


def tags() -> list[str]:
    """Tags that have namespaces or temp dirs on this machine."""
    found = set()
    for name in namespace_names():
        if m := re.fullmatch(rf"{PREFIX}([a-z0-9]+?)(?:sw|n\d+)", name):
            found.add(m.group(1))
    for d in TEMP_ROOT.glob(f"{PREFIX}-*-n*"):
        if m := re.fullmatch(rf"{PREFIX}-([a-z0-9]+)-n\d+", d.name):
            found.add(m.group(1))
    return sorted(found)


def namespace_pids(ns: str) -> list[int]:
    p = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_namespace(ns: str, sig: int = signal.SIGKILL, timeout: float = 10) -> list[int]:
    """Send `sig` to every process in namespace `ns` and wait until none is left, signalling the
    ones that appear meanwhile (a raylet forks workers); SIGKILL the rest after `timeout`.
    Zombies are not listed by `ip netns pids`, so an unreaped child does not block this."""
    pids = namespace_pids(ns)
    _signal(pids, sig)
    if sig in _NO_WAIT_SIGNALS:
        return pids
    deadline = time.monotonic() + timeout
    while left := namespace_pids(ns):
        _signal(left, sig if time.monotonic() < deadline else signal.SIGKILL)
        if time.monotonic() > deadline + 5:
            raise ClusterError(f"processes {left} in namespace {ns} survive SIGKILL")
        time.sleep(0.05)
    return pids


def tagged_pids(tag: str | None) -> list[int]:
    """Processes whose command line names a temp dir of `tag` (every Ray process of a node does),
    for leftovers whose namespace is already gone. None: any tag."""
    pattern = re.compile(rf"{TEMP_ROOT}/{PREFIX}-{tag or '[a-z0-9]+'}-n\d+".encode())
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if pattern.search((entry / "cmdline").read_bytes()):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def cgroup_base() -> tuple[Path, str, str] | None:
    """(parent directory, limit file, version) for per-node memory groups, None without a usable
    memory controller. cgroup v2 (memory in /sys/fs/cgroup/cgroup.controllers): groups directly
    under the root, the one group exempt from the no-internal-processes rule, memory enabled in its
    subtree_control. cgroup v1 (a memory hierarchy at /sys/fs/cgroup/memory, also the hybrid layout
    whose unified hierarchy has no memory controller): under this process's own memory group,
    which a container lets us write (as tools/memlimit.py does)."""
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists():
        if "memory" not in controllers.read_text().split():
            return None
        subtree = CGROUP_ROOT / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            try:
                subtree.write_text("+memory")
            except OSError:
                return None
        return CGROUP_ROOT, "memory.max", "v2"
    if (CGROUP_ROOT / "memory").is_dir():
        own = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if "memory" in ctrls.split(","):
                own = CGROUP_ROOT / "memory" / path.lstrip("/")
        if own is not None and own.is_dir():
            return own, "memory.limit_in_bytes", "v1"
    return None


def _tag_cgroups(tag: str | None) -> list[Path]:
    """This tool's groups (of `tag`, or any) wherever they are: the v2 root, or any v1 memory group
    a few levels deep (another process of ours may have run from another group)."""
    name = re.compile(rf"{PREFIX}-{tag or '[a-z0-9]+'}-n\d+")
    found = []
    for top in (CGROUP_ROOT, CGROUP_ROOT / "memory"):
        if not (top / "cgroup.procs").exists():
            continue
        for dirpath, dirnames, _ in os.walk(top):
            if len(Path(dirpath).relative_to(top).parts) >= 4:
                dirnames[:] = []
            for d in list(dirnames):
                if name.fullmatch(d):
                    found.append(Path(dirpath) / d)
                    dirnames.remove(d)
    return found


def _remove_cgroup(group: Path) -> None:
    for _ in range(100):
        try:
            _signal([int(x) for x in (group / "cgroup.procs").read_text().split()], signal.SIGKILL)
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)  # busy until the killed processes are gone
    raise ClusterError(f"cannot remove cgroup {group}")


def teardown(tag: str | None) -> None:
    """Remove every trace of cluster `tag` (None: of every cluster of this tool): kill the processes
    of its namespaces (and any process naming one of its temp dirs), delete the namespaces (the veth
    pairs and the bridge go with them), its cgroups and its temp dirs. Safe to repeat."""
    namespaces = namespace_names() if tag is None else _tag_namespaces(tag)
    for ns in namespaces:
        _kill_namespace(ns)
    _signal(tagged_pids(tag), signal.SIGKILL)
    for ns in namespaces:
        _cmd(["ip", "netns", "delete", ns], check=False)
    for group in _tag_cgroups(tag):
        _remove_cgroup(group)
    for d in TEMP_ROOT.glob(f"{PREFIX}-{tag or '*'}-n*"):
        if re.fullmatch(rf"{PREFIX}-[a-z0-9]+-n\d+", d.name):
            shutil.rmtree(d, ignore_errors=True)


def why_unavailable() -> str | None:
    """None when this machine can run a NetnsCluster, else the reason (for skipping tests)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'colibri[cluster]')"
    probe = f"{PREFIX}probe{secrets.token_hex(4)}"  # no "n<digits>"/"sw" ending: not a cluster's
    p = _cmd(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    try:
        p = _cmd(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=False)
        if p.returncode != 0:
            return f"cannot create a veth pair: {p.stderr.strip()}"
    finally:
        _cmd(["ip", "netns", "delete", probe], check=False)
    return None


def _per_node(value, n: int, what: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{what}: {len(values)} values for {n} nodes")
    return values


def _parse_ss(text: str) -> list[tuple[str, int]]:
    """`ss -ltnH` lines -> (address, port); brackets and a %interface scope dropped ("*", "0.0.0.0",
    "::" are the wildcards)."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            addr, port = fields[3].rsplit(":", 1)
            out.append((addr.strip("[]").split("%")[0], int(port)))
    return sorted(set(out))


class NetnsCluster:
    """A Ray cluster of `nodes` nodes, one network namespace each; a context manager.

    nodes          node 0 is the head (GCS on port 6379), nodes 1..n-1 join it
    tag            names the namespaces, temp dirs and cgroups ([a-z0-9]+); default random hex
    subnet         first three octets of the /24; node k is subnet.(k+1)
    cpus           --num-cpus of every node (None: Ray counts the machine's cores, on every node)
    memory_bytes   --memory per node (or one value for all): the "memory" resource the scheduler sees
    object_store_bytes  --object-store-memory of every node
    cgroup_bytes   a real memory limit per node (or one for all; None: no group)
    env            added to the environment of everything: Ray nodes and popen()/run()
    ray_env        added to the environment of the `ray start` processes only: Ray system config
                   as RAY_<name> variables (see FAST_FAILURE_DETECTION)
    auth_token     "generate" (a random token), a token, or None for no authentication
    """

    def __init__(self, nodes: int = 3, *, tag: str | None = None, subnet: str = "10.213.7",
                 cpus: int | None = None, memory_bytes: list[int | None] | int | None = None,
                 object_store_bytes: int = 256 << 20, cgroup_bytes: list[int | None] | int | None = None,
                 env: dict[str, str] | None = None, ray_env: dict[str, str] | None = None,
                 auth_token: str | None = "generate"):
        if not 1 <= nodes <= 250:
            raise ValueError("nodes must be 1..250")
        self.tag = tag or secrets.token_hex(3)
        if not re.fullmatch(r"[a-z0-9]{1,12}", self.tag):
            raise ValueError("tag must be 1-12 characters of [a-z0-9]")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError("subnet is the first three octets, e.g. 10.213.7")
        self.nodes = nodes
        self.subnet = subnet
        self.cpus = cpus
        self.memory_bytes = _per_node(memory_bytes, nodes, "memory_bytes")
        self.object_store_bytes = object_store_bytes
        self.cgroup_bytes = _per_node(cgroup_bytes, nodes, "cgroup_bytes")
        self.extra_env = dict(env or {})
        self.ray_env = dict(ray_env or {})
        self.auth_token = secrets.token_hex(32) if auth_token == "generate" else auth_token
        self.address = f"{self.ip(0)}:{GCS_PORT}"
        self.switch = f"{PREFIX}{self.tag}sw"
        self._cgroups: dict[int, Path] = {}
        self._probe: subprocess.Popen | None = None
        self._relays: dict[int, subprocess.Popen] = {}  # node -> its delay relay (no sch_netem)
        self.netem_method: str | None = None  # "tc netem" or "relay", known after the first netem()
        self._started = False
        self._closed = False
        self.start_seconds: float | None = None  # wall time of the last start()

    # --- naming ---------------------------------------------------------------------------------

    def ip(self, k: int) -> str:
        return f"{self.subnet}.{k + 1}"

    def ns(self, k: int) -> str:
        return f"{PREFIX}{self.tag}n{k}"

    def temp_dir(self, k: int) -> Path:
        return TEMP_ROOT / f"{PREFIX}-{self.tag}-n{k}"

    def __repr__(self):
        return f"NetnsCluster(tag={self.tag!r}, nodes={self.nodes}, address={self.address!r})"

    # --- environment and processes inside the namespaces ---------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Our values only: an inherited address or token source would point at another cluster.
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is what `--cluster local` sets in its process to keep
        # Ray on one machine: inherited, it makes `ray start --address` refuse to join.
        for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
            env.pop(var, None)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        if self.auth_token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.auth_token)
        else:
            env["RAY_AUTH_MODE"] = "disabled"  # not enabled behind our back by a ~/.ray/auth_token
        env.update(self.extra_env)
        return env

    def env(self) -> dict[str, str]:
        """os.environ plus what a process joining this cluster needs: RAY_ADDRESS (so a bare
        ray.init() connects here), the token variables, RAY_USAGE_STATS_ENABLED=0, `env`."""
        return {**self._base_env(), "RAY_ADDRESS": self.address}

    def _node_env(self) -> dict[str, str]:
        return {**self._base_env(), **self.ray_env}

    def popen(self, k: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv in node k's namespace with env() (kw["env"] is merged on top of it)."""
        kw["env"] = {**self.env(), **(kw.get("env") or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.ns(k), *argv], **kw)

    def run(self, k: int, argv: list[str], timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of argv in node k's namespace with env() merged (see popen)."""
        kw["env"] = {**self.env(), **(kw.get("env") or {})}
        return subprocess.run(["ip", "netns", "exec", self.ns(k), *argv], timeout=timeout, **kw)

    # --- start ----------------------------------------------------------------------------------

    def __enter__(self) -> "NetnsCluster":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, timeout: float = 120) -> "NetnsCluster":
        """Build the network, start the head, then the other nodes in parallel; return once the GCS
        reports every node alive. On failure everything is torn down and ClusterError raised."""
        if self._started:
            raise ClusterError("already started")
        if why := why_unavailable():
            raise ClusterError(why)
        if _tag_namespaces(self.tag):
            raise ClusterError(f"namespaces of tag {self.tag} exist "
                               f"(python -m tools.netns_cluster down --tag {self.tag})")
        self._started = True
        atexit.register(self.close)  # an interrupted test leaves nothing behind
        t0 = time.monotonic()
        deadline = t0 + timeout
        try:
            self._build_network()
            self._make_cgroups()
            self._wait_ray_start({0: self._launch(0)}, deadline)
            self._wait_ray_start({k: self._launch(k) for k in range(1, self.nodes)}, deadline)
            self.wait_alive(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _build_network(self) -> None:
        sw = self.switch
        _cmd(["ip", "netns", "add", sw])
        _cmd(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _cmd(["ip", "-n", sw, "link", "set", "br0", "up"])
        for k in range(self.nodes):
            ns = self.ns(k)
            _cmd(["ip", "netns", "add", ns])
            # Both ends are created straight in their namespaces: the root namespace never holds one.
            _cmd(["ip", "-n", sw, "link", "add", f"v{k}", "type", "veth", "peer", "name", "eth0", "netns", ns])
            _cmd(["ip", "-n", sw, "link", "set", f"v{k}", "master", "br0", "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.ip(k)}/24", "dev", "eth0"])
            _cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _cmd(["ip", "-n", ns, "route", "add", "default", "dev", "eth0"])  # Ray's node-IP probe

    def _make_cgroups(self) -> None:
        if all(b is None for b in self.cgroup_bytes):
            return
        base = cgroup_base()
        if base is None:
            raise ClusterError("cgroup_bytes: no writable cgroup memory controller")
        parent, limit_file, version = base
        for k, limit in enumerate(self.cgroup_bytes):
            if limit is None:
                continue
            group = parent / f"{PREFIX}-{self.tag}-n{k}"
            group.mkdir()
            self._cgroups[k] = group
            (group / limit_file).write_text(str(int(limit)))
            # No swapping around the limit where the kernel offers the knob: the limit is the RAM.
            swap = group / ("memory.swap.max" if version == "v2" else "memory.memsw.limit_in_bytes")
            try:
                swap.write_text("0" if version == "v2" else str(int(limit)))
            except OSError:
                pass

    def cgroup(self, k: int) -> Path | None:
        """Node k's memory cgroup directory, None without a limit."""
        return self._cgroups.get(k)

    def _ray_start_argv(self, k: int) -> list[str]:
        argv = [sys.executable, "-c", _RAY_CLI, "start", f"--node-ip-address={self.ip(k)}",
                f"--temp-dir={self.temp_dir(k)}", f"--object-store-memory={int(self.object_store_bytes)}",
                "--disable-usage-stats"]
        if k == 0:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        if self.cpus is not None:
            argv.append(f"--num-cpus={self.cpus}")
        if self.memory_bytes[k] is not None:
            argv.append(f"--memory={int(self.memory_bytes[k])}")
        return argv

    def _launch(self, k: int) -> subprocess.Popen:
        """`ray start` for node k (it daemonizes the node's processes and exits once they are up)."""
        tmp = self.temp_dir(k)
        tmp.mkdir(exist_ok=True)
        # `ray start --head` refuses to start when the address recorded in its temp dir (by the
        # previous head, killed) is also the address of some gcs_server in `ps`, whatever its
        # namespace: another cluster on the same subnet. `ray stop` would remove the record.
        (tmp / "ray_current_cluster").unlink(missing_ok=True)
        argv = ["ip", "netns", "exec", self.ns(k), *self._ray_start_argv(k)]
        if k in self._cgroups:
            # Join the group before exec, so `ray start` and every process it forks are charged
            # there. Before `ip netns exec`: its fresh /sys has no /sys/fs/cgroup.
            argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self._cgroups[k] / "cgroup.procs"), *argv]
        with open(tmp / "ray_start.log", "ab") as log:
            # A session of its own: Ctrl-C in the terminal reaches the test, not the "remote" nodes.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self._node_env(), start_new_session=True)

    def _wait_ray_start(self, procs: dict[int, subprocess.Popen], deadline: float) -> None:
        for k, p in procs.items():
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise ClusterError(f"ray start on node {k} did not finish in time:\n{self._start_log(k)}")
            if rc != 0:
                raise ClusterError(f"ray start on node {k} failed ({rc}):\n{self._start_log(k)}")

    def _start_log(self, k: int, lines: int = 30) -> str:
        try:
            return "\n".join((self.temp_dir(k) / "ray_start.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- the GCS's view ---------------------------------------------------------------------------

    def node_table(self, timeout: float = 10) -> list[dict]:
        """The GCS's node table: dicts of ip, node_id, alive, head, resources (dead nodes included,
        a restarted node appears twice). Raises ClusterError when the GCS does not answer."""
        p = self._probe
        margin = 1.0
        if p is None or p.poll() is not None:
            p = self._probe = self.popen(0, [sys.executable, "-c", _PROBE, self.address], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         start_new_session=True)
            margin = 5.0  # its first answer waits for `import ray`
        try:
            p.stdin.write(f"{timeout}\n")
            p.stdin.flush()
            ready, _, _ = select.select([p.stdout], [], [], timeout + margin)
            line = p.stdout.readline() if ready else ""
        except OSError:  # the helper died (kill_node(0))
            line = ""
        if not line:
            self._stop_probe()  # stuck (a GcsClient connecting to a dead GCS) or dead: a new one next time
            raise ClusterError(f"no answer from the GCS at {self.address} in {timeout + margin:.0f} s")
        reply = json.loads(line)
        if "error" in reply:
            raise ClusterError(f"GCS at {self.address}: {reply['error']}")
        return reply["nodes"]

    def alive(self, timeout: float = 10) -> list[str]:
        """IPs of the nodes the GCS reports alive, in node order."""
        ips = {n["ip"] for n in self.node_table(timeout) if n["alive"]}
        return sorted(ips, key=lambda ip: tuple(int(x) for x in ip.split(".")))

    def wait_alive(self, nodes=None, timeout: float = 60) -> None:
        """Until every node of `nodes` (default all) is alive; ClusterError after `timeout`."""
        want = {self.ip(k) for k in (range(self.nodes) if nodes is None else nodes)}
        self._wait(lambda ips: want <= ips, timeout, f"nodes {sorted(want)} alive")

    def wait_dead(self, k: int, timeout: float = 60) -> float:
        """Until the GCS no longer reports node k alive; returns the seconds waited."""
        return self._wait(lambda ips: self.ip(k) not in ips, timeout, f"node {k} marked dead")

    def _wait(self, done, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        last = None
        while True:
            try:
                ips = set(self.alive(timeout=5))
                if done(ips):
                    return time.monotonic() - t0
                last = f"alive: {sorted(ips)}"
            except ClusterError as e:
                last = str(e)
            if time.monotonic() - t0 > timeout:
                raise ClusterError(f"timed out waiting for {what} ({last})")
            time.sleep(0.2)

    def listening(self) -> dict[str, list[tuple[str, int]]]:
        """TCP listening sockets (address, port) per namespace of this cluster, and under "root"
        those of the initial namespace (this process's, normally)."""
        out = {"root": _parse_ss(_cmd(["ss", "-ltnH"]).stdout)}
        for ns in [*(self.ns(k) for k in range(self.nodes)), self.switch]:
            out[ns] = _parse_ss(_cmd(["ip", "netns", "exec", ns, "ss", "-ltnH"]).stdout)
        return out

    # --- faults -----------------------------------------------------------------------------------

    def cut(self, k: int) -> None:
        """Partition node k: its switch port goes down (its eth0 loses carrier, nothing passes)."""
        _cmd(["ip", "-n", self.switch, "link", "set", f"v{k}", "down"])

    def restore(self, k: int) -> None:
        """Undo cut(k). If the GCS marked node k dead meanwhile, its raylet exits on reconnecting:
        call start_node(k) (see the module docstring)."""
        _cmd(["ip", "-n", self.switch, "link", "set", f"v{k}", "up"])

    def netem(self, delay_ms: float, nodes=None) -> None:
        """Add `delay_ms` of round-trip time to each listed node's link (default all): delay_ms/2
        in each direction, out of the node (its eth0) and into it (its switch port). A path crosses
        two links, so between two delayed nodes the round trip grows by 2 * delay_ms, between a
        delayed and an undelayed node by delay_ms. Calling it again replaces the delay.

        With the kernel's sch_netem: a netem qdisc on both ends, its queue limit raised from 1000
        packets (which would drop the packets of a bulk transfer waiting out the delay). Without it
        (self.netem_method says which was used): the userspace relay above, same semantics."""
        half_ms = delay_ms / 2
        for k in (range(self.nodes) if nodes is None else nodes):
            if self._has_netem():
                for netns, dev in ((self.ns(k), "eth0"), (self.switch, f"v{k}")):
                    _cmd(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                          f"{int(round(half_ms * 1000))}us", "limit", "1000000"])
            else:
                self._relay(k, half_ms)

    def clear_netem(self, nodes=None) -> None:
        """Remove the delay from each listed node's link (default all); no delay: no-op."""
        for k in (range(self.nodes) if nodes is None else nodes):
            if self._relays.get(k) is not None:
                # Never both vK and bK on the bridge with the relay running: a loop, a broadcast storm.
                _cmd(["ip", "-n", self.switch, "link", "set", f"b{k}", "nomaster"])
                _cmd(["ip", "-n", self.switch, "link", "set", f"v{k}", "master", "br0"])
                self._stop_relay(k)
            elif self._has_netem():
                for netns, dev in ((self.ns(k), "eth0"), (self.switch, f"v{k}")):
                    _cmd(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)  # none: fine

    def _has_netem(self) -> bool:
        if self.netem_method is None:
            p = _cmd(["tc", "-n", self.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                     check=False)
            _cmd(["tc", "-n", self.switch, "qdisc", "del", "dev", "lo", "root"], check=False)
            self.netem_method = "tc netem" if p.returncode == 0 else "relay"
        return self.netem_method == "tc netem"

    def _relay(self, k: int, one_way_ms: float) -> None:
        p = self._relays.get(k)
        if p is not None and p.poll() is None:
            p.stdin.write(f"{one_way_ms}\n")  # a running relay just takes the new delay
            p.stdin.flush()
            return
        sw = self.switch
        if _cmd(["ip", "-n", sw, "link", "show", f"r{k}"], check=False).returncode != 0:
            _cmd(["ip", "-n", sw, "link", "add", f"r{k}", "type", "veth", "peer", "name", f"b{k}"])
            _cmd(["ip", "-n", sw, "link", "set", f"r{k}", "up"])
            _cmd(["ip", "-n", sw, "link", "set", f"b{k}", "up"])
        p = self._relays[k] = subprocess.Popen(
            ["ip", "netns", "exec", sw, sys.executable, "-c", _RELAY, f"v{k}", f"r{k}", str(one_way_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        ready, _, _ = select.select([p.stdout], [], [], 10)
        if not ready or p.stdout.readline().strip() != "ready":
            self._stop_relay(k)
            raise ClusterError(f"the delay relay of node {k} did not start")
        _cmd(["ip", "-n", sw, "link", "set", f"v{k}", "nomaster"])
        _cmd(["ip", "-n", sw, "link", "set", f"b{k}", "master", "br0"])

    def _stop_relay(self, k: int) -> None:
        p = self._relays.pop(k, None)
        if p is not None:
            try:
                p.stdin.close()  # EOF: the relay exits
                p.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()
            p.stdout.close()

    def kill_node(self, k: int, sig: int = signal.SIGKILL, timeout: float = 10) -> list[int]:
        """Send `sig` to every process in node k's namespace (its Ray processes, and anything you
        started there) and, unless it is SIGSTOP/SIGCONT/SIGTSTP, wait until they are gone, with a
        SIGKILL after `timeout`. Returns the pids signalled first. The GCS marks a killed node dead
        after failure_threshold x period of health checks (refused at once), a SIGSTOPped one after
        failure_threshold x (timeout + period), as a cut one (see FAST_FAILURE_DETECTION)."""
        pids = _kill_namespace(self.ns(k), sig, timeout)
        if k == 0 and self._probe is not None and sig not in _NO_WAIT_SIGNALS:
            self._stop_probe()
        return pids

    def start_node(self, k: int, timeout: float = 60) -> None:
        """Start node k's Ray again (after kill_node, or after the GCS marked it dead during a
        cut), having killed whatever is left in its namespace; returns once the GCS reports it alive.
        Restarting node 0 starts a new, empty GCS: restart the other nodes after it."""
        if namespace_pids(self.ns(k)):
            self.kill_node(k)
        deadline = time.monotonic() + timeout
        self._wait_ray_start({k: self._launch(k)}, deadline)
        self.wait_alive([k], timeout=max(1.0, deadline - time.monotonic()))

    # --- teardown ---------------------------------------------------------------------------------

    def _stop_probe(self) -> None:
        p, self._probe = self._probe, None
        if p is not None:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Kill every node process, delete the namespaces (veths, bridge), cgroups and temp dirs.
        Idempotent; also run at exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop_probe()
        for k in list(self._relays):
            self._stop_relay(k)
        teardown(self.tag)


# --- command line ---------------------------------------------------------------------------------

def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.netns_cluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster, print how to use it, clean up on Ctrl-C/SIGTERM")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--tag")
    up.add_argument("--subnet", default="10.213.7")
    up.add_argument("--cpus", type=int)
    up.add_argument("--memory-gib", help="comma-separated per node (or one value): the 'memory' resource")
    up.add_argument("--cgroup-gib", help="comma-separated per node (or one value; 0: none): a real memory limit")
    up.add_argument("--no-auth", action="store_true", help="no token authentication")
    up.add_argument("--fast-failure-detection", action="store_true",
                    help="the GCS marks a cut node dead in ~6 s instead of ~63 s")
    down = sub.add_parser("down", help="remove the leftovers of a tag, or of every cluster of this tool")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--tag")
    which.add_argument("--all", action="store_true")
    sub.add_parser("list", help="tags with leftovers on this machine")
    args = ap.parse_args(argv)

    if args.cmd == "down":
        teardown(None if args.all else args.tag)
        return 0
    if args.cmd == "list":
        print("\n".join(tags()))
        return 0

    def gib(spec, zero_is_none=False):
        if spec is None:
            return None
        values = [None if zero_is_none and float(v) == 0 else int(float(v) * (1 << 30)) for v in spec.split(",")]
        return values if len(values) > 1 else values[0]

    cluster = NetnsCluster(args.nodes, tag=args.tag, subnet=args.subnet, cpus=args.cpus,
                           memory_bytes=gib(args.memory_gib), cgroup_bytes=gib(args.cgroup_gib, True),
                           ray_env=FAST_FAILURE_DETECTION if args.fast_failure_detection else None,
                           auth_token=None if args.no_auth else "generate")
    # SIGTERM (and SIGHUP) unwind like Ctrl-C, so the finally below cleans up.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        cluster.start()
        env = cluster.env()
        print(f"cluster {cluster.tag}: {cluster.nodes} nodes up in {cluster.start_seconds:.1f} s, "
              f"address {cluster.address}")
        for k in range(cluster.nodes):
            print(f"  node {k}: {cluster.ip(k)}  namespace {cluster.ns(k)}  temp dir {cluster.temp_dir(k)}")
        print("environment for a driver (run it inside a namespace: ip netns exec NAMESPACE ...):")
        for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED"):
            if var in env:
                print(f"  export {var}={env[var]}")
        print(f"Ctrl-C or SIGTERM to stop (or: python -m tools.netns_cluster down --tag {cluster.tag})", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
