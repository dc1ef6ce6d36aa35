"""What the planner knows about a model, from headers only (never a tensor): a colibri
container's manifest, a Hugging Face checkpoint's safetensors headers, or config.json alone
(sizes estimated for `colibri convert --bits 4` from the shapes it implies, shapes.py).

A synthetic slice (tools/synthetic_moe.py --layers N) holds the first N decoder layers of a model
whose config records the full layer count in `colibri_synthetic.full_num_hidden_layers`; its
facts describe the full model: every layer it does not hold counts like the held layers of the
same kind (dense or MoE), the embeddings and lm_head once, the KV cache at the full depth.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from colibri.errors import ColibriError
from colibri.io import compressed_tensors, fp8
from colibri.model_types import checkpoint_name, language_model_config, skipped_part
from colibri.plan import shapes
from colibri.plan.policy import ALIGN, DEFAULT_MAX_CONTEXT, round_up
from colibri.workspace import STATE_SNAPSHOTS, V4_ROW_SLACK


@dataclass
class ExpertLayer:
    prefix: str
    num_experts: int
    expert_bytes: int  # one expert's blob: what one read fetches


@dataclass
class ModelFacts:
    dir: str
    kind: str                      # "container", "gguf" (read in place), "hf" or "config" (the last two: sizes estimated for --bits 4)
    model_type: str
    num_layers: int
    dense_bytes: int
    dense_bytes_per_token: int     # dense bytes one decode step reads (an untied embedding: one row)
    expert_layers: list[ExpertLayer]
    top_k: int
    kv_bytes_per_token: int        # float32 KV cache, all layers (a hybrid's: its full-attention layers)
    model_max_context: int
    disk_bytes: int                # every file of the model directory (projected: of the full model)
    probe_files: list[str] = field(default_factory=list)  # where the disk probe reads
    config: dict = field(default_factory=dict)             # config.json (shapes for the prefill workspace)
    slice_layers: int = 0          # > 0: the directory holds only this many layers; sizes are of all num_layers
    state_bytes_per_slot: int = 0  # fixed per conversation: a hybrid's recurrent state with its kept snapshots,
    #                               DeepSeek V4's compressor rows

    @property
    def expert_count(self) -> int:
        return sum(layer.num_experts for layer in self.expert_layers)

    @property
    def expert_bytes(self) -> int:
        return sum(layer.num_experts * layer.expert_bytes for layer in self.expert_layers)

    @property
    def one_expert_per_layer_bytes(self) -> int:
        return sum(layer.expert_bytes for layer in self.expert_layers)

    @property
    def active_expert_bytes(self) -> int:
        """Routed-expert bytes one token uses: top_k experts in every MoE layer."""
        return sum(min(self.top_k, layer.num_experts) * layer.expert_bytes for layer in self.expert_layers)


def experts_per_token(config: dict) -> int:
    for key in ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k"):
        if config.get(key):
            return int(config[key])
    return 0


def _hybrid_layers(config: dict, layers: int) -> tuple[int, int]:
    """(full attention, linear attention) layers of a Gated DeltaNet hybrid over `layers` layers."""
    types = shapes.layer_types(dict(config, num_hidden_layers=layers))
    return types.count("full_attention"), types.count("linear_attention")


def _v4_floats_per_token(config: dict, layers: int) -> float:
    """DeepSeek V4: one key=value row per layer, plus a CSA layer's entry and indexer key per m
    positions and an HCA layer's entry per m'."""
    types, _, rates = shapes.v4_schedule(dict(config, num_hidden_layers=max(layers, 1)))
    dh, di = int(config["head_dim"]), int(config.get("index_head_dim") or 128)
    per = 0.0
    for kind in types[:layers]:
        per += dh + {shapes.V4_CSA: (dh + di) / rates[shapes.V4_CSA],
                     shapes.V4_HCA: dh / rates[shapes.V4_HCA]}.get(kind, 0.0)
    return per


def _v4_ring_bytes(config: dict, layers: int) -> int:
    """DeepSeek V4: the compressor rows' rings of one sequence (V4Cache.state_bytes), fixed."""
    types, _, rates = shapes.v4_schedule(dict(config, num_hidden_layers=max(layers, 1)))
    dh, di = int(config["head_dim"]), int(config.get("index_head_dim") or 128)
    widths = [{shapes.V4_CSA: 4 * dh + 4 * di, shapes.V4_HCA: 2 * dh}.get(kind, 0) for kind in types[:layers]]
    ring = 2 * max((rates[k] for k in set(types[:layers]) if k in rates), default=0) + V4_ROW_SLACK
    return 4 * ring * sum(widths)


