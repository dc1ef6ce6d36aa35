"""`colibri convert`: Hugging Face checkpoints (safetensors f32/bf16/f16) and GGUF files ->
colibri containers (container.py).

Quantization rule at --bits 4 (one rule, so a conversion is reproducible anywhere):
embeddings and lm_head (and an MTP layer's shared_head.head) int8 g32 (q8_0); routers and gates
(`mlp.gate`, `shared_expert_gate`, gpt-oss's `mlp.router`), the sparse-attention indexer (`indexer.*`), norms, biases
and routing biases (`e_score_correction_bias`) f32; every other matrix int4 g64 along its input
dimension when that is a multiple of 64, else f32. --bits 8: matrices q8_0. --bits 32:
everything f32 (the exact path).

FP8 checkpoints (float8_e4m3fn + 128x128 `weight_scale_inv`, io/fp8.py) are dequantized tensor
by tensor and quantized straight away. Every matrix is read in slabs and dequantized and
quantized a few rows at a time (`_quantized`), so peak memory is the largest tensor's quantized
bytes (DeepSeek-V3: embed_tokens at q8_0, 1.04 GB) plus a slab, not its float32 copy and the
quantizer's temporaries. MTP layers (index >= num_hidden_layers)
are converted like any other layer: kept for speculative decoding, unused by the forward.
Qwen3-Next and Qwen3.5 / 3.6 keep theirs as a top-level block (`mtp.fc`, `mtp.norm`,
`mtp.layers.0.*`, ...): it is written as decoder layer num_hidden_layers + k (`container_name`).

compressed-tensors int4 checkpoints (Kimi-K2.5's routed experts, io/compressed_tensors.py) are
GGUF Q4_0 value for value: at --bits 4 and 8 those weights are repacked as q4_0, no rounding (8
bits could hold no more than they have); at --bits 32 they are dequantized exactly. A
multimodal wrapper (model_types.WRAPPERS: Kimi-K2.5) gives its language model's config and
weights; its vision tower and projector are skipped, with one line saying so.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from colibri.errors import ColibriError
from colibri.io import compressed_tensors, fp8, gpt_oss_experts
from colibri.model_types import WRAPPERS, checkpoint_name, language_model_config, module_name, skipped_part
from colibri.io.container import EXPERT_PROJECTIONS, ContainerWriter
from colibri.io.safetensors_io import SafetensorsFile
from colibri.formats.qtensor import QTensor, dequantize, quantize

BITS = (4, 8, 32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")

# A routed expert's matrix, named as the shared decoder names it (checkpoint_name: a family's own
# names, such as Mixtral's w1/w3/w2, are renamed first; colibri/model_types.py).
_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"\.(gate|shared_expert_gate|router)\.weight$")
_EMBEDDING = re.compile(r"(embed_tokens|lm_head|shared_head\.head)\.weight$")
_INDEXER = re.compile(r"\.indexer\.")  # DSA lightning indexer: selects tokens, kept exact like routers
# DeepSeek V4's small parameters that are not matrices applied to activations (hyper-connection
# mixing, compressor position biases, the hash router's token -> expert table): kept exact.
_EXACT = re.compile(r"(\.(attn_hc|ffn_hc)\.fn|\.hc_head\.hc_fn|\.position_bias|\.tid2eid)$")
_LAYER = re.compile(r"layers\.(\d+)\.")
# The families whose checkpoints hold their MTP block at the top level, `mtp.` (its own tensors,
# then layers.k): written where DeepSeek's MTP layer sits, as model.layers.{num_hidden_layers + k}
# (models/mtp.py reads it there), so its experts get a file of their own (experts-LLL is by layer
# number: layers.0 would overwrite the first decoder layer's) and readers count it past the
# decoder layers.
_TOP_LEVEL_MTP_FAMILIES = ("qwen3_next", "qwen3_5_moe")
_TOP_LEVEL_MTP = re.compile(r"^mtp\.(?:layers\.(?P<k>\d+)\.)?")
_SKIP = re.compile(r"rotary_emb\.inv_freq$")
_CHUNK_ELEMENTS = 1 << 16  # rows quantized at a time: 256 KiB of float32, temporaries stay in cache


def scheme_for(name: str, shape: tuple[int, ...], bits: int) -> str:
    """The quantization scheme the --bits rule assigns to one tensor."""
    if len(shape) != 2 or bits == 32:
        return "f32"
    cols = shape[1]
    if _EMBEDDING.search(name):
        return "q8_0" if cols % 32 == 0 else "f32"
    if _ROUTER.search(name) or _INDEXER.search(name) or _EXACT.search(name):
        return "f32"
    if bits == 4:
        return "int4_g64" if cols % 64 == 0 else "f32"
    return "q8_0" if cols % 32 == 0 else "f32"


def container_name(model_type: str | None, config: dict, name: str) -> str:
    """The container's name for tensor `name` of a checkpoint of `model_type` whose language
    model's config is `config`: the shared decoder's name (model_types.checkpoint_name), with a
    top-level MTP block moved past the decoder layers (_TOP_LEVEL_MTP_FAMILIES)."""
    name = checkpoint_name(model_type, name)
    m = _TOP_LEVEL_MTP.match(name)
    if m is None or module_name(config.get("model_type")) not in _TOP_LEVEL_MTP_FAMILIES:
        return name
    return f"model.layers.{int(config['num_hidden_layers']) + int(m['k'] or 0)}.{name[m.end():]}"


def convert(src: str | Path, dst: str | Path, bits: int = 4, progress: bool = True) -> Path:
    """Convert SRC (HF checkpoint directory or .gguf file) into the container directory DST.

    Written into a temporary sibling directory and renamed at the end, so an interrupted
    conversion never leaves a half-written container under DST.
    """
    src, dst = Path(src), Path(dst)
    if bits not in BITS:
        raise ColibriError(f"--bits must be one of {', '.join(map(str, BITS))}, not {bits}")
    if not src.exists():
        raise ColibriError(f"{src} does not exist")
    if dst.exists() and any(dst.iterdir()):
        raise ColibriError(f"{dst} already exists and is not empty; choose a new output directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is an ordinary one
    try:
        if src.is_file():
            if src.suffix != ".gguf":
                raise ColibriError(f"{src}: expected a .gguf file or a Hugging Face checkpoint directory")
            _convert_gguf(src, tmp, progress)
        else:
            _convert_hf(src, tmp, bits, progress)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), disable=not enabled, transient=False)


def _num_experts(config: dict) -> int | None:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return None


def _convert_hf(src: Path, out: Path, bits: int, progress: bool) -> None:
    try:
        config = json.loads((src / "config.json").read_text())
    except FileNotFoundError:
        raise ColibriError(f"{src} has no config.json; is it a Hugging Face checkpoint directory?") from None
    except ValueError as e:
        raise ColibriError(f"{src}/config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ColibriError(f"{src}/config.json holds a JSON {type(config).__name__}, not an object; "
                           "is it a Hugging Face checkpoint directory?")
    model_type = config.get("model_type")  # the checkpoint's: its tensor names follow it
    wrapped = model_type in WRAPPERS
    config = language_model_config(config)
    module_name(config.get("model_type"))  # unknown model_type: fail before reading any weights
    # unsupported quantization_config: fail early too (compressed-tensors int4 and gpt-oss's MXFP4
    # experts are repacked as they are: io/compressed_tensors.py, io/gpt_oss_experts.py)
    packed = compressed_tensors.pack_quantized(config)
    block = None if packed or gpt_oss_experts.is_mxfp4(config) else fp8.block_size(config)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ColibriError(f"{src} holds no .safetensors files")
    files = [SafetensorsFile(p) for p in shards]
    reader = fp8.CheckpointReader(files, block)
    names = [(f, n) for f in files for n in f.keys() if not _SKIP.search(n) and not reader.is_scale(n)
             and not (packed and compressed_tensors.is_side_tensor(n))]
    if wrapped:
        names = _skip_wrapper_parts(names, model_type)
    side = {n: f for f in files for n in f.keys() if packed and compressed_tensors.is_side_tensor(n)}
    shard_of = {n: f for f, n in names}
    n_experts = _num_experts(config)
    writer = ContainerWriter(out, bits, source=str(src))
    pending: dict[str, dict[int, dict[str, QTensor]]] = defaultdict(lambda: defaultdict(dict))

    def add_expert(prefix: str, e: int, proj: str, w: np.ndarray | QTensor) -> None:
        # An expert is written as soon as its three matrices are in: memory holds only the
        # experts whose matrices straddle shards, never a whole layer.
        if isinstance(w, np.ndarray):
            w = quantize(w, scheme_for(f"{prefix}.{proj}", w.shape, bits))
        pending[prefix][e][proj] = w
        if len(pending[prefix][e]) == len(EXPERT_PROJECTIONS):
            if not n_experts:
                raise ColibriError(f"{prefix}: routed experts found but config.json names no expert count "
                                   "(num_local_experts / num_experts / n_routed_experts)")
            m = _LAYER.search(prefix + ".")
            writer.add_expert(prefix, int(m.group(1)) if m else 0, e, n_experts, pending[prefix].pop(e))

    with _progress(progress) as bar:
        task = bar.add_task(f"converting {src.name} (--bits {bits})", total=len(names))
        for f, name in names:
            shape = reader.shape(f, name)
            target = container_name(model_type, config, name)  # the container holds the decoder's names
            if packed and name.endswith(compressed_tensors.PACKED):
                target = container_name(model_type, config, compressed_tensors.weight_name(name))
                w = _int4_weight(f, name, side, bits)
                if m := _EXPERT.match(target):
                    add_expert(m["prefix"], int(m["e"]), m["proj"], w)
                else:
                    writer.add_dense(target, w)
            elif (m := _EXPERT.match(target)) and reader.is_fp4(f, name):  # DeepSeek V4: kept as MXFP4 (lossless)
                add_expert(m["prefix"], int(m["e"]), m["proj"],
                           gpt_oss_experts.mxfp4_matrix(*reader.fp4_parts(f, name)))
            elif m := _EXPERT.match(target):
                proj = m["proj"]
                add_expert(m["prefix"], int(m["e"]), proj,
                           _quantized(reader, f, name, scheme_for(f"{m['prefix']}.{proj}", shape, bits)))
            elif model_type == "gpt_oss" and (m := gpt_oss_experts.EXPERT_TENSOR.match(target)):
                prefix, proj, part = m["prefix"], m["proj"], m["part"]
                if part == "_bias":
                    for bias_name, b in gpt_oss_experts.split_bias(prefix, proj, reader.float32(f, name)).items():
                        writer.add_dense(bias_name, b)
                elif part == "_blocks":  # MXFP4, kept as MXFP4 whatever --bits says (lossless)
                    scales_name = f"{prefix}.experts.{proj}_scales"
                    if scales_name not in shard_of:
                        raise ColibriError(f"{name} has no {scales_name} in any shard")
                    for e, p, w in gpt_oss_experts.split_mxfp4(proj, f.read(name),
                                                               shard_of[scales_name].read(scales_name)):
                        add_expert(prefix, e, p, w)
                elif part == "":  # float experts [E, D, 2I] / [E, I, D], gate/up interleaved
                    for e, p, w in gpt_oss_experts.split_float(proj, reader.float32(f, name)):
                        add_expert(prefix, e, p, w)
                # (part "_scales" is read with its blocks)
            elif m := _FUSED_EXPERTS.match(target):  # transformers v5 layout: [E, 2I, D] / [E, D, I]
                w = reader.float32(f, name)  # the whole layer's experts at once (one pread)
                for e in range(w.shape[0]):
                    if m["proj"] == "down_proj":
                        add_expert(m["prefix"], e, "down_proj", w[e])
                    else:
                        gate, up = np.split(w[e], 2, axis=0)
                        add_expert(m["prefix"], e, "gate_proj", gate)
                        add_expert(m["prefix"], e, "up_proj", up)
                del w
            elif len(shape) == 2:
                writer.add_dense(target, _quantized(reader, f, name, scheme_for(target, shape, bits)))
            else:
                writer.add_dense(target, reader.float32(f, name))
            bar.advance(task)
    incomplete = {p: sorted(layer) for p, layer in pending.items() if layer}
    if incomplete:
        prefix, ids = next(iter(incomplete.items()))
        raise ColibriError(f"{prefix}: experts {ids[:5]} are missing gate, up or down matrices in the checkpoint")
    writer.finish(fp8.dequantized_config(config), _tokenizer_files(src))


def _skip_wrapper_parts(names: list, model_type: str) -> list:
    """The checkpoint's tensors less the parts colibri does not run, with one line saying so."""
    skipped: dict[str, int] = {}
    kept = []
    for f, n in names:
        part = skipped_part(model_type, n)
        if part is None:
            kept.append((f, n))
        else:
            skipped[part] = skipped.get(part, 0) + 1
    said = ", ".join(f"the {part} ({skipped[part]} tensors)" for part in WRAPPERS[model_type]["skip"] if part in skipped)
    if said:
        print(f"{model_type}: skipping {said}: colibri runs the language model only", file=sys.stderr)
    return kept


