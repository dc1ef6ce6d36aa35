"""The colibri model container (docs/design.md section 3): a Hugging Face-shaped directory.

    config.json, tokenizer.json, tokenizer_config.json, generation_config.json  (HF files)
    colibri.json            manifest: scheme and shape of every tensor, expert blob layouts
    dense.safetensors       resident tensors; a quantized tensor NAME is stored as the parts
                            NAME.q, NAME.scales (, NAME.mins); a float tensor as NAME.q
    experts-LLL.safetensors one uint8 blob per routed expert of layer LLL, each blob a
                            contiguous, 4096-aligned range holding gate_proj, up_proj and
                            down_proj with their scales: one pread fetches one expert.

The manifest records a checksum of every expert blob (`checksum`: the algorithm, `digests`: one
hex digest per expert), written by ContainerWriter, the one place every writer goes through;
the expert readers verify it when they read a blob from disk. Containers written before
checksums existed have none and are read unverified.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError, EngineFault
from colibri.io.safetensors_io import ALIGN, SafetensorsFile, safetensors_header
from colibri.formats.expert_blob import PROJECTIONS
from colibri.formats.qtensor import SCHEMES, QTensor, interleave_width_of, interleaved, row_major
from colibri.memory import WEIGHTS
from colibri.io.manifest import (  # noqa: F401  (re-exported: the container's names)
    CHECKSUM,
    CHECKSUMS,
    FORMAT_VERSION,
    MANIFEST,
    Digest,
    ExpertRange,
    checksum,
)

DENSE_FILE = "dense.safetensors"
EXPERT_PROJECTIONS = PROJECTIONS  # (the fused kernel's order, colibri/formats/expert_blob.py)
_PART_ALIGN = 64  # byte alignment of each array inside an expert blob (cache lines, SIMD loads)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ExpertLayout:
    """Where each array of one expert lives inside its blob (the same for every expert of a layer)."""

    file: str
    num_experts: int
    blob_bytes: int
    # projection -> {"scheme", "shape", "parts": {part: [offset, dtype, shape]}}
    projections: dict
    checksum: str | None = None          # algorithm of `digests`; None: written before checksums
    digests: tuple[str, ...] | None = None  # one hex digest per expert blob

    def unpack(self, blob: np.ndarray, interleaved: bool = False) -> dict[str, QTensor]:
        """Views into one expert's blob (uint8 [blob_bytes]) -> {projection: QTensor}; no copy.
        interleaved: its rows were interleaved (interleave())."""
        out = {}
        for proj, spec in self.projections.items():
            arrays = {}
            for part, (off, dtype, shape) in spec["parts"].items():
                n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                arrays[part] = blob[off : off + n].view(dtype).reshape(shape)
            width = interleave_width_of(spec["scheme"], spec["shape"]) if interleaved else 1
            out[proj] = QTensor(spec["scheme"], tuple(spec["shape"]), arrays["q"],
                                arrays.get("scales"), arrays.get("mins"), width)
        return out

    def interleave(self, blob: np.ndarray) -> None:
        """Rewrite a blob as read from disk with its rows interleaved for the CPU kernels
        (formats/qtensor.py, Layout), in place: unpack(blob, interleaved=True) then reads it. After the
        checksum: the file holds the stored layout."""
        for t in self.unpack(blob).values():
            interleaved(t, in_place=True)


def pack_expert(projections: dict[str, QTensor]) -> tuple[np.ndarray, dict]:
    """{projection: QTensor} -> (uint8 blob padded to a multiple of 4096, layout spec); rows
    row-major, as files hold them."""
    spec: dict = {}
    pos = 0
    pieces = []
    for proj in EXPERT_PROJECTIONS:
        t = row_major(projections[proj])
        parts = {}
        for part, arr in t.parts().items():
            pos = _round_up(pos, _PART_ALIGN)
            parts[part] = [pos, arr.dtype.str, list(arr.shape)]
            pieces.append((pos, np.ascontiguousarray(arr).view(np.uint8).reshape(-1)))
            pos += arr.nbytes
        spec[proj] = {"scheme": t.scheme, "shape": list(t.shape), "parts": parts}
    blob = np.zeros(_round_up(pos, ALIGN), dtype=np.uint8)
    for off, b in pieces:
        blob[off : off + b.size] = b
    return blob, spec


class Container:
    """Read access to a converted model directory."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise ColibriError(f"model directory {self.dir} does not exist")
        manifest_path = self.dir / MANIFEST
        if not manifest_path.exists():
            hint = " (it looks like a Hugging Face checkpoint: run `colibri convert` on it first)" \
                if (self.dir / "config.json").exists() else ""
            raise ColibriError(f"{self.dir} is not a colibri model directory: no {MANIFEST}{hint}")
        self.manifest = _read_object(manifest_path, f"{self.dir}: its manifest {MANIFEST}")
        self.config = _read_object(self.dir / "config.json", f"{self.dir}: its config.json")
        self.on_read: Callable[[int], None] | None = None  # told the bytes of each dense tensor read (progress)
        # int4 and q8_0 matrices as read: their rows interleaved for the CPU kernels (formats/qtensor.py,
        # Layout), or row-major as stored (EngineConfig.weight_layout "rows": for comparisons).
        self.interleave_rows = True
        if self.manifest.get("version") != FORMAT_VERSION:
            raise ColibriError(f"{self.dir}: container version {self.manifest.get('version')} is not "
                               f"supported (expected {FORMAT_VERSION}); re-convert the model")
        if not isinstance(self.config.get("model_type"), str):
            raise ColibriError(f"{self.dir}/config.json names no model_type; restore the file or re-convert the model")
        # A model linked to a GGUF file (colibri/io/gguf_link.py): its tensors and experts are
        # read from the user's file itself; this directory holds only the index.
        self.gguf = None
        if self.manifest.get("kind") == "gguf-link":
            from colibri.io.gguf_link import GGUFLink

            self.gguf = GGUFLink(self.dir, self.manifest)
        else:
            _check_manifest(self.dir, self.manifest)
        self.dense = None if self.gguf else SafetensorsFile(self.dir / self.manifest["dense_file"])
        self.expert_layouts = {prefix: _layout(self.dir, prefix, spec)
                               for prefix, spec in self.manifest.get("experts", {}).items()}
        self._expert_files: dict[str, SafetensorsFile] = {}
        self._checked_prefixes: set[str] = set()
        missing = [] if self.gguf else [n for n in self.manifest["tensors"] if f"{n}.q" not in self.dense.tensors]
        if missing:
            raise ColibriError(f"{self.dir}: {len(missing)} tensors of the manifest are missing from "
                               f"{self.manifest['dense_file']} (first: {missing[0]}); re-convert the model")

    @property
    def dense_bytes(self) -> int:
        if self.gguf:
            return self.gguf.dense_bytes
        return sum(t.nbytes for t in self.dense.tensors.values())

    @property
    def expert_bytes(self) -> int:
        return sum(l.blob_bytes * l.num_experts for l in self.expert_layouts.values())

    def tensor_bytes(self, name: str) -> int:
        """Bytes dense tensor `name` takes in RAM once loaded (0 when there is none)."""
        spec = self.manifest["tensors"].get(name)
        if spec is None:
            return 0
        if self.gguf:
            return self.gguf.tensor_bytes(name)
        return sum(self.dense.tensors[f"{name}.{p}"].nbytes for p in ("q", "scales", "mins")
                   if f"{name}.{p}" in self.dense.tensors)

    def has(self, name: str) -> bool:
        return name in self.manifest["tensors"]

    def tensor(self, name: str) -> QTensor | np.ndarray:
        """A dense tensor copied into RAM: 2-D -> QTensor (int4 and q8_0 rows interleaved in place
        unless interleave_rows is off), 1-D -> float32 array."""
        spec = self.manifest["tensors"].get(name)
        if spec is None:
            raise ColibriError(f"{self.dir}: tensor {name} is missing; the container does not match its config")
        if self.gguf:
            parts = self.gguf.tensor_parts(name, WEIGHTS.copy)
        else:
            parts = {p: self.dense.read(f"{name}.{p}", WEIGHTS.empty) for p in ("q", "scales", "mins")
                     if f"{name}.{p}" in self.dense.tensors}
        if self.on_read is not None:
            self.on_read(sum(a.nbytes for a in parts.values()))
        if len(spec["shape"]) == 1:
            return parts["q"].astype(np.float32)
        t = QTensor(spec["scheme"], tuple(spec["shape"]), parts["q"], parts.get("scales"), parts.get("mins"))
        return interleaved(t, in_place=True) if self.interleave_rows else t

    @property
    def has_checksums(self) -> bool:
        return any(l.digests is not None for l in self.expert_layouts.values())

    def expert_file(self, prefix: str) -> SafetensorsFile:
        if self.gguf:
            raise ColibriError(f"{self.dir}: the experts of {prefix} are read from a GGUF file, not a "
                               "container file (use expert_ranges)")
        layout = self.expert_layouts[prefix]
        if layout.file not in self._expert_files:
            self._expert_files[layout.file] = SafetensorsFile(self.dir / layout.file)
        f = self._expert_files[layout.file]
        if prefix not in self._checked_prefixes:
            _check_expert_file(f, prefix, layout)
            self._checked_prefixes.add(prefix)
        return f

    def expert_range(self, prefix: str, expert: int) -> tuple[Path, int, int]:
        """(file path, absolute byte offset, byte count) of one expert's blob: one pread."""
        f = self.expert_file(prefix)
        info = f.tensors[f"{prefix}.experts.{expert}"]
        return f.path, info.offset, info.nbytes

    def expert_ranges(self, prefix: str, expert: int) -> list[ExpertRange]:
        """Where expert `expert` of `prefix` lies on disk: one range (its blob) in a container,
        one per projection in a model linked to a GGUF."""
        if self.gguf:
            return self.gguf.expert_ranges(prefix, expert)
        path, offset, nbytes = self.expert_range(prefix, expert)
        return [ExpertRange(path, offset, nbytes)]

    def expert_paths(self, prefix: str) -> list[Path]:
        """The files the experts of `prefix` are read from."""
        return sorted({r.path for r in self.expert_ranges(prefix, 0)})

    def new_digest(self, prefix: str) -> Digest | None:
        """A checksum to feed an expert's bytes as read from disk (check_digest checks it);
        None when the model records none."""
        layout = self.expert_layouts[prefix]
        return None if layout.digests is None else Digest(layout.checksum)

    def check_digest(self, prefix: str, expert: int, digest: Digest, blob: np.ndarray) -> None:
        """Raise EngineFault when an expert's bytes, as read, do not match the recorded checksum."""
        got, want = digest.hexdigest(), self.expert_layouts[prefix].digests[expert]
        if got != want:
            where = self.gguf.describe(prefix) if self.gguf else self.dir / self.expert_layouts[prefix].file
            raise EngineFault(f"expert {expert} of {prefix} in {where} failed its checksum "
                              f"({digest.algorithm} {got} != {want}): the file is damaged; "
                              + ("restore it (the index is rebuilt when the file changes)" if self.gguf
                                 else "re-convert or restore it"))

    def verify_expert(self, prefix: str, expert: int, blob: np.ndarray) -> None:
        """Raise EngineFault when `blob` (the expert's bytes as read from disk) does not match the
        checksum the manifest records; no-op for a container written without checksums."""
        layout = self.expert_layouts[prefix]
        if layout.digests is None:
            return
        got, want = checksum(blob, layout.checksum), layout.digests[expert]
        if got != want:
            raise EngineFault(f"expert {expert} of {prefix} in {self.dir / layout.file} failed its checksum "
                              f"({layout.checksum} {got} != {want}): the file is damaged; re-convert or restore it")