def _state_bytes_per_slot(config: dict, layers: int) -> int:
    """A hybrid's float32 recurrent state for one sequence, the live one and its snapshots
    (models/recurrent.py): fixed, whatever the context length. 0 for other models."""
    if config.get("model_type") == "deepseek_v4":
        return _v4_ring_bytes(config, layers)
    if not shapes.is_hybrid(config):
        return 0
    (k1, c), (hv, dk, dv) = shapes.linear_state_shapes(config)
    return _hybrid_layers(config, layers)[1] * 4 * (k1 * c + hv * dk * dv) * (1 + STATE_SNAPSHOTS)


def _kv_bytes_per_token(config: dict, layers: int) -> int:
    """float32 cache bytes per token over `layers` decoder layers (a hybrid's linear layers keep
    a fixed-size state instead: _state_bytes_per_slot)."""
    if config.get("model_type") == "deepseek_v4":  # models/deepseek_v4.V4Cache.bytes_per_token
        return int(4 * _v4_floats_per_token(config, layers))
    if shapes.is_hybrid(config):
        layers = _hybrid_layers(config, layers)[0]
    if config.get("kv_lora_rank"):  # MLA caches the compressed latent plus the rope dims (models/cache.py, MLACache)
        per_layer = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        per_layer += shapes.indexer_width(config)  # and a DSA indexer's rows
        return layers * per_layer * 4
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads))
    return layers * kv_heads * head_dim * 2 * 4


def full_layer_count(config: dict) -> int:
    """The model's decoder layers: a synthetic slice's config records the count it was cut from."""
    held = int(config.get("num_hidden_layers") or 0)
    synthetic = config.get("colibri_synthetic")
    full = synthetic.get("full_num_hidden_layers") if isinstance(synthetic, dict) else None
    return full if isinstance(full, int) and not isinstance(full, bool) and full > held else held


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


