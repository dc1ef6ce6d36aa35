"""A GGUF (file or split set) as a Hugging Face-shaped checkpoint: config, dense tensors by HF
name (lazy), routed experts as per-layer stacks (GGUFStack, lazy, one byte range per expert),
tokenizer files."""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor
from colibri.io.gguf import names as N
from colibri.io.gguf.config import ARCHITECTURES, build_config
from colibri.io.gguf.reader import (
    SCHEME_OF_TYPE,
    TensorRef,
    dequantized,
    matrix,
    open_gguf,
    raw_bytes,
    type_row_bytes,
)
from colibri.io.gguf.tokenizer import tokenizer_files

TYPE_OF_SCHEME = {scheme: type_name for type_name, scheme in SCHEME_OF_TYPE.items()}
_FLOAT_VIEW = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class GGUFStack:
    """One projection of all routed experts of one MoE layer, as GGUF stores it: a tensor of GGUF
    dims [cols, rows, num_experts] (innermost first), so expert e is the `expert_bytes` bytes at
    offset + e * expert_bytes of `path`: rows rows of row_bytes bytes, row-major."""

    path: Path          # the file (split part) holding the tensor
    offset: int         # absolute byte offset of the stacked tensor's data in that file
    scheme: str         # colibri scheme of the GGUF type (formats/qtensor.py SCHEMES)
    num_experts: int
    rows: int           # output features of one expert's matrix
    cols: int           # input features
    row_bytes: int
    expert_bytes: int   # rows * row_bytes

    def expert_range(self, e: int) -> tuple[Path, int, int]:
        """(file, absolute byte offset, byte count) of expert e's matrix: one pread."""
        if not 0 <= e < self.num_experts:
            raise IndexError(f"expert {e} is outside 0..{self.num_experts - 1}")
        return self.path, self.offset + e * self.expert_bytes, self.expert_bytes

    def expert(self, e: int) -> QTensor:
        """Expert e's [rows, cols] matrix from the memory-mapped file: the file's bytes as they are
        for float and block schemes (read-only views), the scales split out for q4_0/q4_1/q8_0."""
        path, offset, n = self.expert_range(e)
        return matrix(raw_bytes(path, offset, n), TYPE_OF_SCHEME[self.scheme], self.rows, self.cols)


@dataclass
class GGUFCheckpoint:
    config: dict                 # HF config.json of the family (colibri/model_types.py)
    tensors: GGUFTensors       # HF name -> QTensor [out, in] (2-D) or float32 array (1-D); lazy
    tokenizer_json: str          # a `tokenizers` serialization (tokenizer.json)
    tokenizer_config: dict       # tokenizer_config.json
    generation_config: dict      # generation_config.json
    # HF prefix of a MoE block as the container names it ("model.layers.3.mlp") -> projection
    # ("gate_proj", "up_proj", "down_proj") -> its stacked experts
    experts: dict[str, dict[str, GGUFStack]] = field(default_factory=dict)
    paths: list[Path] = field(default_factory=list)   # the file, or the parts of a split set


def _ref_spec(ref: TensorRef, file_index: dict[Path, int]) -> dict:
    return {"name": ref.name, "file": file_index[ref.path], "offset": ref.offset, "type": ref.type_name,
            "ne": list(ref.ne), "nbytes": ref.nbytes}


def _ref_of(spec: dict, paths: list[Path]) -> TensorRef:
    return TensorRef(spec["name"], paths[spec["file"]], spec["offset"], spec["type"], tuple(spec["ne"]), spec["nbytes"])


