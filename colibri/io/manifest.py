"""What a model directory's manifest speaks in, for both kinds (a colibri container,
colibri/io/container.py, and a GGUF read in place, colibri/io/gguf_link.py): its file name and
version, the checksums of expert blobs, and the byte ranges an expert is read as."""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "colibri.json"
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- checksums
# xxh3_64 is what writers record. Measured on one thread here (bench/io/checksums.py): ~10 GB/s
# at expert sizes (3.5 MB OLMoE, 22 MB DeepSeek-V3) against 2-3.3 GB/s for zlib.crc32, ~1.5 for
# sha1 and ~0.7 for blake2b; that is ~5% of the time a 0.5 GB/s disk takes to read the expert
# (crc32: 15-25%), ~2-3% of a streamed token's time, so verification stays on by default. All
# of them release the GIL, so reader threads verify while the kernels compute. crc32 (stdlib)
# is also accepted, for containers that record it.
CHECKSUM = "xxh3_64"


def _xxh3_64(buf) -> str:
    import xxhash  # imported on first use: `colibri --help` does not load it

    return f"{xxhash.xxh3_64_intdigest(buf):016x}"


def _crc32(buf) -> str:
    return f"{zlib.crc32(buf):08x}"


CHECKSUMS = {"xxh3_64": _xxh3_64, "crc32": _crc32}


def checksum(buf: np.ndarray, algorithm: str = CHECKSUM) -> str:
    """Hex digest of a contiguous uint8 array (one expert blob) with `algorithm`."""
    return CHECKSUMS[algorithm](memoryview(buf).cast("B"))


class Digest:
    """A checksum taken over several pieces in turn (an expert read as several ranges); the
    same digest as `checksum` of their concatenation."""

    def __init__(self, algorithm: str = CHECKSUM):
        self.algorithm = algorithm
        if algorithm == "xxh3_64":
            import xxhash

            self._h = xxhash.xxh3_64()
        else:
            self._crc = 0

    def update(self, buf: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(buf)).cast("B")
        if self.algorithm == "xxh3_64":
            self._h.update(view)
        else:
            self._crc = zlib.crc32(view, self._crc)

    def hexdigest(self) -> str:
        return f"{self._h.intdigest():016x}" if self.algorithm == "xxh3_64" else f"{self._crc:08x}"


@dataclass(frozen=True)
class ExpertRange:
    """One byte range of an expert on disk: `nbytes` at `offset` of `path`, landing at
    `blob_offset` in the expert's blob, or handed to `repack(raw, blob)` when its bytes must be
    rearranged first (colibri/io/expert_reader.py)."""

    path: Path
    offset: int
    nbytes: int
    blob_offset: int = 0
    repack: Callable[[np.ndarray, np.ndarray], None] | None = None


