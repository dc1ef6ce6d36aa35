"""Mirrors: byte-identical copies of a model's expert files on other drives (`--mirror
DIR[:WEIGHT]`), so expert reads are spread over several drives and N drives read about N times
what one does while reads are in flight on all of them (the store's readahead threads, the
resident load's readers).

Each expert (layer, id) is read whole from one drive, chosen by weighted rendezvous hashing
(highest random weight): every drive draws a score for the expert from a hash of (drive, layer,
id) and its weight, and the best score wins. The same expert goes to the same drive in every
run, each drive's share of the experts is its share of the weights, and a drive that leaves the
list moves only its own experts (every other expert keeps its winner). Drive 0 is the primary,
the model's own directory.

A mirror file is checked at start (present, the same size, the same first and last 4096 bytes:
a stale copy of a re-converted model differs in its header) and by every read from it (the
expert checksum when verification is on, a short read, an I/O error). A file that fails either
way is read from the primary from then on, with one warning naming it: a bad mirror costs
speed, never tokens. The primary's own failures stay what they were (expert_reader.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from colibri.errors import ColibriError

PROBE_BYTES = 4096  # compared at each end of a mirror file at start
MIRROR_HINT = "give a directory holding a copy of the model's expert files (e.g. `cp -r MODEL_DIR DIR`)"


def parse_mirror(text) -> tuple[Path, float | None]:
    """`--mirror DIR` or `DIR:WEIGHT` -> (DIR, weight or None). A tail after the last colon that
    is not a number belongs to the directory's name."""
    text = os.fspath(text)
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            weight = float(tail)
        except ValueError:
            return Path(text), None
        return Path(head), check_weight(weight, f"--mirror {text}")
    return Path(text), None