def _read_object(path: Path, what: str) -> dict:
    """A JSON file that must hold an object; anything else is a one-line ColibriError."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ColibriError(f"{what} cannot be read as JSON ({' '.join(str(e).split())}); "
                           "restore the file or re-convert the model") from None
    if not isinstance(data, dict):
        raise ColibriError(f"{what} holds a JSON {type(data).__name__}, not an object; "
                           "restore the file or re-convert the model")
    return data


def _malformed(model_dir: Path, what: str) -> ColibriError:
    return ColibriError(f"{model_dir}: its manifest {MANIFEST} is malformed ({what}); re-convert the model")


def _check_manifest(model_dir: Path, m: dict) -> None:
    """The manifest fields the loader relies on have the right types (checked once at load, so a
    damaged manifest is a one-line error at start, not a TypeError in the middle of a request)."""
    if not isinstance(m.get("dense_file"), str):
        raise _malformed(model_dir, "dense_file is not a file name")
    if not isinstance(m.get("tensors"), dict):
        raise _malformed(model_dir, "tensors is not an object")
    for name, spec in m["tensors"].items():
        if not (isinstance(spec, dict) and spec.get("scheme") in SCHEMES and _is_shape(spec.get("shape"))):
            raise _malformed(model_dir, f"tensor {name} has no valid scheme and shape")
    if not isinstance(m.get("experts", {}), dict):
        raise _malformed(model_dir, "experts is not an object")


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)


def _layout(model_dir: Path, prefix: str, spec) -> ExpertLayout:
    """One MoE layer's manifest entry -> ExpertLayout, every field checked."""
    if not isinstance(spec, dict):
        raise _malformed(model_dir, f"experts of {prefix} is not an object")
    n, size, projections = spec.get("num_experts"), spec.get("blob_bytes"), spec.get("projections")
    if not (isinstance(spec.get("file"), str) and isinstance(n, int) and n > 0
            and isinstance(size, int) and size > 0 and isinstance(projections, dict)):
        raise _malformed(model_dir, f"experts of {prefix} lack file, num_experts, blob_bytes or projections")
    for proj in EXPERT_PROJECTIONS:
        if not _projection_fits(projections.get(proj), size):
            raise _malformed(model_dir, f"{proj} of the experts of {prefix} does not fit its {size}-byte blob")
    algorithm, digests = spec.get("checksum"), spec.get("digests")
    if digests is None:
        return ExpertLayout(spec["file"], n, size, projections)
    if algorithm not in CHECKSUMS:
        raise ColibriError(f"{model_dir}: the experts of {prefix} carry {algorithm!r} checksums, which this "
                           f"colibri cannot check (it knows {', '.join(CHECKSUMS)}); upgrade colibri")
    if algorithm == "xxh3_64":
        try:
            import xxhash  # noqa: F401  (missing after a --no-deps install: say so at start)
        except ImportError:
            raise ColibriError("checking this model's expert checksums needs the xxhash package: "
                               "pip install xxhash") from None
    if not (isinstance(digests, list) and len(digests) == n and all(isinstance(d, str) for d in digests)):
        raise _malformed(model_dir, f"experts of {prefix} do not have one digest per expert")
    return ExpertLayout(spec["file"], n, size, projections, algorithm, tuple(digests))


