"""Safetensors reading and writing at the byte level.

Why not only the `safetensors` package: numpy has no bfloat16 or float8, so its numpy loader
refuses those checkpoints, and its writer reorders tensors, while colibri needs each routed
expert to be one contiguous, 4096-aligned byte range (one pread per expert, O_DIRECT-ready).
The files written here are standard safetensors: `safetensors.safe_open` reads them.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

ALIGN = 4096
MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too

# safetensors dtype -> numpy dtype of the stored bytes (bf16 and fp8 stay raw bits).
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
}
_NUMPY_TO_ST = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint16): "U16",
    np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64", np.dtype(np.float64): "F64",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str           # safetensors dtype string ("F32", "BF16", ...)
    shape: tuple[int, ...]
    offset: int          # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One safetensors file, memory-mapped; tensors come back as numpy views (no copy)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("file shorter than its 8-byte header length")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > size - 8:
                    raise ValueError("header length points past the end of the file")
                if hlen > MAX_HEADER:  # as the safetensors library: garbage must not allocate GBs
                    raise ValueError(f"header length {hlen} exceeds the format's {MAX_HEADER} bytes")
                header = json.loads(f.read(hlen))
            if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
                raise ValueError("the header is not a JSON object of tensors")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ColibriError(f"{self.path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + hlen
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            dtype, shape, start, end = _entry(self.path, name, h)
            if data_start + end > size:
                raise ColibriError(
                    f"{self.path}: truncated (tensor {name} ends at byte {data_start + end}, "
                    f"file has {size}); re-download or re-convert it"
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, data_start + start, end - start)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def keys(self):
        return self.tensors.keys()

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes/elements as a read-only numpy view (bf16/fp8 as raw bits)."""
        info = self.tensors[name]
        flat = self._mm[info.offset : info.offset + info.nbytes]
        return flat.view(_DTYPES[info.dtype]).reshape(info.shape)

    def read(self, name: str, empty=np.empty) -> np.ndarray:
        """The tensor copied into a fresh array (`empty(shape, dtype)` allocates it) with one
        pread: unlike a copy out of the memory map, it leaves no file-backed pages mapped (they
        would count in RSS twice)."""
        info = self.tensors[name]
        out = empty(info.shape, _DTYPES[info.dtype])
        with open(self.path, "rb", buffering=0) as f:
            n = os.preadv(f.fileno(), [memoryview(out.reshape(-1).view(np.uint8))], info.offset)
        if n != info.nbytes:
            raise ColibriError(f"{self.path}: short read of tensor {name}; the file is truncated")
        return out

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (bf16 widened exactly; f16 converted)."""
        info = self.tensors[name]
        a = self.raw(name)
        if info.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if info.dtype.startswith("F8"):
            raise ColibriError(f"{self.path}: tensor {name} is {info.dtype}; FP8 checkpoints are not supported yet")
        return a.astype(np.float32)


def _entry(path: Path, name: str, h) -> tuple[str, tuple[int, ...], int, int]:
    """One header entry -> (dtype, shape, start, end), or a one-line ColibriError when it is not
    a well-formed tensor: a known dtype, a shape, and data offsets spanning exactly its bytes."""
    try:
        dtype, shape, (start, end) = h["dtype"], tuple(h["shape"]), h["data_offsets"]
        ok = isinstance(dtype, str) and start <= end and all(isinstance(v, int) and v >= 0
                                                             for v in (*shape, start, end))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ColibriError(f"{path}: the header entry of tensor {name} is malformed (needs dtype, shape and "
                           "data_offsets); re-download or re-convert the file")
    if dtype not in _DTYPES:
        raise ColibriError(f"{path}: tensor {name} has unsupported dtype {dtype}")
    if int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize != end - start:
        raise ColibriError(f"{path}: tensor {name} of shape {list(shape)} does not span its "
                           f"{end - start} bytes; re-download or re-convert the file")
    return dtype, shape, start, end


def safetensors_header(entries: list[tuple[str, np.dtype, tuple[int, ...]]],
                       metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The header (length prefix included, padded so the data starts 4096-aligned) for tensors
    stored back to back in `entries` order; also each tensor's absolute byte offset."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    pos = 0
    rel = {}
    for name, dtype, shape in entries:
        st = _NUMPY_TO_ST.get(np.dtype(dtype))
        if st is None:
            raise ValueError(f"cannot store dtype {dtype} for {name}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-(8 + len(blob))) % ALIGN)  # safetensors allows trailing spaces in the header
    head = struct.pack("<Q", len(blob)) + blob
    return head, {name: len(head) + off for name, off in rel.items()}


def write_safetensors(path: str | os.PathLike, tensors: list[tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> dict[str, int]:
    """Write tensors in the given order; the data section starts 4096-aligned.

    Callers that need every tensor aligned (expert blobs) give sizes that are multiples of
    4096. Returns each tensor's absolute byte offset. Written to a temporary name, fsynced and
    renamed, so a crash never leaves a half-written file under the real name.
    """
    head, offsets = safetensors_header([(n, a.dtype, a.shape) for n, a in tensors], metadata)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for _, arr in tensors:
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return offsets