def check_weight(weight, what: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ColibriError(f"{what}: a drive's weight must be a number > 0, not {weight!r}")
    return float(weight)


def check_mirror_dir(directory: Path) -> None:
    if not directory.exists():
        raise ColibriError(f"--mirror {directory}: no such directory; {MIRROR_HINT}")
    if not directory.is_dir():
        raise ColibriError(f"--mirror {directory} is not a directory; {MIRROR_HINT}")


def parse_mirrors(texts) -> list[tuple[Path, float | None]]:
    """EngineConfig.mirrors ("DIR" or "DIR:WEIGHT" each) as (directory, weight or None), every
    directory checked to exist (a ColibriError naming it otherwise)."""
    out = [parse_mirror(t) for t in texts or ()]
    for directory, _ in out:
        check_mirror_dir(directory)
    return out


@dataclass
class DriveStats:
    bytes_read: int = 0
    reads: int = 0       # experts read from it
    # Seconds with a read in flight on the drive (wall time, however many readers share it), so
    # bytes_read / read_s is the drive's measured rate; a sum of each pread's time would count
    # the same second once per reader.
    read_s: float = 0.0
    errors: int = 0      # reads that failed on it (a mirror's were then read from the primary)


@dataclass
class Drive:
    dir: Path
    weight: float
    key: bytes  # what its hash draws are keyed on: its resolved directory
    stats: DriveStats = field(default_factory=DriveStats)
    in_flight: int = 0       # preads on it now
    busy_since: float = 0.0  # when in_flight last rose from 0


class Drives:
    """The drives one container's experts are read from: the primary (the model's directory)
    and its mirrors, which drive serves each expert, and what each drive has read. Thread-safe."""

    def __init__(self, container, mirrors=(), primary_weight: float | None = None):
        """`mirrors`: (directory, weight or None) per mirror; a missing weight, and the primary's
        by default, is 1."""
        self.container = container
        primary = 1.0 if primary_weight is None else check_weight(primary_weight, "--primary-weight")
        self.drives = [_drive(container.dir, primary)]
        for directory, weight in mirrors:
            directory = Path(directory)
            check_mirror_dir(directory)
            drive = _drive(directory, 1.0 if weight is None else check_weight(weight, f"--mirror {directory}"))
            if any(d.key == drive.key for d in self.drives):
                raise ColibriError(f"--mirror {directory} is given twice (or is the model's own directory); "
                                   "give each drive once")
            self.drives.append(drive)
        self._lock = threading.Lock()
        self._bad: set[tuple[int, Path]] = set()  # (mirror, primary file) read from the primary instead
        if len(self.drives) > 1:
            for path in sorted({p for prefix in container.expert_layouts for p in container.expert_paths(prefix)}):
                self._check_file(path)

    # ------------------------------------------------------------------ where
    def path_on(self, drive: int, path: Path) -> Path:
        """Where expert file `path` (a primary path) lies on `drive`: the same place under the
        mirror's directory; a file outside the model's directory (a linked GGUF) by its name."""
        if drive == 0:
            return path
        base = self.container.dir
        try:
            rel = path.relative_to(base)
        except ValueError:
            try:
                rel = path.resolve().relative_to(base.resolve())
            except ValueError:
                rel = Path(path.name)
        return self.drives[drive].dir / rel

    def choose(self, prefix: str, e: int) -> int:
        """The drive expert e of `prefix` is striped to (weighted rendezvous hashing): each drive
        scores -weight / ln(u), u uniform in (0, 1) from the hash; a drive wins with probability
        weight / total weight."""
        if len(self.drives) == 1:
            return 0
        import xxhash  # (only with mirrors; a dependency, imported where needed as io/manifest.py does)

        name = f"\0{prefix}\0{e}".encode()
        best, best_score = 0, -1.0
        for i, d in enumerate(self.drives):
            u = ((xxhash.xxh3_64_intdigest(d.key + name) >> 11) + 0.5) / 2.0 ** 53  # (53 bits: never 0 or 1)
            score = -d.weight / math.log(u)
            if score > best_score:
                best, best_score = i, score
        return best

    def drive_for(self, prefix: str, e: int, paths) -> int:
        """choose(), or the primary where any of the expert's files is bad on the chosen mirror."""
        drive = self.choose(prefix, e)
        if drive and self._bad and any((drive, p) in self._bad for p in paths):
            return 0
        return drive

    # ------------------------------------------------------------------ health
    def _check_file(self, path: Path) -> None:
        """Compare every mirror's copy of expert file `path` with it; a copy that differs is
        marked bad (read from the primary) with one warning."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            head, tail = _ends(f, size)
        for i in range(1, len(self.drives)):
            copy = self.path_on(i, path)
            try:
                if not copy.is_file():
                    what = "is missing" if not copy.exists() else "is not a file"
                elif copy.stat().st_size != size:
                    what = f"has {copy.stat().st_size} bytes, the primary {size}"
                else:
                    with open(copy, "rb") as f:
                        copy_head, copy_tail = _ends(f, size)
                    what = (f"differs in its first {PROBE_BYTES} bytes" if copy_head != head else
                            f"differs in its last {PROBE_BYTES} bytes" if copy_tail != tail else None)
            except OSError as err:
                what = f"cannot be read ({err.strerror})"
            if what is not None:
                self.mark_bad(i, [path], what)

    def mark_bad(self, drive: int, paths, why: str) -> None:
        """Read these files (primary paths) from the primary from now on; one warning per file."""
        fresh = []
        with self._lock:
            for p in paths:
                if (drive, p) not in self._bad:
                    self._bad.add((drive, p))
                    fresh.append(p)
        for p in fresh:
            warnings.warn(f"mirror file {self.path_on(drive, p)} {why}: reading {p} from the model's own drive "
                          "instead for the rest of this run", stacklevel=3)

    def failed(self, drive: int, paths, err: Exception) -> None:
        """A read from mirror `drive` failed (it is then read from the primary)."""
        with self._lock:
            self.drives[drive].stats.errors += 1
        self.mark_bad(drive, paths, f"failed a read ({err})")

    # ------------------------------------------------------------------ counters
    @contextlib.contextmanager
    def reading(self, drive: int):
        """Around each pread on `drive`: counts its busy time (DriveStats.read_s)."""
        d = self.drives[drive]
        with self._lock:
            if d.in_flight == 0:
                d.busy_since = time.perf_counter()
            d.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                d.in_flight -= 1
                if d.in_flight == 0:
                    d.stats.read_s += time.perf_counter() - d.busy_since

    def record(self, drive: int, nbytes: int) -> None:
        """An expert read whole from `drive`."""
        with self._lock:
            s = self.drives[drive].stats
            s.bytes_read += nbytes
            s.reads += 1

    def stats(self) -> dict[str, dict]:
        """Per drive, by its directory: bytes_read, reads, read_s (time busy reading), errors, weight."""
        with self._lock:
            return {str(d.dir): {**asdict(d.stats), "weight": d.weight} for d in self.drives}


def _drive(directory: Path, weight: float) -> Drive:
    return Drive(directory, weight, os.fsencode(directory.resolve()))


def _ends(f, size: int) -> tuple[bytes, bytes]:
    head = f.read(PROBE_BYTES)
    f.seek(max(0, size - PROBE_BYTES))
    return head, f.read(PROBE_BYTES)