class _Dense:
    """One GGUF tensor as the HF tensor it came from. `untile_rows` / `untile_cols`
    ([key heads, value heads per key head, head dim, first row or column]): qwen35moe's value
    heads, which the converter reordered from grouped by key head to tiled, put back in groups.
    `value`: "unit_offset" (a zero-centred norm the converter wrote as 1 + w: w again) or "a_log"
    (ssm_a = -exp(A_log): A_log again)."""

    def __init__(self, ref: TensorRef, rope_heads: int | None = None, as_matrix: bool = False,
                 untile_rows: list | None = None, untile_cols: list | None = None, value: str | None = None):
        self.ref, self.rope_heads, self.as_matrix = ref, rope_heads, as_matrix
        self.untile_rows, self.untile_cols, self.value = untile_rows, untile_cols, value
        self.type_name = ref.type_name
        rows = ref.ne[-1] if len(ref.ne) == 2 else ref.ne[0]
        self.rows_order = None if rope_heads is None else _rope_unpermutation(rows, rope_heads)
        if untile_rows is not None:
            self.rows_order = _untiled_order(rows, *untile_rows)

    def spec(self, file_index: dict[Path, int]) -> dict:
        return {"ref": _ref_spec(self.ref, file_index), "rope_heads": self.rope_heads, "as_matrix": self.as_matrix,
                "untile_rows": self.untile_rows, "untile_cols": self.untile_cols, "value": self.value}

    def load(self) -> QTensor | np.ndarray:
        ref = self.ref
        raw = raw_bytes(ref.path, ref.offset, ref.nbytes)
        if len(ref.ne) == 1:  # norms, biases (any type: dequantized, as transformers does)
            vec = dequantized(raw, ref.type_name, ref.shape)
            if self.rows_order is not None:
                vec = vec[self.rows_order]
            vec = _undo_value(self.value, vec)
            return QTensor("f32", (1, vec.size), vec[None, :]) if self.as_matrix else vec
        rows, cols = ref.ne[1], ref.ne[0]
        if self.untile_cols is not None:
            order = _untiled_order(cols, *self.untile_cols)
            moved = _column_blocks(raw, ref.type_name, rows, cols, order)
            if moved is None:  # the heads split the type's blocks: the values themselves, exactly
                values = dequantized(raw, ref.type_name, (rows, cols))[:, order]
                if self.rows_order is not None:
                    values = values[self.rows_order]
                return QTensor("f32", (rows, cols), np.ascontiguousarray(values))
            raw = moved
        return matrix(raw, ref.type_name, rows, cols, self.rows_order)


def _untiled_order(n: int, key_heads: int, per_key: int, dim: int, start: int) -> np.ndarray:
    """The order of n rows (or columns) that regroups the value heads from `start` on: the
    converter's _reorder_v_heads put grouped head (g, j) at tiled position (j, g)."""
    tiled = np.arange(key_heads * per_key * dim).reshape(key_heads, per_key, dim).transpose(1, 0, 2).reshape(-1)
    if start + tiled.size != n:
        raise ColibriError(f"{n} rows do not hold {start} + {key_heads} x {per_key} value heads of {dim}")
    return np.concatenate([np.arange(start), start + np.argsort(tiled)])


def _column_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int, order: np.ndarray) -> np.ndarray | None:
    """The bytes of a [rows, cols] matrix with its columns in `order`, moving whole blocks of the
    type; None when `order` splits a block (a head narrower than a K-quant's 256 columns)."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    starts = order.reshape(-1, block)
    if np.any(starts[:, 0] % block) or np.any(starts - starts[:, :1] != np.arange(block)):
        return None
    data = raw.reshape(rows, cols // block, block_bytes)[:, starts[:, 0] // block]
    return np.ascontiguousarray(data).reshape(-1)


def _undo_value(kind: str | None, vec: np.ndarray) -> np.ndarray:
    if kind is None:
        return vec
    if kind == "unit_offset":
        # exact for 1 + w in [0.5, 2] (Sterbenz), so colibri's 1 + w is the file's value again
        return (vec - np.float32(1.0)).astype(np.float32)
    if kind == "a_log":
        return _a_log(vec)
    raise ValueError(kind)


def _a_log(neg_a: np.ndarray) -> np.ndarray:
    """ssm_a = -exp(A_log) -> an A_log whose float32 -exp (what the model computes) is ssm_a
    itself where some float32 has that image: log(-ssm_a), stepped a few ulps if needed."""
    neg_a = np.ascontiguousarray(neg_a, np.float32)
    best = np.log(-neg_a.astype(np.float64)).astype(np.float32)
    found = -np.exp(best) == neg_a
    down = up = best
    for _ in range(4):
        down, up = np.nextafter(down, np.float32(-np.inf)), np.nextafter(up, np.float32(np.inf))
        for cand in (down, up):
            hit = ~found & (-np.exp(cand) == neg_a)
            best, found = np.where(hit, cand, best), found | hit
    return best.astype(np.float32)


class _JoinedQKVZ:
    """qwen3next's attn_qkv ([q | k | v] over all key heads) and attn_gate (z) -> the
    checkpoint's in_proj_qkvz, rows grouped per key head as [q_g | k_g | v_g | z_g] (what
    colibri's Qwen3-Next reads). One type: the rows as stored, moved; two: their values (f32)."""

    def __init__(self, qkv: TensorRef, gate: TensorRef, heads: list):
        self.qkv, self.gate, self.heads = qkv, gate, heads
        self.type_name = qkv.type_name if qkv.type_name == gate.type_name else f"{qkv.type_name}+{gate.type_name}"

    def spec(self, file_index: dict[Path, int]) -> dict:
        return {"qkvz": [_ref_spec(self.qkv, file_index), _ref_spec(self.gate, file_index)], "heads": self.heads}

    def load(self) -> QTensor:
        a, b = self.qkv, self.gate
        cols, rows = a.ne[0], a.ne[1] + b.ne[1]
        order = np.argsort(_qkvz_order(*self.heads))
        ra, rb = raw_bytes(a.path, a.offset, a.nbytes), raw_bytes(b.path, b.offset, b.nbytes)
        if a.type_name == b.type_name:
            return matrix(np.concatenate([ra, rb]), a.type_name, rows, cols, order)
        values = np.concatenate([dequantized(ra, a.type_name, (a.ne[1], cols)),
                                 dequantized(rb, b.type_name, (b.ne[1], cols))])[order]
        return QTensor("f32", (rows, cols), np.ascontiguousarray(values))


