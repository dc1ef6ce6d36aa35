"""GGUF import vs gguf-py's own dequantizer and transformers' GGUF loader (names, q/k
un-permutation, config), bit for bit; plus the one-line errors for files colibri cannot take."""
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from colibri.errors import ColibriError  # noqa: E402
from colibri.io.gguf_import import read_gguf  # noqa: E402
from colibri.formats.qtensor import QTensor, dequantize  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(smollm2_gguf):
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def reference_names(checkpoint):
    """GGUF name -> HF name, as transformers' own loader maps them (a meta-device model)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    config = transformers.LlamaConfig(**checkpoint.config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return get_gguf_hf_weights_map(model, LlamaTensorProcessor(config=checkpoint.config))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_every_tensor_matches_transformers_dequantized(reader, checkpoint, reference_names):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config=checkpoint.config)
    assert len(checkpoint.tensors) == len(reader.tensors) == 272
    schemes = {"Q4_1": "q4_1", "Q8_0": "q8_0", "F32": "f32"}
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        ref = processor.process(weights=ref, name=t.name).weights  # transformers' reverse permute (q/k)
        name = reference_names[t.name]
        got = checkpoint.tensors[name]
        if ref.ndim == 2:
            assert isinstance(got, QTensor) and got.scheme == schemes[t.tensor_type.name], name
            assert got.shape == ref.shape, name
            got = dequantize(got)
        else:
            assert isinstance(got, np.ndarray) and got.dtype == np.float32, name
        np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=name)
    assert set(reference_names[t.name] for t in reader.tensors) == set(checkpoint.tensors)
    assert "lm_head.weight" not in checkpoint.tensors and checkpoint.config["tie_word_embeddings"]


def test_attention_rows_really_are_permuted(reader, checkpoint):
    # Guard against the reference and the import both skipping the permutation.
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.quants.dequantize(raw.data, raw.tensor_type)
    got = dequantize(checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"])
    assert not np.array_equal(got, raw)
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(raw, axis=0))


def test_config_matches_transformers(smollm2_gguf, checkpoint):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoConfig.from_pretrained(os.path.dirname(smollm2_gguf),
                                                  gguf_file=os.path.basename(smollm2_gguf))
    ours = transformers.LlamaConfig(**checkpoint.config)
    cfg = checkpoint.config
    assert cfg["model_type"] == ref.model_type == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act"):
        assert cfg[key] == getattr(ref, key) == getattr(ours, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == ours.rope_parameters["rope_theta"] == 100000.0
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)


def test_tokenizer_parts(checkpoint):
    tc = checkpoint.tokenizer_config
    assert tc["bos_token"] == "<|im_start|>" and tc["eos_token"] == "<|im_end|>"
    assert tc["add_bos_token"] is False and "add_eos_token" not in tc
    assert "<|im_start|>assistant" in tc["chat_template"]
    assert checkpoint.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tensors_mapping_is_lazy_and_fresh(checkpoint):
    name = "model.layers.3.self_attn.k_proj.weight"
    a, b = checkpoint.tensors[name], checkpoint.tensors[name]
    assert a is not b and a.shape == (192, 576)
    assert checkpoint.tensors.gguf_type(name) == "Q4_1"
    np.testing.assert_array_equal(a.q, b.q)


# ---------------------------------------------------------------- tiny synthetic files

def _write_gguf(path, arch="llama", tensors=(), tokenizer=True):
    """A tiny llama GGUF: 1 layer, hidden 64, 2 heads, byte-level vocab; `tensors` are
    (name, array, raw_dtype or None) triples."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(32)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(258)
    if tokenizer:
        from colibri.io.gguf_import import bytes_to_unicode

        tokens = ["<s>", "</s>"] + list(bytes_to_unicode().values())
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * 256)
        w.add_token_merges([])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    for name, array, raw_dtype in tensors:
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _embedding():
    return ("token_embd.weight", np.random.default_rng(0).standard_normal((258, 64)).astype(np.float32), None)


# (the K-quants, IQ4_*, Q5_*, MXFP4 import as block schemes: tests/io/test_gguf_moe.py)
@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ3_S, T.TQ1_0])
def test_unsupported_type_names_the_type(tmp_path, qtype):
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1).integers(0, 255, size=(64, 256 // block * nbytes), dtype=np.uint8)
    path = _write_gguf(tmp_path / "bad.gguf", tensors=[_embedding(), ("blk.0.attn_q.weight", raw, qtype)])
    with pytest.raises(ColibriError, match=rf"blk\.0\.attn_q\.weight has GGUF type {qtype.name}.*supported: F32"):
        read_gguf(path)


def test_every_supported_type_is_a_lossless_repack(tmp_path):
    rng = np.random.default_rng(2)
    w = {n: rng.standard_normal((64, 64)).astype(np.float32) for n in ("q", "k", "v", "o")}  # [out, in=hidden]
    stored = [
        ("blk.0.attn_q.weight", gguf.quants.quantize(w["q"], T.Q4_0), T.Q4_0),
        ("blk.0.attn_k.weight", gguf.quants.quantize(w["k"], T.Q8_0), T.Q8_0),
        ("blk.0.attn_v.weight", gguf.quants.quantize(w["v"], T.BF16), T.BF16),
        ("blk.0.attn_output.weight", w["o"].astype(np.float16), None),
        ("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32), None),
    ]
    path = _write_gguf(tmp_path / "tiny.gguf", tensors=[_embedding()] + stored)
    ckpt = read_gguf(path)
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config=ckpt.config)
    expect = {"blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", "q4_0"),
              "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", "q8_0"),
              "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj.weight", "bf16"),
              "blk.0.attn_output.weight": ("model.layers.0.self_attn.o_proj.weight", "f16"),
              "token_embd.weight": ("model.embed_tokens.weight", "f32")}
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        ref = processor.process(weights=ref, name=t.name).weights
        if t.name in expect:
            hf, scheme = expect[t.name]
            got = ckpt.tensors[hf]
            assert got.scheme == scheme
            got = dequantize(got)
        else:
            got = ckpt.tensors["model.layers.0.input_layernorm.weight"]
        np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=t.name)
    assert ckpt.config["tie_word_embeddings"] is True and ckpt.config["head_dim"] == 32


def test_other_architecture_is_named(tmp_path):
    path = _write_gguf(tmp_path / "q.gguf", arch="qwen2", tensors=[_embedding()])
    with pytest.raises(ColibriError, match="architecture 'qwen2'"):
        read_gguf(path)


def test_missing_tokenizer_is_an_error(tmp_path):
    path = _write_gguf(tmp_path / "notok.gguf", tensors=[_embedding()], tokenizer=False)
    with pytest.raises(ColibriError, match="no tokenizer"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [3, 5_000, -1])
def test_truncated_file(smollm2_gguf, tmp_path, keep):
    size = os.path.getsize(smollm2_gguf)
    keep = size + keep if keep < 0 else keep  # -1: only the last tensor loses its last byte
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ColibriError) as info:
        read_gguf(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"", b"hello, not a model\n" * 10, b"GGUF" + b"\xff" * 64])
def test_not_a_gguf(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(ColibriError) as info:
        read_gguf(path)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ColibriError, match="no GGUF file"):
        read_gguf(tmp_path / "absent.gguf")

