"""The machine a plan is for: this one, probed (/proc/meminfo and the memory cgroup, cores,
nvidia-smi, a short O_DIRECT read of the model's files, one thread's memory bandwidth), or one
described in a file (`colibri plan --machine FILE.json`; named machines: machine_specs.py)."""
from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from colibri.errors import ColibriError
from colibri.plan.policy import ALIGN, MiB, round_up

if TYPE_CHECKING:
    from colibri.plan.facts import ModelFacts


@dataclass
class GPU:
    name: str
    total_bytes: int
    free_bytes: int
    bandwidth_gbs: float | None = None


@dataclass
class Machine:
    cores: int
    ram_total_bytes: int
    ram_available_bytes: int          # MemAvailable, or the memory cgroup's room when smaller
    gpus: list[GPU] = field(default_factory=list)
    disk_read_gbs: float | None = None  # expert-sized reads, from the probe
    disk_probe: str = ""                # how the disk figure was measured
    mem_read_gbs: float | None = None   # one thread, from the probe (a described machine: all cores)
    source: str = "probed"
    name: str = ""                      # a named machine's name (machine_specs.py); "" for this one
    # Identical drives the experts are striped over (--mirror: a copy of the expert files on
    # each); the plan reads disk_read_gbs from each of them at once.
    drives: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Machine":
        """A machine description (e.g. `colibri plan --machine FILE.json`); unknown keys are an error."""
        if not isinstance(d, dict):
            raise ColibriError(f"machine description: expected an object of fields, not {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ColibriError(f"machine description: unknown field(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(sorted(names))}")
        try:
            gpus = [g if isinstance(g, GPU) else GPU(**g) for g in d.get("gpus", [])]
            m = cls(**{**d, "gpus": gpus})
        except TypeError as e:
            raise ColibriError(f"machine description: {e}") from None
        sizes = {"cores": m.cores, "ram_total_bytes": m.ram_total_bytes, "ram_available_bytes": m.ram_available_bytes}
        for i, g in enumerate(m.gpus):
            sizes.update({f"gpus[{i}].total_bytes": g.total_bytes, f"gpus[{i}].free_bytes": g.free_bytes})
        bad = [k for k, v in sizes.items() if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0]
        if bad or m.cores < 1:
            k = bad[0] if bad else "cores"
            raise ColibriError(f"machine description: {k} must be a non-negative number (cores at least 1), "
                               f"not {sizes[k]!r}")
        if not isinstance(m.drives, int) or isinstance(m.drives, bool) or m.drives < 1:
            raise ColibriError(f"machine description: drives must be a whole number >= 1, not {m.drives!r}")
        m.source = d.get("source", "file")
        return m


def read_machine_file(path: str | os.PathLike) -> Machine:
    try:
        return Machine.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:
        raise ColibriError(f"cannot read the machine description {path} ({e})") from None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (page cache that could be reclaimed
    counts as room), or None when no limit applies."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        base = None
        if "memory" in controllers.split(","):  # cgroup v1
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit_f, usage_f, inactive_key = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():  # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit_f, usage_f, inactive_key = "memory.max", "memory.current", "inactive_file"
        if base is None:
            continue
        try:
            raw = (base / limit_f).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            usage = int((base / usage_f).read_text())
            stat = dict(l.split() for l in (base / "memory.stat").read_text().splitlines() if " " in l)
            return max(0, int(raw) - usage + int(stat.get(inactive_key, 0)))
        except (OSError, ValueError):
            return None
    return None


def discover_gpus() -> list[GPU]:
    """NVIDIA GPUs through nvidia-smi; none when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append(GPU(parts[0], int(float(parts[1])) * MiB, int(float(parts[2])) * MiB))
        except (IndexError, ValueError):
            continue
    return gpus


def probe_disk(files: list[str], block: int = 4 * MiB, max_bytes: int = 64 * MiB,
               max_s: float = 0.5) -> tuple[float | None, str]:
    """Read random `block`-sized, 4096-aligned ranges of `files` for at most `max_s` seconds
    and `max_bytes`; O_DIRECT where the filesystem allows it (the page cache would report RAM
    speed), else buffered reads after dropping the ranges from the page cache."""
    block = max(ALIGN, round_up(block, ALIGN))
    targets = [(f, os.path.getsize(f)) for f in files if os.path.isfile(f) and os.path.getsize(f) >= ALIGN]
    if not targets:
        return None, "no model files to read"
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    rng = random.Random(0)
    total = reads = 0
    direct = hasattr(os, "O_DIRECT")
    t0 = time.perf_counter()
    try:
        while total < max_bytes and time.perf_counter() - t0 < max_s:
            path, size = rng.choice(targets)
            span = min(block, size // ALIGN * ALIGN)
            off = rng.randrange(0, max(1, (size - span) // ALIGN + 1)) * ALIGN
            n = _read_range(path, off, span, buf, direct)
            if n is None and direct:
                direct = False  # this filesystem refuses O_DIRECT
                n = _read_range(path, off, span, buf, False)
            total += n or 0
            reads += 1
    finally:
        buf.close()
    elapsed = time.perf_counter() - t0
    if total == 0 or elapsed <= 0:
        return None, "the probe read nothing"
    how = "O_DIRECT" if direct else "buffered, cache dropped"
    return total / elapsed / 1e9, f"{how}: {total / MiB:.0f} MiB in {reads} reads of {block // 1024} KiB"


def _read_range(path: str, off: int, n: int, buf: mmap.mmap, direct: bool) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:
        return None
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        view = memoryview(buf)[:n]
        try:
            return os.preadv(fd, [view], off)
        except OSError:
            return None
        finally:
            view.release()
    finally:
        os.close(fd)


def probe_memory(nbytes: int = 128 * MiB) -> float | None:
    """One thread's read bandwidth (numpy sum over a large array), best of three."""
    import numpy as np

    try:
        a = np.ones(nbytes // 8, dtype=np.float64)
    except MemoryError:
        return None
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return a.nbytes / best / 1e9 if best else None


def probe_machine(model: ModelFacts | None = None, disk: bool = True) -> Machine:
    info = _meminfo()
    total = info.get("MemTotal", 0)
    avail = info.get("MemAvailable", info.get("MemFree", 0))
    room = _cgroup_room()
    if room is not None:
        avail = min(avail, room)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    disk_gbs, how = (None, "not measured")
    if disk and model is not None:
        sizes = [layer.expert_bytes for layer in model.expert_layers]
        block = sorted(sizes)[len(sizes) // 2] if sizes else 4 * MiB
        disk_gbs, how = probe_disk(model.probe_files, block=min(max(block, 256 * 1024), 8 * MiB))
    return Machine(cores, total, avail, discover_gpus(), disk_gbs, how, probe_memory())