def _qkvz_order(key_heads: int, value_heads: int, dk: int, dv: int) -> np.ndarray:
    """in_proj_qkvz's rows grouped per key head -> the order giving [q | k | v | z] (how the
    converter split it into attn_qkv and attn_gate)."""
    vz = value_heads // key_heads * dv
    base = np.arange(key_heads)[:, None] * (2 * dk + 2 * vz)
    parts = [base + np.arange(dk), base + dk + np.arange(dk), base + 2 * dk + np.arange(vz),
             base + 2 * dk + vz + np.arange(vz)]
    return np.concatenate([q.reshape(-1) for q in parts])


class _JoinedKVB:
    """deepseek2's attn_k_b [H, r, Dn] (each head's W_uk transposed) and attn_v_b [H, Dv, r] ->
    the checkpoint's kv_b_proj [H * (Dn + Dv), r] (per head W_uk rows then W_uv rows), which
    colibri's MLA reads. Float types: the same values and type (a transpose is a copy of bits);
    block types: dequantized to f32, exactly the values the file's blocks stand for (a
    transposed matrix has no blocks of the same type; MLA keeps kv_b dequantized anyway)."""

    def __init__(self, k: TensorRef, v: TensorRef):
        self.k, self.v = k, v
        self.type_name = k.type_name if k.type_name == v.type_name else f"{k.type_name}+{v.type_name}"

    def spec(self, file_index: dict[Path, int]) -> dict:
        return {"kvb": [_ref_spec(self.k, file_index), _ref_spec(self.v, file_index)]}

    def load(self) -> QTensor:
        k, v = self.k, self.v
        dn, r, h = k.ne
        dv = v.ne[1]
        kr, vr = raw_bytes(k.path, k.offset, k.nbytes), raw_bytes(v.path, v.offset, v.nbytes)
        if k.type_name == v.type_name and k.type_name in _FLOAT_VIEW:
            dtype, scheme = _FLOAT_VIEW[k.type_name], SCHEME_OF_TYPE[k.type_name]
            wk, wv = kr.view(dtype).reshape(h, r, dn), vr.view(dtype).reshape(h, dv, r)
        else:
            scheme = "f32"
            wk, wv = dequantized(kr, k.type_name, (h, r, dn)), dequantized(vr, v.type_name, (h, dv, r))
        joined = np.concatenate([wk.transpose(0, 2, 1), wv], axis=1).reshape(h * (dn + dv), r)
        return QTensor(scheme, (h * (dn + dv), r), np.ascontiguousarray(joined))


class GGUFTensors(Mapping):
    """HF name -> tensor, repacked from the memory-mapped file(s) on each access (nothing cached),
    so a converter can stream a model larger than RAM one tensor at a time."""

    def __init__(self, entries: dict):
        self._entries = entries

    def __getitem__(self, name: str) -> QTensor | np.ndarray:
        return self._entries[name].load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def spec(self, name: str, paths: list[Path]) -> dict:
        """Where tensor `name` lies in the files `paths` and how it is repacked, as JSON
        (tensor_from_spec reads it again without parsing the GGUF: colibri/io/gguf_link.py
        keeps it in its index)."""
        return self._entries[name].spec({p: i for i, p in enumerate(paths)})

    def gguf_type(self, name: str) -> str:
        """The GGUF type name the tensor is stored as (e.g. "Q4_1"; "Q8_0+F16" for a tensor joined
        from two of different types)."""
        return self._entries[name].type_name


