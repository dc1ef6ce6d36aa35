"""Opening a GGUF (one file or the parts of a gguf-split set): metadata, the tensor table with
each tensor's file and absolute byte offset, the checks that make a damaged or unsupported file
a one-line error at open, and the byte-exact repack of a tensor's bytes into colibri's types.

Split sets are llama.cpp's (tools/gguf-split, and gguf-py's GGUFWriter with split_max_*):
`NAME-00001-of-00003.gguf` ...; every part has `split.no` (0-based), `split.count` and
`split.tensors.count`; only the first part carries the model's metadata; each tensor lives
in exactly one part.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.ggml_blocks import BLOCK_TYPES, SCHEME_OF_GGUF, row_bytes
from colibri.formats.qtensor import QTensor

# Split-scale schemes: GGUF blocks of 32 weights, an f16 d (+ f16 m) then the payload; colibri
# keeps the scales apart (ggml-common.h block_q4_0 etc.). bytes, header, payload.
_SPLIT_BLOCK = {"Q4_0": (18, 2, 16), "Q4_1": (20, 4, 16), "Q8_0": (34, 2, 32)}
_FLOAT = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
SCHEME_OF_TYPE = {**_FLOAT, "Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", **SCHEME_OF_GGUF}
SUPPORTED_TYPES = tuple(SCHEME_OF_TYPE)
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the file set: where its bytes are and how they are laid out."""

    name: str
    path: Path
    offset: int                 # absolute byte offset of the data in `path`
    type_name: str              # GGUF type ("Q4_K")
    ne: tuple[int, ...]         # GGUF dims, innermost first
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / HF order (outermost first)."""
        return tuple(reversed(self.ne))


@dataclass
class GGUFFiles:
    paths: list[Path]            # the parts, in order (one for an unsplit file)
    meta: dict                   # the first part's metadata
    tensors: dict[str, TensorRef]


def open_gguf(path: Path) -> GGUFFiles:
    """Read the metadata and tensor table of `path` and of the other parts of its split set."""
    reader = _open_reader(path)
    meta = _metadata(reader)
    count = int(meta.get("split.count", 1) or 1)
    if count <= 1:
        return GGUFFiles([path], meta, _tensor_refs(path, reader))
    paths = _split_parts(path, count)
    readers = {path: reader}
    tensors: dict[str, TensorRef] = {}
    first_meta = None
    for i, part in enumerate(paths):
        if part not in readers:
            readers[part] = _open_reader(part)
        r = readers.pop(part)
        m = meta if part == path else _metadata(r)
        if int(m.get("split.no", -1)) != i or int(m.get("split.count", 0)) != count:
            raise ColibriError(f"{part.name}: its split metadata (split.no={m.get('split.no')}, "
                               f"split.count={m.get('split.count')}) says it is not part {i + 1} of {count}")
        if i == 0:
            first_meta = m
        for name, ref in _tensor_refs(part, r).items():
            if name in tensors:
                raise ColibriError(f"{part.name}: tensor {name} is also in {tensors[name].path.name}")
            tensors[name] = ref
    expected = first_meta.get("split.tensors.count")
    if expected is not None and int(expected) != len(tensors):
        raise ColibriError(f"{paths[0].name}: the split set should hold {expected} tensors but its "
                           f"{count} parts hold {len(tensors)}")
    return GGUFFiles(paths, first_meta, tensors)


def _split_parts(path: Path, count: int) -> list[Path]:
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ColibriError(f"{path.name}: a part of a {count}-part GGUF split must be named "
                           f"NAME-0000N-of-{count:05d}.gguf to find the other parts")
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in paths:
        if not p.is_file():
            raise ColibriError(f"{path.name} is part of a {count}-part GGUF split, but part {p.name} "
                               f"is missing from {p.parent}")
    return paths


class _Header:
    """A GGUF file's metadata and tensor table, read by _read_header: what _metadata and
    _tensor_refs take from gguf's GGUFReader, the same values."""

    def __init__(self, meta: dict, tensors: list):
        self.meta, self.tensors = meta, tensors