def _int4_weight(f: SafetensorsFile, name: str, side: dict, bits: int) -> QTensor:
    """A compressed-tensors int4 weight: q4_0 (the same values) at --bits 4 and 8, f32 at 32."""
    base = name[: -len(compressed_tensors.PACKED)]
    parts = {}
    for suffix in (compressed_tensors.SCALE, compressed_tensors.SHAPE):
        holder = side.get(base + suffix)
        if holder is None:
            raise ColibriError(f"{f.path}: pack-quantized tensor {name} has no {base + suffix} in any shard")
        parts[suffix] = np.asarray(holder.read(base + suffix))
    t = compressed_tensors.to_q4_0(np.asarray(f.read(name)), parts[compressed_tensors.SCALE],
                                   parts[compressed_tensors.SHAPE].tolist())
    return quantize(dequantize(t), "f32") if bits == 32 else t


def _quantized(reader: fp8.CheckpointReader, f: SafetensorsFile, name: str, scheme: str) -> QTensor:
    """A 2-D checkpoint tensor quantized with `scheme`, dequantized and quantized a few rows at a
    time (every scheme quantizes rows independently, so the result is the same as quantizing
    the whole float32 matrix). In memory at once: the quantized result, one 16 MiB slab of the
    stored bytes and one chunk's float32 values with the quantizer's temporaries (up to ~6x the
    chunk) -- not the whole float32 matrix and its temporaries, which for DeepSeek-V3's
    embeddings made the peak ~22 GB. Small chunks also keep the temporaries in cache (2-4x
    faster than whole matrices here)."""
    rows, cols = reader.shape(f, name)
    out: dict[str, np.ndarray] = {}
    for r, chunk in reader.row_chunks(f, name, _CHUNK_ELEMENTS):
        t = quantize(chunk, scheme)
        for part, a in t.parts().items():
            if part not in out:
                out[part] = np.empty((rows, *a.shape[1:]), dtype=a.dtype)
            out[part][r : r + a.shape[0]] = a
    if not out:  # a matrix without rows
        return quantize(np.zeros((rows, cols), np.float32), scheme)
    return QTensor(scheme, (rows, cols), out["q"], out.get("scales"), out.get("mins"))