def tensor_from_spec(spec: dict, paths: list[Path]) -> QTensor | np.ndarray:
    """GGUFTensors.spec(name, paths) -> the tensor, read from the memory-mapped files."""
    if "kvb" in spec:
        return _JoinedKVB(*(_ref_of(r, paths) for r in spec["kvb"])).load()
    if "qkvz" in spec:
        return _JoinedQKVZ(*(_ref_of(r, paths) for r in spec["qkvz"]), spec["heads"]).load()
    return _Dense(_ref_of(spec["ref"], paths), spec.get("rope_heads"), bool(spec.get("as_matrix")),
                  spec.get("untile_rows"), spec.get("untile_cols"), spec.get("value")).load()


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a GGUF file's (or split set's) metadata and tensor table; tensors are repacked lazily
    on access. Naming any part of a split set opens all of its parts."""
    path = Path(path)
    files = open_gguf(path)
    meta = files.meta
    arch = meta.get("general.architecture")
    if arch is None:
        raise ColibriError(f"{path.name}: GGUF metadata has no general.architecture; the file is incomplete")
    if arch not in ARCHITECTURES:
        raise ColibriError(f"{path.name}: GGUF architecture {arch!r} is not supported yet (supported: "
                           f"{', '.join(ARCHITECTURES)}); convert the Hugging Face checkpoint instead")
    config = build_config(files.paths[0], meta, arch, set(files.tensors))
    entries, experts = _assemble(files.paths[0].name, arch, config, files.tensors)
    tokenizer_json, tokenizer_config, generation_config = tokenizer_files(path, meta)
    return GGUFCheckpoint(config, GGUFTensors(entries), tokenizer_json, tokenizer_config, generation_config,
                          experts, files.paths)


def _assemble(fname: str, arch: str, config: dict, refs: dict[str, TensorRef]):
    table = N.LAYER[arch]
    model_type = config["model_type"]
    n_blocks = config["num_hidden_layers"] + (config.get("num_nextn_predict_layers") or 0)
    expect = _expected_dims(config)
    entries: dict = {}
    stacks: dict[int, dict[str, TensorRef]] = defaultdict(dict)
    mla: dict[int, dict[str, TensorRef]] = defaultdict(dict)
    qkvz: dict[int, dict[str, TensorRef]] = defaultdict(dict)
    hybrid = arch in N.HYBRIDS
    untile = _untile_plan(config) if arch == "qwen35moe" else {}

    def no_place(ref):
        return ColibriError(f"{fname}: tensor {ref.name} has no place in a {arch} model; colibri cannot import it")

    for name, ref in refs.items():
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".")
        if hybrid and parts[0] == "blk" and parts[1].isdigit():
            i, tail = int(parts[1]), name.split(".", 2)[2]
            if i >= config["num_hidden_layers"]:
                continue  # the MTP block (nextn): colibri does not run Qwen's multi-token prediction
            if tail in N.HYBRID_PARAMETERS:  # ssm_a, ssm_dt.bias: 1-D, one value per value head
                role = tail.split(".")[0]
                if tuple(ref.ne) != (config["linear_num_value_heads"],):
                    raise ColibriError(f"{fname}: tensor {name} has GGUF dims {list(ref.ne)} but the metadata "
                                       f"implies [{config['linear_num_value_heads']}]")
                entries[f"model.layers.{i}.{N.HYBRID_PARAMETERS[tail]}"] = _Dense(
                    ref, untile_rows=untile.get("ssm_a"), value="a_log" if role == "ssm_a" else None)
                continue
        if suffix not in ("weight", "bias"):
            raise no_place(ref)
        role, hf = stem, None
        if stem in N.GLOBAL:
            hf = f"{N.GLOBAL[stem]}.{suffix}"
        elif len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
            i, role = int(parts[1]), ".".join(parts[2:])
            if i >= n_blocks:
                raise ColibriError(f"{fname}: tensor {name} is beyond {arch}.block_count={n_blocks}")
            if role in N.EXPERT_STEMS and suffix == "weight":
                stacks[i][role] = ref
            elif role in N.MLA_SPLIT and arch == "deepseek2" and suffix == "weight":
                mla[i][role] = ref
            elif role in N.QKVZ_SPLIT and arch == "qwen3next" and suffix == "weight":
                qkvz[i][role] = ref
            elif role == N.ROUTING_BIAS and arch in N.WITH_ROUTING_BIAS and suffix == "bias":
                hf = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            elif role in N.UNSUFFIXED and role in table and suffix == "weight":
                hf = f"model.layers.{i}.{table[role]}"
            elif role in table:
                hf = f"model.layers.{i}.{table[role]}.{suffix}"
            else:
                raise no_place(ref)
        else:
            raise no_place(ref)
        want = expect(role, suffix)
        is_stack = (role in N.EXPERT_STEMS and suffix == "weight") or role in N.MLA_SPLIT
        if want is not None and tuple(ref.ne) != want:
            raise ColibriError(f"{fname}: tensor {name} has GGUF dims {list(ref.ne)} but the metadata "
                               f"implies {list(want)}; the file does not match its own metadata")
        bias_dims = 2 if role in N.EXPERT_STEMS else 1  # (gpt-oss's expert biases: one row per expert)
        ndims_ok = len(ref.ne) == 3 if is_stack else len(ref.ne) == bias_dims if suffix == "bias" \
            else len(ref.ne) in (1, 2)
        if not ndims_ok:
            raise ColibriError(f"{fname}: tensor {name} has unexpected GGUF dims {list(ref.ne)}")
        if hf is None:
            continue
        rope_heads, as_matrix = None, False
        if arch == "llama" and role in ("attn_q", "attn_k"):
            n_head = config["num_attention_heads"] if role == "attn_q" else config["num_key_value_heads"]
            rows = ref.ne[-1] if len(ref.ne) == 2 else ref.ne[0]
            if rows % (2 * n_head):
                raise ColibriError(f"{fname}: tensor {name} has {rows} rows, not a multiple of 2 x {n_head} heads")
            rope_heads = n_head
        if role == "ffn_gate_inp_shexp":
            as_matrix = len(ref.ne) == 1  # HF: [1, D]
        value = "unit_offset" if hybrid and role in N.UNIT_OFFSET_NORMS else None
        rows, cols = untile.get(role), untile.get(role + ".cols")
        entries[hf] = _Dense(ref, rope_heads, as_matrix, rows, cols, value)

    experts = {}
    for i in sorted(stacks):
        have = stacks[i]
        missing = [s for s in N.EXPERT_STEMS if s not in have]
        if missing:
            raise ColibriError(f"{fname}: layer {i} has {', '.join(sorted(have))} but no blk.{i}.{missing[0]}.weight")
        experts[N.expert_prefix(model_type, i)] = {N.EXPERT_STEMS[s]: _stack(fname, ref) for s, ref in have.items()}
    for i in sorted(mla):
        if len(mla[i]) != 2:
            raise ColibriError(f"{fname}: layer {i} has {next(iter(mla[i]))} but not its other half "
                               f"({' / '.join(N.MLA_SPLIT)})")
        k, v = mla[i]["attn_k_b"], mla[i]["attn_v_b"]
        entries[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = _JoinedKVB(k, v)
    for i in sorted(qkvz):
        if len(qkvz[i]) != 2:
            raise ColibriError(f"{fname}: layer {i} has {next(iter(qkvz[i]))} but not its other half "
                               f"({' / '.join(N.QKVZ_SPLIT)})")
        heads = [config[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                     "linear_value_head_dim")]
        entries[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"] = _JoinedQKVZ(
            qkvz[i]["attn_qkv"], qkvz[i]["attn_gate"], heads)
    if "model.embed_tokens.weight" not in entries:
        raise ColibriError(f"{fname}: GGUF has no token_embd.weight; the file is incomplete")
    _check_moe_layers(fname, arch, config, set(stacks))
    return entries, experts


def _untile_plan(config: dict) -> dict[str, list]:
    """qwen35moe: GGUF stem (".cols": its columns) -> the _untiled_order arguments regrouping its
    value heads; empty when there is one value head per key head (the converter reorders none)."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dv, key = config["linear_value_head_dim"], 2 * hk * config["linear_key_head_dim"]
    if hv == hk:
        return {}
    r = hv // hk
    return {"attn_qkv": [hk, r, dv, key], "ssm_conv1d": [hk, r, dv, key], "attn_gate": [hk, r, dv, 0],
            "ssm_beta": [hk, r, 1, 0], "ssm_alpha": [hk, r, 1, 0], "ssm_a": [hk, r, 1, 0],
            "ssm_out.cols": [hk, r, dv, 0]}


