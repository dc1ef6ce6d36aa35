"""A GGUF file run in place: `-m model.gguf` reads the dense tensors and streams the routed
experts from the user's file itself, with no second copy of the model on disk.

What the cache keeps (a "linked" model directory, cache_root()/models/gguf/KEY/NAME): the HF
config and tokenizer files derived from the GGUF's metadata, and the index colibri.json (kind
"gguf-link"): every dense tensor's scheme and shape, each MoE layer's expert blob layout, where
each expert's rows lie in the file's stacked expert tensors (`ffn_gate_exps` / `ffn_up_exps` /
`ffn_down_exps` hold expert e's rows as one contiguous range each), and a checksum of every
expert's bytes. The user's file is never written, so the checksums live here: computed once,
at first open, with a progress bar (one pass over the experts, at the disk's speed), and
checked on every read from disk as a container's are. A few kilobytes to a few megabytes.

An expert is read as three ranges (colibri/io/expert_reader.py) into the same RAM cache, hot set
and prefetch a container's blobs go through; block schemes (Q4_K, Q6_K, ...) and float types land
byte for byte, GGUF's Q8_0 / Q4_0 / Q4_1 blocks are split into the q and scales arrays the
kernels read as they land. The dense tensors are copied into RAM once at load.

The index is keyed by the first part's path, size and modification time (default_model.py); at
open every part must still have the size it was indexed at, else the index is stale and is
rebuilt by the next `-m` (a changed file is a different key).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.expert_blob import PROJECTIONS
from colibri.formats.ggml_blocks import BLOCK_TYPES
from colibri.formats.qtensor import GROUP_SIZE
from colibri.progress import ByteProgress
from colibri.io.manifest import CHECKSUM, FORMAT_VERSION, MANIFEST, Digest, ExpertRange

LINK_KIND = "gguf-link"
_PART_ALIGN = 64      # each projection's arrays inside a blob start on a cache line
_BLOB_ALIGN = 4096    # blobs (RAM slots) are page multiples, as a container's are
_READ_CHUNK = 64 << 20

# GGUF blocks colibri holds split into q and scales (formats/qtensor.py): block bytes, and
# where d, m and the payload sit in a block (ggml-common.h block_q8_0 / q4_0 / q4_1).
_SPLIT = {"q8_0": (34, 0, None, 2), "q4_0": (18, 0, None, 2), "q4_1": (20, 0, 2, 4)}
_FLOAT = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ------------------------------------------------------------------ the blob of one expert

def _projection_spec(scheme: str, rows: int, cols: int, pos: int) -> tuple[dict, int]:
    """The blob layout of one projection (ExpertLayout.projections[proj]) from byte `pos` on,
    and the position after it."""
    parts = {}

    def part(name, dtype, shape):
        nonlocal pos
        pos = _round_up(pos, _PART_ALIGN)
        parts[name] = [pos, np.dtype(dtype).str, list(shape)]
        pos += int(np.prod(shape)) * np.dtype(dtype).itemsize

    if scheme in BLOCK_TYPES:
        bt = BLOCK_TYPES[scheme]
        part("q", np.uint8, (rows, cols // bt.elements * bt.nbytes))
    elif scheme in _FLOAT:
        part("q", _FLOAT[scheme], (rows, cols))
    elif scheme in _SPLIT:
        group = GROUP_SIZE[scheme]
        part("q", np.int8 if scheme == "q8_0" else np.uint8, (rows, cols if scheme == "q8_0" else cols // 2))
        part("scales", np.float32, (rows, cols // group))
        if scheme == "q4_1":
            part("mins", np.float32, (rows, cols // group))
    else:
        raise ColibriError(f"experts stored as {scheme} cannot be streamed from a GGUF")
    return {"scheme": scheme, "shape": [rows, cols], "parts": parts}, pos


def _split_blocks(spec: dict, raw: np.ndarray, blob: np.ndarray) -> None:
    """GGUF Q8_0 / Q4_0 / Q4_1 rows as read (`raw`) -> the q / scales / mins arrays of `spec`'s
    place in the blob (f16 d and m widen exactly to float32)."""
    scheme = spec["scheme"]
    size, d_at, m_at, payload_at = _SPLIT[scheme]
    rows, cols = spec["shape"]
    blocks = raw.reshape(rows, cols // GROUP_SIZE[scheme], size)

    def view(name):
        off, dtype, shape = spec["parts"][name]
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return blob[off: off + n].view(dtype).reshape(shape)

    q = view("q")
    q.reshape(blocks.shape[0], blocks.shape[1], -1)[...] = blocks[:, :, payload_at:].view(q.dtype)
    view("scales")[...] = blocks[:, :, d_at:d_at + 2].copy().view(np.float16)[:, :, 0]
    if m_at is not None:
        view("mins")[...] = blocks[:, :, m_at:m_at + 2].copy().view(np.float16)[:, :, 0]


# ------------------------------------------------------------------ indexing (first open)

def link_gguf(path: str | os.PathLike, out: str | os.PathLike, progress: bool = True) -> Path:
    """Index the GGUF at `path` (any part of a split file) into the linked model directory
    `out`: config, tokenizer files, and the index with every expert's checksum. Written into a
    temporary sibling and renamed at the end, so an interrupted indexing leaves nothing that
    looks valid."""
    from colibri.io.gguf import read_gguf

    path, out = Path(path).resolve(), Path(out)
    if out.exists() and any(out.iterdir()) and not is_linked(out):
        raise ColibriError(f"{out} already exists and is not a GGUF index; choose a new directory")
    ckpt = read_gguf(path)
    files = [Path(f).resolve() for f in ckpt.paths or [path]]
    index = {f: i for i, f in enumerate(files)}
    tensors, dense_bytes = {}, 0
    for name in ckpt.tensors:
        t = ckpt.tensors[name]
        where = ckpt.tensors.spec(name, files)
        if isinstance(t, np.ndarray):
            nbytes = t.size * 4
            tensors[name] = {"scheme": "f32", "shape": list(t.shape), "gguf": where, "nbytes": nbytes}
        else:
            nbytes = t.nbytes
            tensors[name] = {"scheme": t.scheme, "shape": list(t.shape), "gguf": where, "nbytes": nbytes}
        dense_bytes += nbytes
    experts = {}
    for prefix, stacks in ckpt.experts.items():
        missing = [p for p in PROJECTIONS if p not in stacks]
        if missing:
            raise ColibriError(f"{path.name}: the experts of {prefix} lack {', '.join(missing)}")
        n = {stacks[p].num_experts for p in PROJECTIONS}
        if len(n) != 1:
            raise ColibriError(f"{path.name}: the expert tensors of {prefix} disagree on the expert count ({sorted(n)})")
        pos, projections = 0, {}
        for p in PROJECTIONS:
            st = stacks[p]
            projections[p], pos = _projection_spec(st.scheme, st.rows, st.cols, pos)
            projections[p]["gguf"] = [index[Path(st.path).resolve()], int(st.offset), int(st.expert_bytes)]
        experts[prefix] = {"file": Path(stacks[PROJECTIONS[0]].path).name, "num_experts": n.pop(),
                           "blob_bytes": _round_up(pos, _BLOB_ALIGN), "projections": projections}
    _checksum_experts(files, experts, progress, path.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        (tmp / "config.json").write_text(json.dumps(ckpt.config, indent=2))
        (tmp / "tokenizer.json").write_text(ckpt.tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(ckpt.tokenizer_config, indent=2, ensure_ascii=False))
        (tmp / "generation_config.json").write_text(json.dumps(ckpt.generation_config, indent=2))
        st = [f.stat() for f in files]
        manifest = {"format": "colibri", "version": FORMAT_VERSION, "kind": LINK_KIND, "source": str(path),
                    "model_type": ckpt.config.get("model_type"),
                    "gguf_files": [{"path": str(f), "size": s.st_size, "mtime_ns": s.st_mtime_ns}
                                   for f, s in zip(files, st)],
                    "dense_bytes": dense_bytes, "tensors": tensors, "experts": experts}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _checksum_experts(files: list[Path], experts: dict, progress: bool, name: str) -> None:
    """Each expert's checksum over its three ranges as stored, in projection order (what
    ExpertReader feeds the digest as it reads them)."""
    total = sum(spec["num_experts"] * sum(spec["projections"][p]["gguf"][2] for p in PROJECTIONS)
                for spec in experts.values())
    fds = [os.open(f, os.O_RDONLY) for f in files]
    buf = np.empty(_READ_CHUNK, np.uint8)
    try:
        shown = ByteProgress(f"indexing the experts of {name} (once)", total) if progress and total else nullcontext()
        with shown as bar:
            for spec in experts.values():
                digests = []
                for e in range(spec["num_experts"]):
                    d = Digest(CHECKSUM)
                    for p in PROJECTIONS:
                        fi, offset, nbytes = spec["projections"][p]["gguf"]
                        start = offset + e * nbytes
                        for at in range(0, nbytes, _READ_CHUNK):
                            n = min(_READ_CHUNK, nbytes - at)
                            got = os.preadv(fds[fi], [memoryview(buf[:n])], start + at)
                            if got != n:
                                raise ColibriError(f"{files[fi]}: expert {e} ends past the end of the file; "
                                                   "the file is truncated")
                            d.update(buf[:n])
                        if bar is not None:
                            bar.add(nbytes)
                    digests.append(d.hexdigest())
                spec.update(checksum=CHECKSUM, digests=digests)
    finally:
        for fd in fds:
            os.close(fd)


# ------------------------------------------------------------------ reading (every load)

class GGUFLink:
    """The GGUF side of a linked model directory (Container delegates to it)."""

    def __init__(self, model_dir: Path, manifest: dict):
        self.dir = model_dir
        self.manifest = manifest
        entries = manifest.get("gguf_files")
        if not (isinstance(entries, list) and entries and all(isinstance(f, dict) for f in entries)):
            raise ColibriError(f"{model_dir}: its index names no GGUF files; delete the directory and open the GGUF again")
        self.files = [Path(f["path"]) for f in entries]
        for f, entry in zip(self.files, entries):
            if not f.is_file():
                raise ColibriError(f"{f} (indexed in {model_dir}) is missing; restore it, or open the model's "
                                   "GGUF again wherever it is now")
            if f.stat().st_size != entry.get("size"):
                raise ColibriError(f"{f} has changed since it was indexed ({f.stat().st_size} bytes, indexed at "
                                   f"{entry.get('size')}); delete {model_dir} and open the GGUF again")
        self.dense_bytes = int(manifest.get("dense_bytes", 0))
        self._ranges: dict[str, list[tuple[Path, int, int, int, Callable | None]]] = {}
        for prefix, spec in manifest.get("experts", {}).items():
            ranges = []
            for p in PROJECTIONS:
                proj = spec["projections"][p]
                fi, offset, nbytes = proj["gguf"]
                if proj["scheme"] in _SPLIT:
                    ranges.append((self.files[fi], offset, nbytes, 0, partial(_split_blocks, proj)))
                else:
                    ranges.append((self.files[fi], offset, nbytes, proj["parts"]["q"][0], None))
            self._ranges[prefix] = ranges

    def tensor_parts(self, name: str, copy: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
        """A dense tensor's arrays (q, scales, mins; a 1-D tensor's values as q), copied into RAM
        by `copy` from the mapped file, found by the index (no GGUF parse: a 150k-token
        vocabulary alone takes gguf-py seconds)."""
        from colibri.io.gguf import tensor_from_spec

        t = tensor_from_spec(self.manifest["tensors"][name]["gguf"], self.files)
        if isinstance(t, np.ndarray):
            return {"q": copy(np.ascontiguousarray(t, dtype=np.float32))}
        return {part: copy(np.ascontiguousarray(a)) for part, a in t.parts().items()}

    def tensor_bytes(self, name: str) -> int:
        return int(self.manifest["tensors"][name].get("nbytes", 0))

    def expert_ranges(self, prefix: str, e: int) -> list[ExpertRange]:
        return [ExpertRange(path, offset + e * nbytes, nbytes, blob_offset, repack)
                for path, offset, nbytes, blob_offset, repack in self._ranges[prefix]]

    def describe(self, prefix: str) -> str:
        return ", ".join(sorted({r[0].name for r in self._ranges[prefix]}))


def is_linked(model_dir: Path) -> bool:
    """Whether `model_dir` holds a complete linked model (its index is written last)."""
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text()).get("kind") == LINK_KIND
    except (OSError, ValueError, AttributeError):
        return False


def is_current(model_dir: Path) -> bool:
    """Whether `model_dir`'s index still describes its GGUF files: every part (of a split set
    too, though the cache key follows only the part named) has the size and modification
    time it was indexed at."""
    try:
        entries = json.loads((Path(model_dir) / MANIFEST).read_text())["gguf_files"]
        for f in entries:
            st = os.stat(f["path"])
            if (st.st_size, st.st_mtime_ns) != (f["size"], f["mtime_ns"]):
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
