"""The colibri model container (DESIGN.md section 3): a Hugging Face-shaped directory.

    config.json, tokenizer.json, tokenizer_config.json, generation_config.json  (HF files)
    colibri.json            manifest: scheme and shape of every tensor, expert blob layouts
    dense.safetensors       resident tensors; a quantized tensor NAME is stored as the parts
                            NAME.q, NAME.scales (, NAME.mins); a float tensor as NAME.q
    experts-LLL.safetensors one uint8 blob per routed expert of layer LLL, each blob a
                            contiguous, 4096-aligned range holding gate_proj, up_proj and
                            down_proj with their scales: one pread fetches one expert.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.io.safetensors_io import ALIGN, SafetensorsFile, safetensors_header
from colibri.kernels.quant import QTensor

MANIFEST = "colibri.json"
DENSE_FILE = "dense.safetensors"
FORMAT_VERSION = 1
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
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

    def unpack(self, blob: np.ndarray) -> dict[str, QTensor]:
        """Views into one expert's blob (uint8 [blob_bytes]) -> {projection: QTensor}; no copy."""
        out = {}
        for proj, spec in self.projections.items():
            arrays = {}
            for part, (off, dtype, shape) in spec["parts"].items():
                n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                arrays[part] = blob[off : off + n].view(dtype).reshape(shape)
            out[proj] = QTensor(spec["scheme"], tuple(spec["shape"]), arrays["q"],
                                arrays.get("scales"), arrays.get("mins"))
        return out


def pack_expert(projections: dict[str, QTensor]) -> tuple[np.ndarray, dict]:
    """{projection: QTensor} -> (uint8 blob padded to a multiple of 4096, layout spec)."""
    spec: dict = {}
    pos = 0
    pieces = []
    for proj in EXPERT_PROJECTIONS:
        t = projections[proj]
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
        try:
            self.manifest = json.loads(manifest_path.read_text())
            self.config = json.loads((self.dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ColibriError(f"{self.dir}: cannot read its manifest or config.json ({e})") from None
        if self.manifest.get("version") != FORMAT_VERSION:
            raise ColibriError(f"{self.dir}: container version {self.manifest.get('version')} is not "
                               f"supported (expected {FORMAT_VERSION}); re-convert the model")
        self.dense = SafetensorsFile(self.dir / self.manifest["dense_file"])
        self.expert_layouts = {
            prefix: ExpertLayout(spec["file"], spec["num_experts"], spec["blob_bytes"], spec["projections"])
            for prefix, spec in self.manifest.get("experts", {}).items()
        }
        self._expert_files: dict[str, SafetensorsFile] = {}
        missing = [n for n in self.manifest["tensors"] if f"{n}.q" not in self.dense.tensors]
        if missing:
            raise ColibriError(f"{self.dir}: {len(missing)} tensors of the manifest are missing from "
                               f"{self.manifest['dense_file']} (first: {missing[0]}); re-convert the model")

    @property
    def dense_bytes(self) -> int:
        return sum(t.nbytes for t in self.dense.tensors.values())

    @property
    def expert_bytes(self) -> int:
        return sum(l.blob_bytes * l.num_experts for l in self.expert_layouts.values())

    def has(self, name: str) -> bool:
        return name in self.manifest["tensors"]

    def tensor(self, name: str) -> QTensor | np.ndarray:
        """A dense tensor copied into RAM: 2-D -> QTensor, 1-D -> float32 array."""
        spec = self.manifest["tensors"].get(name)
        if spec is None:
            raise ColibriError(f"{self.dir}: tensor {name} is missing; the container does not match its config")
        parts = {p: self.dense.read(f"{name}.{p}") for p in ("q", "scales", "mins")
                 if f"{name}.{p}" in self.dense.tensors}
        if len(spec["shape"]) == 1:
            return parts["q"].astype(np.float32)
        return QTensor(spec["scheme"], tuple(spec["shape"]), parts["q"], parts.get("scales"), parts.get("mins"))

    def expert_file(self, prefix: str) -> SafetensorsFile:
        layout = self.expert_layouts[prefix]
        if layout.file not in self._expert_files:
            self._expert_files[layout.file] = SafetensorsFile(self.dir / layout.file)
        return self._expert_files[layout.file]

    def expert_range(self, prefix: str, expert: int) -> tuple[Path, int, int]:
        """(file path, absolute byte offset, byte count) of one expert's blob: one pread."""
        f = self.expert_file(prefix)
        info = f.tensors[f"{prefix}.experts.{expert}"]
        return f.path, info.offset, info.nbytes


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

    def add_dense(self, name: str, t: QTensor | np.ndarray) -> None:
        if isinstance(t, QTensor):
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
            self.experts[prefix] = {"file": fname, "num_experts": num_experts, "blob_bytes": int(blob.size),
                                    "projections": spec}
        elif spec != self.experts[prefix]["projections"]:
            raise ColibriError(f"{prefix}: expert {expert} has a different shape or scheme from the others")
        if not 0 <= expert < num_experts:
            raise ColibriError(f"{prefix}: expert index {expert} is outside 0..{num_experts - 1}")
        fd, offsets = self._expert_files[prefix]
        os.pwrite(fd, memoryview(blob), offsets[expert])
        self._written[prefix].add(expert)

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