def _stack(fname: str, ref: TensorRef) -> GGUFStack:
    cols, rows, n = ref.ne
    rb = type_row_bytes(ref.type_name, cols)
    if rows * rb * n != ref.nbytes:
        raise ColibriError(f"{fname}: tensor {ref.name} holds {ref.nbytes} bytes, not {n} experts x {rows} rows "
                           f"x {rb} bytes")
    return GGUFStack(ref.path, ref.offset, SCHEME_OF_TYPE[ref.type_name], n, rows, cols, rb, rows * rb)


def _check_moe_layers(fname: str, arch: str, config: dict, moe_layers: set[int]) -> None:
    """The layers with routed experts are the ones the config makes MoE layers."""
    n = config["num_hidden_layers"]
    if config["model_type"] in ("glm4_moe", "deepseek_v3"):
        want = set(range(config["first_k_dense_replace"] or 0, n))
    elif config["model_type"] in ("qwen2_moe", "qwen3_moe"):
        want = set(range(n)) - set(config["mlp_only_layers"])
    elif config["model_type"] in ("olmoe", "mixtral", "gpt_oss"):
        want = set(range(n))
    elif config["model_type"] in ("qwen3_5_moe", "qwen3_next"):
        want = set(range(n)) - set(config.get("mlp_only_layers") or [])
    else:
        want = set()
    got = {i for i in moe_layers if i < n}
    if got != want:
        i = min(got ^ want)
        has = "has" if i in got else "lacks"
        raise ColibriError(f"{fname}: layer {i} {has} routed experts (blk.{i}.ffn_*_exps), which the metadata "
                           f"({arch}.leading_dense_block_count / expert_count) does not say")