def _projection_fits(spec, blob_bytes: int) -> bool:
    """A projection's parts are [offset, dtype, shape] ranges that lie inside the blob."""
    if not (isinstance(spec, dict) and spec.get("scheme") in SCHEMES and _is_shape(spec.get("shape"))
            and isinstance(spec.get("parts"), dict) and "q" in spec["parts"]):
        return False
    for part in spec["parts"].values():
        try:
            off, dtype, shape = part
            end = off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            return False
        if not (isinstance(off, int) and _is_shape(shape) and 0 <= off <= end <= blob_bytes):
            return False
    return True


def _check_expert_file(f: SafetensorsFile, prefix: str, layout: ExpertLayout) -> None:
    """The layer's file holds one blob of the manifest's size per expert (else a pread would read
    the wrong bytes or too few)."""
    for e in range(layout.num_experts):
        info = f.tensors.get(f"{prefix}.experts.{e}")
        if info is None or info.nbytes != layout.blob_bytes:
            found = "is missing" if info is None else f"has {info.nbytes} bytes, not {layout.blob_bytes}"
            raise ColibriError(f"{f.path}: expert {e} of {prefix} {found}; the file does not match the "
                               "manifest: re-convert the model")


class ContainerWriter:
    """Builds a container directory in bounded memory: each routed expert is written into its
    layer's file as soon as it is complete, dense tensors are spooled to disk as they come, and
    `finish` writes the manifest last, so a directory with a manifest is always complete."""

    def __init__(self, out_dir: str | os.PathLike, bits: int, source: str):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bits = bits
        self.source = source
        self.tensors: dict[str, dict] = {}
        self.experts: dict[str, dict] = {}
        # Dense arrays are spooled into one scratch file per element size; `finish` lays them
        # out largest element first, which keeps every array aligned to its own element size.
        self._spool: dict[int, tuple] = {}           # itemsize -> (file, [(name, dtype, shape)])
        self._expert_files: dict[str, tuple] = {}    # prefix -> (fd, absolute offset of each expert)
        self._written: dict[str, set[int]] = {}
        self._digests: dict[str, list] = {}          # prefix -> checksum of each expert blob

    def add_dense(self, name: str, t: QTensor | np.ndarray) -> None:
        if isinstance(t, QTensor):
            t = row_major(t)  # files hold rows as stored; interleaving is the reader's (formats/qtensor.py, Layout)
            self.tensors[name] = {"scheme": t.scheme, "shape": list(t.shape)}
            parts = t.parts()
        else:
            arr = np.ascontiguousarray(t, dtype=np.float32)
            self.tensors[name] = {"scheme": "f32", "shape": list(arr.shape)}
            parts = {"q": arr}
        for part, arr in parts.items():
            arr = np.ascontiguousarray(arr)
            size = arr.dtype.itemsize
            if size not in self._spool:
                self._spool[size] = (tempfile.TemporaryFile(dir=self.dir), [])
            f, entries = self._spool[size]
            f.write(memoryview(arr).cast("B"))
            entries.append((f"{name}.{part}", arr.dtype, arr.shape))

    def add_expert(self, prefix: str, layer: int, expert: int, num_experts: int,
                   projections: dict[str, QTensor]) -> None:
        """One routed expert, written at its final place in the layer's file right away."""
        blob, spec = pack_expert(projections)
        if prefix not in self._expert_files:
            fname = f"experts-{layer:03d}.safetensors"
            names = [f"{prefix}.experts.{e}" for e in range(num_experts)]
            head, offsets = safetensors_header([(n, np.uint8, (blob.size,)) for n in names])
            fd = os.open(self.dir / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, head, 0)
            os.ftruncate(fd, len(head) + num_experts * blob.size)
            self._expert_files[prefix] = (fd, [offsets[n] for n in names])
            self._written[prefix] = set()
            self._digests[prefix] = [None] * num_experts
            self.experts[prefix] = {"file": fname, "num_experts": num_experts, "blob_bytes": int(blob.size),
                                    "projections": spec}
        elif spec != self.experts[prefix]["projections"]:
            raise ColibriError(f"{prefix}: expert {expert} has a different shape or scheme from the others")
        if not 0 <= expert < num_experts:
            raise ColibriError(f"{prefix}: expert index {expert} is outside 0..{num_experts - 1}")
        fd, offsets = self._expert_files[prefix]
        os.pwrite(fd, memoryview(blob), offsets[expert])
        self._written[prefix].add(expert)
        # Of the blob as written, padding included: the readers hash the whole range they read.
        self._digests[prefix][expert] = checksum(blob)

    def add_expert_layer(self, prefix: str, layer: int, experts: list[dict[str, QTensor]]) -> None:
        """All routed experts of one MoE block at once."""
        for e, projections in enumerate(experts):
            self.add_expert(prefix, layer, e, len(experts), projections)

    def finish(self, config: dict, extra_files: dict[str, str] | None = None) -> None:
        for prefix, (fd, _) in self._expert_files.items():
            missing = self.experts[prefix]["num_experts"] - len(self._written[prefix])
            if missing:
                raise ColibriError(f"{prefix}: {missing} routed experts never appeared in the checkpoint")
            os.fsync(fd)
            os.close(fd)
            self.experts[prefix].update(checksum=CHECKSUM, digests=self._digests[prefix])
        self._expert_files.clear()
        self._write_dense()
        (self.dir / "config.json").write_text(json.dumps(config, indent=2))
        for fname, text in (extra_files or {}).items():
            (self.dir / fname).write_text(text)
        manifest = {"format": "colibri", "version": FORMAT_VERSION, "bits": self.bits,
                    "source": self.source, "model_type": config.get("model_type"),
                    "dense_file": DENSE_FILE, "tensors": self.tensors, "experts": self.experts}
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.dir / MANIFEST)

    def _write_dense(self) -> None:
        sizes = sorted(self._spool, reverse=True)
        entries = [e for size in sizes for e in self._spool[size][1]]
        head, _ = safetensors_header(entries, {"format": "colibri"})
        tmp = self.dir / (DENSE_FILE + ".tmp")
        with open(tmp, "wb") as out:
            out.write(head)
            for size in sizes:
                f = self._spool[size][0]
                f.seek(0)
                shutil.copyfileobj(f, out, 16 << 20)
                f.close()
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.dir / DENSE_FILE)
        self._spool.clear()
