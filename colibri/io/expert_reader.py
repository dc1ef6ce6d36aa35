"""Reading routed experts from disk into RAM buffers, for every expert source (ResidentExperts,
ExpertStore): the open files, the preads, the alignment O_DIRECT needs, verification.

An expert is a list of byte ranges of files (Container.expert_ranges): one range for a colibri
container (its blob is stored whole), three for a model linked to a GGUF file (gate, up and
down rows live in three stacked tensors, colibri/io/gguf_link.py). Each range lands at its place
in the blob buffer; a range whose bytes must be rearranged first (GGUF's Q8_0 / Q4_0 / Q4_1
blocks into the q and scales arrays the kernels read) is read into a scratch buffer and repacked
into the blob.

O_DIRECT needs the file offset, the length and the buffer 4096-aligned. A container's blobs are
(offsets, sizes and slots are all multiples of 4096) and are read in place; a GGUF's expert rows
start anywhere, so each is read as the aligned span that covers it into an aligned bounce
buffer of this thread, and copied (a memcpy at ~10 GB/s against a disk's 1-7).

With mirrors (copies of the expert files on other drives, colibri/io/mirrors.py) each expert is
read whole from the drive it is striped to; a read that fails on a mirror is read again from the
primary, and that mirror file is left alone from then on.

Failures are EngineFaults naming the file and the expert: the client's request is fine, the
model files are not.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError, EngineFault
from colibri.io.mirrors import Drives

_ALIGN = 4096


def aligned_buffer(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] whose data pointer is 4096-aligned (O_DIRECT needs it)."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off: off + nbytes]


DIRECT_MODES = ("off", "prefer", "require")


class ExpertReader:
    """Reads one container's experts. `direct`: "off" (buffered preads), "prefer" (O_DIRECT
    where the file system takes it, else buffered: tmpfs has none) or "require" (a file that
    refuses O_DIRECT is an error). `mirrors`: (directory, weight or None) per copy of the expert
    files on another drive, `primary_weight` the model directory's weight (mirrors.Drives; None:
    1). Thread-safe: reader threads share one reader."""

    def __init__(self, container, direct: str = "off", mirrors=(), primary_weight: float | None = None):
        if direct not in DIRECT_MODES:
            raise ValueError(f"direct must be one of {DIRECT_MODES}, not {direct!r}")
        self.container = container
        self.direct = direct
        self.drives = Drives(container, mirrors, primary_weight)
        self._fds: dict[Path, tuple[int, bool]] = {}  # path -> (fd, opened with O_DIRECT)
        self._lock = threading.Lock()
        self._local = threading.local()  # bounce and scratch buffers, one set per reader thread

    def _fd(self, path: Path) -> tuple[int, bool]:
        with self._lock:
            entry = self._fds.get(path)
            if entry is None:
                entry = self._fds[path] = _open(path, self.direct)
            return entry

    def _buffer(self, name: str, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, name, None)
        if buf is None or buf.size < nbytes:
            buf = aligned_buffer(max(nbytes, 1 << 20))
            setattr(self._local, name, buf)
        return buf[:nbytes]

    def read(self, prefix: str, e: int, buf: np.ndarray, verify: bool) -> int:
        """Expert e of `prefix` into buf (its blob layout), checked when `verify`; returns the
        bytes read from disk. From the drive the expert is striped to; a mirror's failure is
        read again from the primary (the same bytes as without mirrors)."""
        ranges = self.container.expert_ranges(prefix, e)
        drive = self.drives.drive_for(prefix, e, [r.path for r in ranges])
        if drive:
            try:
                return self._read_from(drive, ranges, prefix, e, buf, verify)
            except (EngineFault, ColibriError) as err:  # (ColibriError: the copy would not open)
                self.drives.failed(drive, [r.path for r in ranges], err)
        return self._read_from(0, ranges, prefix, e, buf, verify)

    def _read_from(self, drive: int, ranges, prefix: str, e: int, buf: np.ndarray, verify: bool) -> int:
        c = self.container
        total = 0
        digest = c.new_digest(prefix) if verify else None
        for r in ranges:
            path = self.drives.path_on(drive, r.path)
            fd, direct = self._fd(path)
            dst = buf[r.blob_offset: r.blob_offset + r.nbytes] if r.repack is None else self._buffer("scratch", r.nbytes)
            with self.drives.reading(drive):
                self._pread(fd, direct, dst, r.offset, path, prefix, e)
            if digest is not None:
                digest.update(dst)
            if r.repack is not None:
                r.repack(dst, buf)
            total += r.nbytes
        if digest is not None:
            try:
                c.check_digest(prefix, e, digest, buf)
            except EngineFault:
                if drive == 0:
                    raise
                # (the container's message names the primary's file)
                raise EngineFault(f"expert {e} of {prefix} failed its checksum") from None
        self.drives.record(drive, total)
        return total

    def drive_stats(self) -> dict[str, dict]:
        """Per drive (its directory): bytes_read, reads, read_s (seconds with a read in flight on
        it: bytes_read / read_s is its rate), errors, weight."""
        return self.drives.stats()

    def _pread(self, fd: int, direct: bool, dst: np.ndarray, offset: int, path: Path, prefix: str, e: int) -> None:
        n = dst.size
        aligned = not direct or (offset % _ALIGN == 0 and n % _ALIGN == 0 and dst.ctypes.data % _ALIGN == 0)
        try:
            if aligned:
                got = os.preadv(fd, [memoryview(dst)], offset)
            else:
                start = offset - offset % _ALIGN
                span = -(-(offset + n - start) // _ALIGN) * _ALIGN
                bounce = self._buffer("bounce", span)
                got = os.preadv(fd, [memoryview(bounce)], start) - (offset - start)
                dst[:] = bounce[offset - start: offset - start + n]
        except OSError as err:
            raise EngineFault(f"reading expert {e} of {prefix} from {path} failed ({err.strerror}); "
                              "check the disk, then restore or re-convert the file") from None
        if got < n:
            raise EngineFault(f"expert {e} of {prefix} in {path} is truncated (read {max(got, 0)} of {n} bytes): "
                              "the file is damaged; re-convert or restore it")

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _open(path: Path, direct: str) -> tuple[int, bool]:
    if direct != "off":
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
        except OSError as e:
            if direct == "require":
                raise ColibriError(f"cannot open expert file {path} ({e.strerror}); "
                                   "try --expert-io pread if the filesystem refuses O_DIRECT") from None
            # e.g. tmpfs: no O_DIRECT; read through the page cache
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as e:
        raise ColibriError(f"cannot open expert file {path} ({e.strerror})") from None