def _expected_dims(config: dict):
    """(GGUF stem, suffix) -> the GGUF dims the config implies, or None where it implies none."""
    d, vocab = config["hidden_size"], config["vocab_size"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // h
    e = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
    mt = config["model_type"]
    per_expert = mt in ("mixtral", "olmoe", "gpt_oss")  # (their intermediate_size is the experts' width)
    moe_ff = config["intermediate_size"] if per_expert else config.get("moe_intermediate_size")
    dims = {"token_embd": (d, vocab), "output": (d, vocab), "output_norm": (d,), "attn_norm": (d,),
            "ffn_norm": (d,), "post_attention_norm": (d,), "attn_sinks": (h,)}
    if e:
        dims.update(ffn_gate_inp=(d, e), exp_probs_b=(e,), ffn_gate_exps=(d, moe_ff, e),
                    ffn_up_exps=(d, moe_ff, e), ffn_down_exps=(moe_ff, d, e))
    if mt == "deepseek_v3":
        r, dn, dv = config["kv_lora_rank"], config["qk_nope_head_dim"], config["v_head_dim"]
        dims.update(attn_k_b=(dn, r, h), attn_v_b=(r, dv, h), attn_kv_a_norm=(r,),
                    attn_kv_a_mqa=(d, r + config["qk_rope_head_dim"]))
    else:
        dims.update(attn_q=(d, h * hd), attn_k=(d, kv * hd), attn_v=(d, kv * hd), attn_output=(h * hd, d))
    if mt in ("qwen3_5_moe", "qwen3_next"):
        hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        conv, inner = 2 * hk * config["linear_key_head_dim"], hv * config["linear_value_head_dim"]
        conv += inner
        dims.update(attn_q=(d, 2 * h * hd), attn_q_norm=(hd,), attn_k_norm=(hd,), attn_qkv=(d, conv),
                    attn_gate=(d, inner), ssm_conv1d=(config["linear_conv_kernel_dim"], conv), ssm_beta=(d, hv),
                    ssm_alpha=(d, hv), ssm_ba=(d, 2 * hv), ssm_norm=(config["linear_value_head_dim"],),
                    ssm_out=(inner, d))

    def expect(stem: str, suffix: str):
        want = dims.get(stem)
        if want is None:
            return None
        if stem == "exp_probs_b":
            return want if suffix == "bias" else None
        if suffix == "bias" and stem in N.EXPERT_STEMS:  # gpt-oss's: [out, experts]
            return want[1:]
        if suffix == "bias":
            return (want[-1],) if len(want) == 2 else None
        return want

    return expect


def _rope_unpermutation(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permute: transformers' `_reverse_permute_weights`,
    applied to row indices, so a packed tensor's rows (and their scales) move losslessly."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)
