"""How many threads the numba kernels use: one per core this process may run on that no other
process keeps busy, re-decided while generating. An explicit `threads=` / `--threads` always wins.

Why: numba's default OpenMP layer spins its threads at every barrier, and a decode token makes
~100 parallel calls, so a kernel thread that shares its core with a busy process waits for that
core's time slice at every call; on an idle machine one thread per core is fastest. No
threading layer does well on both sides (OMP_WAIT_POLICY=passive and workqueue lose on the idle
machine, tbb is not installed by default), so the count adapts. Figures: docs/benchmarks.md,
"Kernel threads" (`python -m bench.engine.threads`).

How: the CPU time the cores spent busy (/proc/stat, only the cores in our affinity mask, steal
included) minus this process's own CPU time, over the window since the last decision, is what
the others used. Reading it costs ~30 us; decisions are at most one per WINDOW_S, so `apply()`
can be called before every token. numba's thread count is per-thread state: `apply()` sets it
in the calling thread, which must be the one that runs the kernels (the server's scheduler).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Others' cores ignored: a shell or a logger should not cost a kernel thread, and /proc/stat
# counts in 10 ms ticks, so an idle machine can read up to ~0.3 cores over a 0.1 s window, where
# a busy process reads ~1.0.
SLACK = 0.4
WINDOW_S = 0.5  # at most one decision per this long; while generating, the window measured
STALE_S = 10.0  # older readings say little about now (an idle server); a chat pause is shorter
PROBE_S = 0.1   # the window measured on the spot when there is no recent reading
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuReading:
    t: float      # monotonic seconds
    busy: float   # CPU-seconds the usable cores spent non-idle since boot (every process)
    mine: float   # CPU-seconds this process used, all its threads


# ----------------------------------------------------------------------------- the decision

def others_busy(a: CpuReading, b: CpuReading) -> float:
    """Cores other processes kept busy, on average, between two readings."""
    dt = b.t - a.t
    if dt <= 0:
        return 0.0
    # Per-core counters are tick-sampled and ours is exact: clamp the rounding below zero.
    return max(0.0, ((b.busy - a.busy) - (b.mine - a.mine)) / dt)


def decide(cores: int, others: float, slack: float = SLACK) -> int:
    """Threads for `cores` usable cores while others keep `others` cores busy: one per core
    nobody else wants, at least one. A core shared with a busy process costs a spinning barrier
    a time slice per kernel call; giving it up costs at most that core's share."""
    taken = max(0, math.ceil(others - slack))
    return max(1, cores - taken)


# ----------------------------------------------------------------------------- the machine

def read_cpu(cpus: set[int] | None = None) -> CpuReading:
    """Busy time of the cores in `cpus` (default: our affinity mask) and our own CPU time."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    total, per_cpu, seen = 0, 0, set()
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break  # the cpu lines come first
            name, *fields = line.split()
            user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            # steal counts as busy: in a VM it is a core someone else got (guest is inside user)
            busy = user + nice + system + irq + softirq + steal
            if name == "cpu":
                total = busy
            else:
                seen.add(int(name[3:]))
                per_cpu += busy if int(name[3:]) in cpus else 0
    # Each line is rounded down to a tick (10 ms): the all-cores line, when it is ours, has one
    # rounding instead of one per core.
    busy = total if seen <= cpus else per_cpu
    return CpuReading(time.monotonic(), busy / CLK_TCK, time.process_time())


def _cgroup_paths() -> list[str]:
    """This process's cgroup path for each hierarchy holding the cpu controller (v2: one)."""
    paths = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                paths.append(path)
    except OSError:
        pass
    return paths


