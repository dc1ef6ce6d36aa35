"""GGUF -> Hugging Face-shaped checkpoint (config, tensors, tokenizer) as a lossless repack.

Follows transformers' GGUF loader (`modeling_gguf_pytorch_utils.py`, `integrations/ggml.py`,
`integrations/gguf/gguf_tokenizer_mapping.py`): same tensor names, same reverse permutation of
attn_q / attn_k, same tokenizer, so a colibri model and transformers read one GGUF identically.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_SCHEME = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
# Block layouts (32 weights each): f16 d [+ f16 m] + payload. See ggml-common.h block_q4_0 etc.
_BLOCK = {"Q4_0": (18, 2, 16), "Q4_1": (20, 4, 16), "Q8_0": (34, 2, 32)}  # bytes, header, payload

# llama.cpp per-layer tensor names -> transformers names (gguf-py's TensorNameMap for LLAMA).
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Split regexes for `tokenizer.ggml.pre`, as transformers' GGUF tokenizer uses them; any other
# value keeps the GPT-2 byte-level regex (SmolLM2's "smollm" among them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@dataclass
class GGUFCheckpoint:
    config: dict                 # HF config.json (LlamaConfig accepts it)
    tensors: "GGUFTensors"       # HF name -> QTensor [out, in] (2-D) or float32 array (1-D); lazy
    tokenizer_json: str          # a `tokenizers` serialization (tokenizer.json)
    tokenizer_config: dict       # tokenizer_config.json
    generation_config: dict      # generation_config.json


class GGUFTensors(Mapping):
    """HF name -> tensor, repacked from the memory-mapped file on each access (nothing cached),
    so a converter can stream a model larger than RAM one tensor at a time."""

    def __init__(self, entries: dict, permute_rows: dict[str, np.ndarray]):
        self._entries = entries            # HF name -> gguf ReaderTensor
        self._permute_rows = permute_rows  # HF name -> row order (q/k rope un-permutation)

    def __getitem__(self, name: str) -> QTensor | np.ndarray:
        return _repack(self._entries[name], self._permute_rows.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def gguf_type(self, name: str) -> str:
        """The GGUF type name the tensor is stored as (e.g. "Q4_1")."""
        return self._entries[name].tensor_type.name


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a GGUF file's metadata and tensor table; tensors are repacked lazily on access."""
    path = Path(path)
    reader = _open_reader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch is None:
        raise ColibriError(f"{path.name}: GGUF metadata has no general.architecture; the file is incomplete")
    if arch != "llama":
        raise ColibriError(
            f"{path.name}: GGUF architecture {arch!r} is not supported yet (supported: llama); "
            "convert the Hugging Face checkpoint instead"
        )
    _check_tensor_table(path, reader)
    config = _llama_config(path, meta, [t.name for t in reader.tensors])
    entries, permute_rows = _llama_tensors(path, reader, config)
    tokenizer_json, tokenizer_config, generation_config = _tokenizer(path, meta)
    return GGUFCheckpoint(config, GGUFTensors(entries, permute_rows), tokenizer_json, tokenizer_config,
                          generation_config)


# ---------------------------------------------------------------- reading the file

def _open_reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise ColibriError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ColibriError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        return GGUFReader(path)
    except Exception as exc:  # ValueError/KeyError/IndexError... wherever the bytes run out or go wrong
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise ColibriError(f"{path} is truncated or damaged; the GGUF reader stopped with: {why}") from None


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


