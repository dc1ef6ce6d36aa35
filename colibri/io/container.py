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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.io.safetensors_io import ALIGN, SafetensorsFile, write_safetensors
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
    """Builds a container directory; `finish` writes the manifest last, so a directory with a
    manifest is always complete."""

    def __init__(self, out_dir: str | os.PathLike, bits: int, source: str):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bits = bits
        self.source = source
        self.tensors: dict[str, dict] = {}
        self.dense_arrays: list[tuple[str, np.ndarray]] = []
        self.experts: dict[str, dict] = {}

    def add_dense(self, name: str, t: QTensor | np.ndarray) -> None:
        if isinstance(t, QTensor):
            self.tensors[name] = {"scheme": t.scheme, "shape": list(t.shape)}
            for part, arr in t.parts().items():
                self.dense_arrays.append((f"{name}.{part}", arr))
        else:
            arr = np.ascontiguousarray(t, dtype=np.float32)
            self.tensors[name] = {"scheme": "f32", "shape": list(arr.shape)}
            self.dense_arrays.append((f"{name}.q", arr))

    def add_expert_layer(self, prefix: str, layer: int, experts: list[dict[str, QTensor]]) -> None:
        """All routed experts of one MoE block, written to their own file at once."""
        blobs = []
        spec0 = None
        for e, projections in enumerate(experts):
            blob, spec = pack_expert(projections)
            if spec0 is None:
                spec0 = spec
            elif spec != spec0:
                raise ColibriError(f"{prefix}: expert {e} has a different shape or scheme from expert 0")
            blobs.append((f"{prefix}.experts.{e}", blob))
        fname = f"experts-{layer:03d}.safetensors"
        write_safetensors(self.dir / fname, blobs)
        self.experts[prefix] = {"file": fname, "num_experts": len(experts),
                                "blob_bytes": int(blobs[0][1].size), "projections": spec0}

    def finish(self, config: dict, extra_files: dict[str, str] | None = None) -> None:
        # Largest element size first keeps every array aligned to its own element size.
        self.dense_arrays.sort(key=lambda kv: -kv[1].dtype.itemsize)
        write_safetensors(self.dir / DENSE_FILE, self.dense_arrays, {"format": "colibri"})
        (self.dir / "config.json").write_text(json.dumps(config, indent=2))
        for fname, text in (extra_files or {}).items():
            (self.dir / fname).write_text(text)
        manifest = {"format": "colibri", "version": FORMAT_VERSION, "bits": self.bits,
                    "source": self.source, "model_type": config.get("model_type"),
                    "dense_file": DENSE_FILE, "tensors": self.tensors, "experts": self.experts}
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.dir / MANIFEST)