def _tokenizer_files(src: Path) -> dict[str, str]:
    files = {n: (src / n).read_text() for n in TOKENIZER_FILES if (src / n).exists()}
    # transformers >= 4.43 may keep the chat template in its own file; the container keeps it
    # in tokenizer_config.json, where every tool looks first.
    template = src / "chat_template.jinja"
    if template.exists():
        cfg = json.loads(files.get("tokenizer_config.json", "{}"))
        cfg["chat_template"] = template.read_text()  # the separate file wins, as in transformers
        files["tokenizer_config.json"] = json.dumps(cfg, indent=2, ensure_ascii=False)
    return files


def _convert_gguf(path: Path, out: Path, progress: bool) -> None:
    """A lossless repack: every tensor keeps the file's type (bits=0 in the manifest); routed
    experts are cut out of their per-layer stacks one expert at a time (GGUFStack.expert) and
    written as container expert blobs."""
    from colibri.io.gguf import read_gguf

    ckpt = read_gguf(path)
    writer = ContainerWriter(out, bits=0, source=str(path))
    n_experts = sum(next(iter(stacks.values())).num_experts for stacks in ckpt.experts.values())
    with _progress(progress) as bar:
        task = bar.add_task(f"repacking {path.name}", total=len(ckpt.tensors) + n_experts)
        for name, t in ckpt.tensors.items():
            writer.add_dense(name, t)
            bar.advance(task)
        for prefix, stacks in ckpt.experts.items():
            m = _LAYER.search(prefix + ".")
            count = {s.num_experts for s in stacks.values()}
            if len(count) != 1:
                raise ColibriError(f"{path.name}: the expert stacks of {prefix} hold different expert counts "
                                   f"({sorted(count)})")
            (num,) = count
            for e in range(num):
                writer.add_expert(prefix, int(m.group(1)) if m else 0, e, num,
                                  {proj: stacks[proj].expert(e) for proj in EXPERT_PROJECTIONS})
                bar.advance(task)
    files = {
        "tokenizer.json": ckpt.tokenizer_json,
        "tokenizer_config.json": json.dumps(ckpt.tokenizer_config, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps(ckpt.generation_config, indent=2),
    }
    writer.finish(ckpt.config, files)