def _check_tensor_table(path: Path, reader) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ColibriError(
                f"{path.name}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but the file has "
                f"{size} bytes; the file is truncated"
            )
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise ColibriError(
                f"{path.name}: tensor {t.name} has GGUF type {type_name}, which colibri cannot import; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )


def _need(path: Path, meta: dict, key: str):
    if key not in meta:
        raise ColibriError(f"{path.name}: GGUF metadata lacks {key}; the file is incomplete or not a llama model")
    return meta[key]


# ---------------------------------------------------------------- config

def _llama_config(path: Path, meta: dict, tensor_names: list[str]) -> dict:
    """The HF config transformers derives for a llama GGUF (load_gguf_checkpoint + LlamaConfig)."""
    key = lambda name: _need(path, meta, f"llama.{name}")  # noqa: E731
    if any(n.startswith("rope_freqs.") for n in tensor_names) or meta.get("llama.rope.scaling.type", "none") != "none":
        raise ColibriError(
            f"{path.name}: RoPE scaling (e.g. Llama 3.1's rope_freqs) is not supported yet for GGUF import"
        )
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = meta.get("llama.rope.dimension_count", meta.get("llama.attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = meta.get("llama.vocab_size", len(tokens) if tokens else None)
    if vocab_size is None:
        raise ColibriError(
            f"{path.name}: GGUF metadata gives no vocabulary size (llama.vocab_size or tokenizer tokens)"
        )
    rope_theta = float(meta.get("llama.rope.freq_base", 10000.0))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        # f32 in the file; widened as transformers widens it (the model computes in f32 anyway)
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab_size,
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": any(n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for n in tensor_names),
        "mlp_bias": any(n.endswith(("ffn_up.bias", "ffn_down.bias", "ffn_gate.bias")) for n in tensor_names),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if "general.name" in meta:
        config["_name_or_path"] = meta["general.name"]
    return config


# ---------------------------------------------------------------- tensors

def _llama_tensors(path: Path, reader, config: dict) -> tuple[dict, dict]:
    entries, permute_rows = {}, {}
    n_layers = config["num_hidden_layers"]
    for t in reader.tensors:
        stem, _, suffix = t.name.rpartition(".")
        parts = stem.split(".")
        if len(parts) == 2 and parts[0] == "blk" and parts[1].isdigit():
            hf = None
        elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LLAMA_LAYER:
            if int(parts[1]) >= n_layers:
                raise ColibriError(f"{path.name}: tensor {t.name} is beyond llama.block_count={n_layers}")
            hf = f"model.layers.{parts[1]}.{_LLAMA_LAYER[parts[2]]}.{suffix}"
        else:
            hf = f"{_LLAMA_GLOBAL[stem]}.{suffix}" if stem in _LLAMA_GLOBAL else None
        if hf is None or suffix not in ("weight", "bias"):
            raise ColibriError(f"{path.name}: tensor {t.name} has no place in a llama model; colibri cannot import it")
        if len(t.shape) > 2 or (len(t.shape) == 2 and suffix == "bias"):
            raise ColibriError(f"{path.name}: tensor {t.name} has unexpected shape {tuple(reversed(t.shape.tolist()))}")
        entries[hf] = t
        if stem.endswith((".attn_q", ".attn_k")):
            n_head = config["num_attention_heads"] if stem.endswith(".attn_q") else config["num_key_value_heads"]
            rows = int(t.shape[-1]) if len(t.shape) == 2 else int(t.shape[0])
            if rows % (2 * n_head):
                raise ColibriError(
                    f"{path.name}: tensor {t.name} has {rows} rows, not a multiple of 2 x {n_head} heads"
                )
            permute_rows[hf] = _rope_unpermutation(rows, n_head)
    if "model.embed_tokens.weight" not in entries:
        raise ColibriError(f"{path.name}: GGUF has no token_embd.weight; the file is incomplete")
    return entries, permute_rows


def _rope_unpermutation(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permute: transformers' `_reverse_permute_weights`,
    applied to row indices, so a packed tensor's rows (and their scales) move losslessly."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


def _repack(t, rows_order: np.ndarray | None) -> QTensor | np.ndarray:
    type_name = t.tensor_type.name
    data = np.asarray(t.data)
    if data.ndim == 1:  # norms, biases
        if type_name in _BLOCK:
            from gguf.quants import dequantize

            vec = dequantize(data, t.tensor_type).astype(np.float32).reshape(-1)
        elif type_name == "BF16":
            vec = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            vec = data.astype(np.float32)
        return vec if rows_order is None else vec[rows_order]
    if rows_order is not None:
        data = data[rows_order]
    out, n = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
    scheme = _SCHEME[type_name]
    if type_name in ("F32", "F16"):
        return QTensor(scheme, (out, n), np.ascontiguousarray(data))
    if type_name == "BF16":
        return QTensor(scheme, (out, n), np.ascontiguousarray(data).view(np.uint16))
    block, header, payload = _BLOCK[type_name]
    blocks = data.reshape(out, n // 32, block)  # [O, G, bytes]
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0].astype(np.float32)
    mins = None
    if type_name == "Q4_1":
        mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[:, :, header:header + payload]).reshape(out, n // 32 * payload)
    if type_name == "Q8_0":
        q = q.view(np.int8)
    return QTensor(scheme, (out, n), q, d, mins)


# ---------------------------------------------------------------- tokenizer

def _tokenizer(path: Path, meta: dict) -> tuple[str, dict, dict]:
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise ColibriError(f"{path.name}: GGUF carries no tokenizer (tokenizer.ggml.model / tokens missing)")
    if model != "gpt2":
        raise ColibriError(
            f"{path.name}: GGUF tokenizer model {model!r} is not supported yet (supported: gpt2 byte-level BPE)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or []

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    backend = _byte_level_bpe(tokens, token_types, meta.get("tokenizer.ggml.merges") or [],
                              meta.get("tokenizer.ggml.pre"), special, bool(add_bos), bool(add_eos))

    tokenizer_config = {
        # not "GPT2Tokenizer"/"LlamaTokenizer": those rebuild their own pipeline in transformers 5;
        # this one takes tokenizer.json as written
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length", 1 << 30),
    }
    if add_bos is not None:
        tokenizer_config["add_bos_token"] = bool(add_bos)
    if add_eos is not None:
        tokenizer_config["add_eos_token"] = bool(add_eos)
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]

    # llama.cpp also stops on end-of-turn / end-of-message tokens when the file names them
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and i not in eos_ids:
            eos_ids.append(i)
    generation_config = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation_config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return backend.to_str(), tokenizer_config, generation_config


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_level_bpe(tokens, token_types, merges, pre, special, add_bos, add_eos):
    """transformers' `byte_level_tokenizer` + `add_gguf_special_tokens` + `set_split_regex` +
    the special tokens and post-processor its TokenizersBackend adds."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet (raw UTF-8 in the file) is respelled into it.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()

    # As special added tokens: GPT2Tokenizer's default "<|endoftext|>" (only when in the vocabulary;
    # transformers would append it as a new id), the file's CONTROL tokens (one spelled outside the
    # byte alphabet is a llama.cpp mislabel and stays ordinary) and the named special tokens.
    # USER_DEFINED tokens (e.g. <think>) become plain added tokens: matched whole, not special.
    named = ["<|endoftext|>"] + [t for t in special.values() if t is not None]
    control = [tok for tok, ty in zip(tokens, token_types) if ty == _CONTROL and set(tok) <= alphabet]
    added_special = []
    for tok in control + [t for t in named if t in vocab]:
        if tok not in added_special:
            added_special.append(tok)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in added_special])
    user_defined = [tok for tok, ty in zip(tokens, token_types) if ty == _USER_DEFINED and tok in vocab]
    if user_defined:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

    bos, eos = special["bos_token"], special["eos_token"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return backend