class _TensorInfo:
    def __init__(self, name, tensor_type, shape, n_bytes, data_offset):
        self.name, self.tensor_type, self.shape = name, tensor_type, shape
        self.n_bytes, self.data_offset = n_bytes, data_offset


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_header(path: Path) -> _Header | None:
    """The metadata and tensor table of a little-endian GGUF v2/v3 file, parsed here with
    struct: gguf's GGUFReader makes a numpy view of every value, ~250k of them for a 49k-token
    vocabulary (3.8 s of SmolLM2's first start against ~0.3 s). None for anything else it would
    not read the same way (another byte order or version, nested or empty arrays, a truncated
    or damaged file): GGUFReader then reads it, and says what is wrong."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            size = len(buf)

            def text(off, errors="replace"):  # (a key or tensor name: strict, as GGUFReader reads it)
                (n,) = struct.unpack_from("<Q", buf, off)
                if off + 8 + n > size:
                    raise ValueError
                return buf[off + 8:off + 8 + n].decode("utf-8", errors=errors), off + 8 + n

            def scalar(vtype, off):
                if vtype == _STRING:
                    return text(off)
                fmt = _SCALAR[vtype]
                (v,) = struct.unpack_from(fmt, buf, off)
                return (bool(v) if vtype == 7 else v), off + struct.calcsize(fmt)

            magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF" or version not in (2, 3):
                return None
            meta = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
            off = 24
            for _ in range(n_kv):
                key, off = text(off, "strict")
                (vtype,) = struct.unpack_from("<I", buf, off)
                off += 4
                if key in meta or key == "general.alignment" and vtype != 4:  # (GGUFReader: a uint32)
                    return None
                if vtype == _ARRAY:
                    itype, n = struct.unpack_from("<IQ", buf, off)
                    off += 12
                    if n == 0 or itype == _ARRAY:
                        return None
                    if itype == _STRING:
                        values = []
                        for _ in range(n):
                            v, off = text(off)
                            values.append(v)
                    else:
                        fmt = _SCALAR[itype]
                        w = struct.calcsize(fmt)
                        values = [v[0] for v in struct.iter_unpack(fmt, buf[off:off + w * n])]
                        if itype == 7:
                            values = [bool(v) for v in values]
                        off += w * n
                    meta[key] = values
                else:
                    meta[key], off = scalar(vtype, off)
            infos, names = [], set()
            for _ in range(n_tensors):
                name, off = text(off, "strict")
                (n_dims,) = struct.unpack_from("<I", buf, off)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
                off += 4 + 8 * n_dims
                raw_type, offset = struct.unpack_from("<IQ", buf, off)
                off += 12
                if name in names:
                    return None
                names.add(name)
                infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
            align = meta.get("general.alignment", 32)
            if not isinstance(align, int) or align <= 0 or align & (align - 1):
                return None
            start = off + (-off) % align
            tensors = []
            for name, dims, ggml_type, offset in infos:
                n_elems = 1
                for d in dims:
                    n_elems *= d
                block_size, type_size = GGML_QUANT_SIZES[ggml_type]
                n_bytes = n_elems * type_size // block_size
                if start + offset + n_bytes > size:
                    return None
                tensors.append(_TensorInfo(name, ggml_type, dims, n_bytes, start + offset))
            return _Header(meta, tensors)
    except (OSError, ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError):
        return None


def _open_reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise ColibriError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ColibriError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    header = _read_header(path)
    if header is not None:
        return header
    try:
        return GGUFReader(path)
    except Exception as exc:  # ValueError/KeyError/IndexError... wherever the bytes run out or go wrong
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise ColibriError(f"{path} is truncated or damaged; the GGUF reader stopped with: {why}") from None


def _metadata(reader) -> dict:
    if isinstance(reader, _Header):
        return dict(reader.meta)
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _field_value(field):
    """A GGUF metadata value as a Python scalar, string or list."""
    from gguf import GGUFValueType

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        return bool(value) if vtype == GGUFValueType.BOOL else value

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) < 2:  # array of arrays: not used by any key we read
            return None
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _tensor_refs(path: Path, reader) -> dict[str, TensorRef]:
    size = path.stat().st_size
    out = {}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ColibriError(f"{path.name}: tensor {t.name} ends at byte {end} but the file has {size} "
                               "bytes; the file is truncated")
        if type_name not in SCHEME_OF_TYPE:
            raise ColibriError(f"{path.name}: tensor {t.name} has GGUF type {type_name}, which colibri cannot "
                               f"import; supported: {', '.join(SUPPORTED_TYPES)}")
        ne = tuple(int(d) for d in t.shape)
        if type_name in BLOCK_TYPES_BY_GGUF and ne[0] % BLOCK_TYPES_BY_GGUF[type_name].elements:
            raise ColibriError(f"{path.name}: tensor {t.name} rows of {ne[0]} weights are not whole "
                               f"{type_name} blocks")
        out[t.name] = TensorRef(t.name, path, int(t.data_offset), type_name, ne, int(t.n_bytes))
    return out


BLOCK_TYPES_BY_GGUF = {bt.gguf_name: bt for bt in BLOCK_TYPES.values()}


def type_row_bytes(type_name: str, inputs: int) -> int:
    """Bytes of one row of `inputs` weights stored as GGUF type `type_name`."""
    if type_name in _FLOAT:
        return inputs * (4 if type_name == "F32" else 2)
    if type_name in _SPLIT_BLOCK:
        return inputs // 32 * _SPLIT_BLOCK[type_name][0]
    return row_bytes(SCHEME_OF_GGUF[type_name], inputs)


# ---------------------------------------------------------------- bytes -> colibri types

@functools.lru_cache(maxsize=256)
def _mapped(path: str, size: int, mtime_ns: int) -> np.memmap:
    return np.memmap(path, dtype=np.uint8, mode="r")


def mapped(path: Path) -> np.memmap:
    """The whole file, memory-mapped read-only (one map per file, shared)."""
    st = os.stat(path)
    return _mapped(str(path), st.st_size, st.st_mtime_ns)


def raw_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """uint8 view of `nbytes` bytes at absolute `offset` of the file (no copy)."""
    return mapped(path)[offset : offset + nbytes]


def matrix(raw: np.ndarray, type_name: str, rows: int, cols: int,
           rows_order: np.ndarray | None = None) -> QTensor:
    """A [rows, cols] matrix's GGUF bytes -> QTensor, losslessly (a view where the scheme keeps
    the file's bytes; split-scale schemes get their scales pulled out)."""
    data = raw.reshape(rows, type_row_bytes(type_name, cols))
    if rows_order is not None:
        data = data[rows_order]
    scheme = SCHEME_OF_TYPE[type_name]
    if type_name == "F32":
        return QTensor(scheme, (rows, cols), data.view(np.float32))
    if type_name == "F16":
        return QTensor(scheme, (rows, cols), data.view(np.float16))
    if type_name == "BF16":
        return QTensor(scheme, (rows, cols), data.view(np.uint16))
    if type_name not in _SPLIT_BLOCK:  # block schemes: the rows as the file holds them
        return QTensor(scheme, (rows, cols), data)
    block, header, payload = _SPLIT_BLOCK[type_name]
    blocks = data.reshape(rows, cols // 32, block)  # [O, G, bytes]
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0].astype(np.float32)
    mins = None
    if type_name == "Q4_1":
        mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[:, :, header:header + payload]).reshape(rows, cols // 32 * payload)
    if type_name == "Q8_0":
        q = q.view(np.int8)
    return QTensor(scheme, (rows, cols), q, d, mins)


def dequantized(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Any supported type's bytes -> float32 array of `shape` (numpy order), exactly the values
    the bytes stand for (gguf-py's dequantizer, which ggml_blocks' reference equals)."""
    if type_name == "F32":
        return np.array(raw.view(np.float32).reshape(shape))
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rb = type_row_bytes(type_name, shape[-1])
    return gguf.quants.dequantize(np.asarray(raw).reshape(-1, rb), qtype).astype(np.float32).reshape(shape)