_EMBED = re.compile(r"embed_tokens\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The names `colibri convert` stores as routed experts (io/convert.py): one expert's matrix, or
# transformers v5's fused [E, 2I, D] / [E, D, I] tensors of a whole layer.
_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_NOT_CONVERTED = re.compile(r"rotary_emb\.inv_freq$")


def _layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass
class _Sizes:
    """Converted bytes found in a model directory, by where they sit."""

    held_layers: int                                        # config.json's num_hidden_layers
    outside: int = 0                                        # embeddings, lm_head, final norm (and MTP layers)
    per_layer: dict[int, int] = field(default_factory=dict)  # a decoder layer's dense tensors
    experts: list[ExpertLayer] = field(default_factory=list)
    untied_embedding: tuple[int, int] = (0, 1)              # (table bytes, rows) when lm_head is separate

    def add_dense(self, name: str, nbytes: int) -> None:
        layer = _layer_index(name)
        if layer is not None and layer < self.held_layers:
            self.per_layer[layer] = self.per_layer.get(layer, 0) + nbytes
        else:
            self.outside += nbytes

    @property
    def dense(self) -> int:
        return self.outside + sum(self.per_layer.values())


def analyze_model(model_dir: str | os.PathLike, project_slice: bool = True) -> ModelFacts:
    """Facts about a colibri container, a Hugging Face checkpoint or a bare config.json, from
    headers only. A synthetic slice is described as the full model unless `project_slice` is
    False (what the engine will load: --auto-tier plans the slice itself)."""
    from colibri.io.container import MANIFEST

    d = Path(model_dir)
    if not d.is_dir():
        raise ColibriError(f"model directory {d} does not exist")
    if (d / MANIFEST).exists():
        return _analyze_container(d, project_slice)
    if (d / "config.json").exists():
        return _analyze_hf(d, project_slice) if any(d.glob("*.safetensors")) else _analyze_config(d)
    raise ColibriError(f"{d} is neither a colibri model directory (no {MANIFEST}) nor a Hugging Face "
                       "checkpoint (config.json, with or without *.safetensors); pass --model with one of those")


def _facts(d: Path, kind: str, config: dict, sizes: _Sizes, disk_bytes: int, probe_files: list[str],
           project_slice: bool) -> ModelFacts:
    held, full = sizes.held_layers, full_layer_count(config)
    sliced = project_slice and full > held
    if sliced:
        sizes = _project_full_model(d, config, sizes, full)
        disk_bytes = sizes.dense + sum(layer.num_experts * layer.expert_bytes for layer in sizes.experts)
    layers = full if sliced else held
    table, rows = sizes.untied_embedding
    per_token = sizes.dense - (table - table // max(rows, 1))  # decoding reads one row of an untied table
    return ModelFacts(str(d), kind, config.get("model_type", "?"), layers, sizes.dense, per_token, sizes.experts,
                      experts_per_token(config), _kv_bytes_per_token(config, layers),
                      int(config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT), disk_bytes,
                      probe_files, config, held if sliced else 0, _state_bytes_per_slot(config, layers))


def _project_full_model(d: Path, config: dict, sizes: _Sizes, full: int) -> _Sizes:
    """A slice's sizes extended to all `full` layers: each layer it does not hold counts like the
    mean of the held layers of its kind; a kind it holds none of is sized from config.json."""
    held = sizes.held_layers
    kinds = shapes.mlp_kinds(config, full)
    held_moe = {i: layer for layer in sizes.experts if (i := _layer_index(layer.prefix)) is not None
                and i < held}
    if "moe" in kinds[held:] and not held_moe:
        raise ColibriError(f"{d} is a {held}-layer slice without a MoE layer: its experts cannot be projected "
                           f"to the full {full} layers; write a slice that keeps at least one MoE layer")
    # Held layers of a kind: MoE where the slice has experts (whatever the config rule says).
    held_by_kind: dict[str, list[int]] = {"moe": [], "dense": []}
    for i in range(held):
        held_by_kind["moe" if i in held_moe else "dense"].append(sizes.per_layer.get(i, 0))

    def layer_bytes(i: int) -> int:
        if i < held:
            return sizes.per_layer.get(i, 0)
        same_kind = held_by_kind[kinds[i]]
        if same_kind:
            return sum(same_kind) // len(same_kind)
        return sum(int(_converted_bytes(n, s)) for n, s in shapes.layer_tensors(config, i, kinds[i]))

    # The largest held MoE layer stands for the ones not held (they are alike in every model we know).
    template = max(held_moe.values(), key=lambda layer: layer.expert_bytes, default=None)
    experts = []
    for i in range(full):
        if i in held_moe:
            experts.append(held_moe[i])
        elif i >= held and kinds[i] == "moe":
            experts.append(ExpertLayer(re.sub(r"layers\.\d+", f"layers.{i}", template.prefix, count=1),
                                       template.num_experts, template.expert_bytes))
    # Expert layers past the held decoder layers (MTP) stay as they are.
    experts += [layer for layer in sizes.experts if _layer_index(layer.prefix) not in held_moe]
    return _Sizes(full, sizes.outside, {i: layer_bytes(i) for i in range(full)}, experts, sizes.untied_embedding)


def _analyze_container(d: Path, project_slice: bool) -> ModelFacts:
    from colibri.io.container import Container

    c = Container(d)
    sizes = _Sizes(int(c.config.get("num_hidden_layers") or 0))
    for name in c.manifest["tensors"]:
        sizes.add_dense(name, c.tensor_bytes(name))
    embed = [n for n in c.manifest["tensors"] if _EMBED.search(n)]
    if embed and c.has("lm_head.weight"):
        name = embed[0]
        sizes.untied_embedding = (c.tensor_bytes(name), c.manifest["tensors"][name]["shape"][0] or 1)
    sizes.experts = [ExpertLayer(prefix, lay.num_experts, lay.blob_bytes) for prefix, lay in c.expert_layouts.items()]
    if c.gguf:  # a GGUF read in place: its files are the model on disk
        files = [str(f) for f in c.gguf.files]
        return _facts(d, "gguf", c.config, sizes, sum(f.stat().st_size for f in c.gguf.files), files, project_slice)
    files = [str(d / lay.file) for lay in c.expert_layouts.values()] or [str(c.dense.path)]
    return _facts(d, "container", c.config, sizes, _dir_bytes(d), files, project_slice)


def _read_config(d: Path) -> dict:
    try:
        config = json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise ColibriError(f"{d}/config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ColibriError(f"{d}/config.json holds a JSON {type(config).__name__}, not an object")
    return language_model_config(config)  # a multimodal wrapper: the language model convert keeps


def _analyze_hf(d: Path, project_slice: bool) -> ModelFacts:
    from colibri.io.convert import container_name
    from colibri.io.safetensors_io import SafetensorsFile

    config = _read_config(d)
    model_type = json.loads((d / "config.json").read_text()).get("model_type")  # the checkpoint's names follow it
    sizes = _Sizes(int(config.get("num_hidden_layers") or 0))
    shards = sorted(d.glob("*.safetensors"))
    headers = [SafetensorsFile(path) for path in shards]
    tied = not any(checkpoint_name(model_type, n) == "lm_head.weight" for f in headers for n in f.tensors)
    experts: dict[str, dict[int, float]] = {}
    for f in headers:
        for name, info in f.tensors.items():
            # FP8 block scales are folded into the weights by the converter: not stored as such;
            # nor a wrapper's parts convert skips, nor an int4 weight's scale and shape tensors.
            if (_NOT_CONVERTED.search(name) or name.endswith(fp8.SCALE_SUFFIX) or skipped_part(model_type, name)
                    or compressed_tensors.is_side_tensor(name)):
                continue
            shape = info.shape
            if name.endswith(compressed_tensors.PACKED):  # int4 kept as q4_0 [O, 8 * packed words]
                name, shape = compressed_tensors.weight_name(name), (shape[0], shape[1] * 8)
                nbytes = _Q4_0_BYTES_PER_WEIGHT * shape[0] * shape[1]
            else:
                nbytes = None
            name = container_name(model_type, config, name)  # (a top-level MTP block: past the decoder layers)
            if m := _EXPERT.match(name):
                layer = experts.setdefault(m["prefix"], {})
                layer[int(m["e"])] = layer.get(int(m["e"]), 0) + (nbytes or _converted_bytes(name, shape))
            elif m := _FUSED_EXPERTS.match(name):  # [E, 2I, D] / [E, D, I]
                layer = experts.setdefault(m["prefix"], {})
                per = _converted_bytes(name, shape[1:])
                for e in range(shape[0]):
                    layer[e] = layer.get(e, 0) + per
            else:
                nbytes = int(nbytes or _converted_bytes(name, shape))
                sizes.add_dense(name, nbytes)
                if _EMBED.search(name) and not tied:
                    sizes.untied_embedding = (nbytes, shape[0])
    sizes.experts = [ExpertLayer(prefix, len(per_expert), round_up(int(max(per_expert.values())), ALIGN))
                     for prefix, per_expert in experts.items()]
    disk = sum(layer.num_experts * layer.expert_bytes for layer in sizes.experts) + sizes.dense
    return _facts(d, "hf", config, sizes, disk, [str(p) for p in shards], project_slice)


def _analyze_config(d: Path) -> ModelFacts:
    """config.json alone: every layer sized from the shapes it implies (a slice's config: all of
    the full model's layers, as there is nothing measured to project from)."""
    config = _read_config(d)
    full = full_layer_count(config)
    sizes = _Sizes(full)
    for name, shape in shapes.outside_layers(config):
        nbytes = int(_converted_bytes(name, shape))
        sizes.add_dense(name, nbytes)
        if _EMBED.search(name) and not config.get("tie_word_embeddings"):
            sizes.untied_embedding = (nbytes, shape[0])
    for i, kind in enumerate(shapes.mlp_kinds(config, full)):
        for name, shape in shapes.layer_tensors(config, i, kind):
            sizes.add_dense(name, int(_converted_bytes(name, shape)))
        if kind == "moe":
            prefix = f"model.layers.{i}.mlp"
            blob = sum(_converted_bytes(n, s) for n, s in shapes.expert_tensors(config, prefix))
            sizes.experts.append(ExpertLayer(prefix, shapes.num_experts(config), round_up(int(blob), ALIGN)))
    disk = sum(layer.num_experts * layer.expert_bytes for layer in sizes.experts) + sizes.dense
    facts = _facts(d, "config", config, sizes, disk, [], project_slice=False)
    held = int(config.get("num_hidden_layers") or 0)
    facts.slice_layers = held if full > held else 0
    return facts


# Bytes per weight after `colibri convert --bits 4` (convert.scheme_for): int4 g64 with f32
# scales, q8_0 (embeddings, lm_head) with f32 scales, f32 for routers and norms.
_BYTES_PER_WEIGHT = {"int4_g64": 0.5 + 4 / 64, "q8_0": 1 + 4 / 32, "f32": 4.0}
_Q4_0_BYTES_PER_WEIGHT = 0.5 + 4 / 32  # a compressed-tensors int4 weight, as convert keeps it


def _converted_bytes(name: str, shape: tuple[int, ...]) -> float:
    from colibri.io.convert import scheme_for

    n = 1
    for s in shape:
        n *= s
    if len(shape) == 1:
        return 4.0 * n
    return _BYTES_PER_WEIGHT[scheme_for(name, tuple(shape), 4)] * n