def _quota_of(d: Path) -> float | None:
    """The cores a cgroup directory's CPU quota allows, or None for no quota."""
    try:
        quota, period = (d / "cpu.max").read_text().split()  # v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())  # v1: -1 for none
        return None if quota <= 0 else quota / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The tightest CPU quota on this process's cgroup and its parents (None: no quota). In a
    container the path is often "/" as seen from inside: the mount's root is then our cgroup."""
    best = None
    for path in _cgroup_paths() or ["/"]:
        for base in (root, root / "cpu", root / "cpu,cpuacct"):
            d = base / path.lstrip("/")
            while True:
                q = _quota_of(d)
                if q is not None:
                    best = q if best is None else min(best, q)
                if d == base:
                    break
                d = d.parent
    return best


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, cut to a cgroup CPU quota (rounded
    down: a 1.5-core quota throttles a second thread for a third of every period)."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_quota_cores()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores


def pool_size() -> int:
    """Threads numba started with (NUMBA_NUM_THREADS; default: the cores): the most usable."""
    from numba import config

    return config.NUMBA_NUM_THREADS


# ----------------------------------------------------------------------------- the policy

class ThreadPolicy:
    """Chooses the kernel thread count for one Engine; `threads` (explicit) always wins. One
    thread generates at a time, as with the Engine itself. The test hooks: `read` (a
    CpuReading), `clock` (its time base), `sleep`, `cores` and `pool`; fed synthetic readings,
    the policy decides as a pure function of them."""

    def __init__(self, threads: int | None = None, *, cores: int | None = None, pool: int | None = None,
                 read: Callable[[], CpuReading] = read_cpu, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 window_s: float = WINDOW_S, stale_s: float = STALE_S, probe_s: float = PROBE_S):
        self.pool = pool if pool is not None else pool_size()
        self.explicit = None if threads is None else max(1, min(int(threads), self.pool))
        self.cores = max(1, min(cores if cores is not None else usable_cores(), self.pool))
        self._read, self._clock, self._sleep = read, clock, sleep
        self.window_s, self.stale_s, self.probe_s = window_s, stale_s, probe_s
        self.threads = self.explicit or self.cores  # the current decision
        self.others: float | None = None            # what it was based on: cores busy elsewhere
        self._decided = False
        # A first reading now: the first generation then measures the window since the load
        # instead of stopping to probe.
        self._last = None if self.fixed else self._read()

    @property
    def fixed(self) -> bool:
        """True when nothing is measured: threads given, or a single usable core."""
        return self.explicit is not None or self.cores == 1

    def choose(self) -> int:
        """The thread count for the kernels about to run."""
        if self.fixed:
            return self.threads
        last = self._last
        if self._decided and self._clock() - last.t < self.window_s:
            return self.threads  # the common case, before a token: not even a reading
        now = self._read()
        if last is None or now.t - last.t > self.stale_s:
            # Nothing recent to go by (an idle server): measure a short window on the spot.
            self._sleep(self.probe_s)
            last, now = now, self._read()
        elif now.t - last.t < self.probe_s:
            # Too few ticks to tell a busy core from a blip: top the window up.
            self._sleep(self.probe_s - (now.t - last.t))
            now = self._read()
        self.others = others_busy(last, now)
        self.threads = decide(self.cores, self.others)
        self._last, self._decided = now, True
        return self.threads

    def apply(self) -> int:
        """choose(), and set it for the numba kernels run from the calling thread (numba keeps
        the count per thread: the one set where the engine was loaded does not reach the
        server's scheduler thread)."""
        from numba import get_num_threads, set_num_threads

        n = self.choose()
        if get_num_threads() != n:  # ~2 us: cheap enough before every token
            set_num_threads(n)
        return n


def run_apart(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) in a short-lived thread of its own, for kernels run by a thread that
    will not generate (Engine.load's warm-up). GNU OpenMP keeps a worker pool for every thread
    that ever ran a parallel region, and once its pooled threads outnumber the cores it stops
    spinning at barriers: a warm-up on the main thread left the server's scheduler thread at
    well under half its speed (docs/benchmarks.md, "Kernel threads"). A pool goes away with its
    thread."""
    import threading

    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller, traceback intact
            out["error"] = e

    t = threading.Thread(target=target, name="colibri-apart")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
