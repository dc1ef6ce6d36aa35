"""Run a command under a cgroup-v1 memory limit (page cache counts), for larger-than-RAM tests
and benchmarks: a child group is made under this process's own memory cgroup, the command
moves itself in before it starts, and the group's peak usage and failcnt are read back.

    python -m tools.memlimit LIMIT_MB -- CMD ARGS...
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def own_memory_cgroup() -> Path | None:
    try:
        for line in open("/proc/self/cgroup"):
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return ROOT / path.lstrip("/")
    except OSError:
        pass
    return None


def why_unavailable() -> str | None:
    """None when a limited child group can be made here, else the reason."""
    base = own_memory_cgroup()
    if base is None or not base.is_dir():
        return "no cgroup-v1 memory controller for this process"
    probe = base / f"colibri-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(1 << 30))
    except OSError as e:
        return f"cannot create a memory cgroup under {base}: {e.strerror}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


@dataclass
class Limited:
    returncode: int
    stdout: str
    stderr: str
    max_usage_bytes: int   # the group's peak usage (RSS + page cache)
    failcnt: int           # times the limit was hit (reclaim happened)
    oom_killed: bool


def run_limited(cmd: list[str], limit_bytes: int, timeout: float = 1800, env: dict | None = None) -> Limited:
    base = own_memory_cgroup()
    group = base / f"colibri-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        try:  # without swap the limit is hard anyway; set memsw where the kernel accounts it
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            pass
        # The child joins the group itself before exec, so everything it maps is charged there.
        procs = group / "cgroup.procs"
        p = subprocess.run(["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd], capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, **(env or {})})
        oom = "oom_kill 1" in (group / "memory.oom_control").read_text() if (group / "memory.oom_control").exists() else False
        return Limited(p.returncode, p.stdout, p.stderr, int((group / "memory.max_usage_in_bytes").read_text()),
                       int((group / "memory.failcnt").read_text()), oom or p.returncode == -9)
    finally:
        remove_cgroup(group)


def remove_cgroup(group: Path, tries: int = 50) -> None:
    """rmdir a cgroup once the kernel has let go of its last process (it may lag an exit)."""
    import time

    for _ in range(tries):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def drop_caches() -> None:
    """Cold start: flush dirty pages and drop the page cache (root only)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


if __name__ == "__main__":
    limit_mb = int(sys.argv[1])
    cmd = sys.argv[sys.argv.index("--") + 1:]
    r = run_limited(cmd, limit_mb << 20)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    print(f"peak group usage {r.max_usage_bytes / 2**20:.0f} MiB, failcnt {r.failcnt}, oom {r.oom_killed}",
          file=sys.stderr)
    sys.exit(r.returncode)
