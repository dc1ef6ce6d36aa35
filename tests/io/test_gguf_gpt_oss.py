"""GGUF import of gpt-oss (llama.cpp arch `gpt-oss`): a tiny random transformers GptOssForCausalLM,
saved with float experts and rewritten with MXFP4 experts as the released checkpoints store them,
written in llama.cpp's layout by tools/gguf_writer (conversion/gpt_oss.py's; bench/io/
gguf_layout_oracle.py finds it byte-identical to convert_hf_to_gguf.py for both) -> colibri gives
the HF config on the keys the family reads, every tensor and expert bit for bit (MXFP4 experts
as stored, their values gguf-py's dequantization of them), and, run in place as `-m FILE.gguf`
does, the tokens and logits of colibri on the checkpoint itself over a prompt longer than the
sliding window; llama.cpp's tokenizer settings and the one-line refusals."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor, dequantize
from colibri.io.gguf import GGUFStack, read_gguf
from colibri.io.gguf.config import gpt_oss_layer_types
from colibri.io.gguf.tokenizer import tokenizer_files
from colibri.io.gpt_oss_experts import mxfp4_rows
from tools.gguf_writer import save_fixture_tokenizer, write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from harness import make_hf_model, prompts_for
from test_gguf_moe import same_value
from test_gpt_oss import to_mxfp4_checkpoint

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py: the link index goes there

VOCAB = 320
WINDOW = 8
# gpt-oss's own rope (yarn x32, truncate false) at a tiny original context; widths of whole MXFP4 blocks
CONFIG = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64, intermediate_size=64, head_dim=16,
              num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=512,
              num_local_experts=4, num_experts_per_tok=2,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
KEYS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "vocab_size", "max_position_embeddings", "tie_word_embeddings", "hidden_act", "attention_bias",
        "num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window", "layer_types",
        "swiglu_limit", "rope_parameters"]
EXPERTS = ("gate_up_proj", "down_proj")
KINDS = ("f32", "mxfp4")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF checkpoint, its tensors' float32 values by name, its GGUF): `f32`, float experts;
    `mxfp4`, the same model with MXFP4 experts (their values: transformers' dequantization)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = make_hf_model(transformers.GptOssForCausalLM, transformers.GptOssConfig(**CONFIG), 5, root / "f32" / "hf")
    save_fixture_tokenizer(hf)
    mx = root / "mxfp4" / "hf"
    mx.mkdir(parents=True)
    for f in hf.iterdir():
        (mx / f.name).write_bytes(f.read_bytes())
    reference = to_mxfp4_checkpoint(mx)
    built = {}
    for kind, d, values in (("f32", hf, hf), ("mxfp4", mx, reference)):
        (path,) = write_gguf(d, d.parent / f"{kind}.gguf")
        built[kind] = d, {k: v.numpy() for k, v in load_file(str(values / "model.safetensors")).items()}, path
    return built


@pytest.mark.parametrize("kind", KINDS)
def test_config_matches_hf(models, kind):
    from colibri.models import gpt_oss

    hf, _, path = models[kind]
    got = read_gguf(path).config
    ref = transformers.AutoConfig.from_pretrained(hf)
    ours = transformers.GptOssConfig(**got)
    for key in KEYS + ["rms_norm_eps"]:
        assert same_value(getattr(ours, key), getattr(ref, key)), f"{key}: {getattr(ours, key)!r} != {getattr(ref, key)!r}"
    args, ref_args = gpt_oss.ModelArgs.from_dict(got), gpt_oss.ModelArgs.from_dict(ref.to_dict())
    n = ref.num_hidden_layers
    assert [args.window(i) for i in range(n)] == [ref_args.window(i) for i in range(n)] == [WINDOW, None]
    assert args.rope_params() == ref_args.rope_params()


def _checkpoint_tensors(values: dict[str, np.ndarray]):
    """The checkpoint's tensors by colibri's names: dense ones, and (layer prefix, expert,
    projection) -> [out, in] float32 (gate/up de-interleaved, transposed), as gpt_oss_experts
    splits them."""
    dense, experts = {}, {}
    for name, w in values.items():
        prefix, sep, part = name.rpartition(".experts.")
        if not sep:
            dense[name] = w
        elif part in EXPERTS:
            for e in range(w.shape[0]):
                if part == "down_proj":
                    experts[prefix, e, "down_proj"] = w[e].T
                else:
                    experts[prefix, e, "gate_proj"], experts[prefix, e, "up_proj"] = w[e][:, 0::2].T, w[e][:, 1::2].T
        elif part == "down_proj_bias":
            dense[f"{prefix}.experts.down_proj.bias"] = w
        else:  # gate_up_proj_bias
            dense[f"{prefix}.experts.gate_proj.bias"] = w[:, 0::2]
            dense[f"{prefix}.experts.up_proj.bias"] = w[:, 1::2]
    return dense, experts


@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_and_expert_equals_the_checkpoint(models, kind):
    """Dense tensors, the sinks and every bias are the checkpoint's float32 values; experts are
    stacks of the file's own bytes: F32, or MXFP4 blocks whose values (gguf-py's dequantizer)
    are transformers' dequantization of the checkpoint's blocks and whose bytes are what
    colibri's converter makes of those blocks."""
    hf, values, path = models[kind]
    ckpt = read_gguf(path)
    dense, experts = _checkpoint_tensors(values)
    assert set(ckpt.tensors) == set(dense), set(ckpt.tensors) ^ set(dense)
    for name, want in dense.items():
        got = ckpt.tensors[name]
        got = dequantize(got) if isinstance(got, QTensor) else got
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    stored = load_file(str(hf / "model.safetensors")) if kind == "mxfp4" else {}
    rows = {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2), "down_proj": slice(None)}  # of gate_up
    for (prefix, e, proj), want in experts.items():
        stack = ckpt.experts[prefix][proj]
        assert isinstance(stack, GGUFStack) and stack.scheme == kind and stack.path == path
        got = stack.expert(e)
        _, offset, n = stack.expert_range(e)
        raw = np.fromfile(path, np.uint8, count=n, offset=offset)
        if kind == "mxfp4":
            np.testing.assert_array_equal(gguf.quants.dequantize(raw, T.MXFP4).reshape(want.shape), want)
            part = "down_proj" if proj == "down_proj" else "gate_up_proj"
            blocks, scales = (stored[f"{prefix}.experts.{part}{s}"][e].numpy()[rows[proj]]
                              for s in ("_blocks", "_scales"))
            np.testing.assert_array_equal(got.q, mxfp4_rows(blocks, scales))
        np.testing.assert_array_equal(dequantize(got), want, err_msg=f"{prefix} expert {e} {proj}")
    assert len(experts) == sum(s.num_experts for stacks in ckpt.experts.values() for s in stacks.values())


@pytest.mark.parametrize("kind", KINDS)
def test_run_in_place_decodes_like_the_checkpoint(models, kind, tmp_path):
    """The GGUF run in place (`-m FILE.gguf`: the linked index, experts streamed from the file)
    against colibri on the HF checkpoint converted (--bits 32: dense float32; MXFP4 experts kept
    as MXFP4): the same greedy tokens and logits, prompts and generations past the window; the
    GGUF repacked by `colibri convert` too."""
    from colibri import Engine
    from colibri.default_model import gguf_model_dir
    from colibri.io.convert import convert

    hf, _, path = models[kind]
    ours = Engine.load(gguf_model_dir(path, progress=False))
    repacked = Engine.load(convert(path, tmp_path / "from_gguf", progress=False))
    ref = Engine.load(convert(hf, tmp_path / "from_hf", bits=32, progress=False))
    for prompt in prompts_for(VOCAB, 4, lengths=(3, 3 * WINDOW)):
        got = ours.generate(prompt, max_tokens=16, stop_at_eos=False).token_ids
        want = ref.generate(prompt, max_tokens=16, stop_at_eos=False).token_ids
        assert got == want, f"{kind} {prompt}: {got} != {want}"
        logits = ref.logits(prompt + want)
        np.testing.assert_array_equal(ours.logits(prompt + got), logits)
        np.testing.assert_array_equal(repacked.logits(prompt + got), logits)


def test_transformers_gguf_loader(models):
    """transformers' own GGUF loader, where it reads llama.cpp's gpt-oss files: the checkpoint's
    weights. transformers 5.x's cannot yet (it reads rope.scaling.* values from the keys' length
    fields and looks for ffn_*_projs experts, which llama.cpp names ffn_*_exps): skipped, saying so."""
    hf, _, path = models["f32"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                   config=ref.config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 (the reason is the skip message)
        pytest.skip(f"transformers {transformers.__version__} cannot load a llama.cpp gpt-oss GGUF: "
                    f"{type(e).__name__}: {' '.join(str(e).split())}")
    got = theirs.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_is_o200k_with_the_files_chat_template(models):
    from tokenizers import Tokenizer

    from colibri.io.gguf import bytes_to_unicode
    from colibri.io.gguf.reader import _field_value

    _, _, path = models["f32"]
    assert _field_value(gguf.GGUFReader(path).fields["tokenizer.ggml.pre"]) == "gpt-4o"
    ckpt = read_gguf(path)
    tok = Tokenizer.from_str(ckpt.tokenizer_json)
    decode = {v: k for k, v in bytes_to_unicode().items()}
    pieces = [bytes(decode[c] for c in p).decode() for p, _ in
              tok.pre_tokenizer.pre_tokenize_str("HelloWorld's 12345 DON'T stop!!/\n\n  x")]
    # tiktoken's o200k_base (and o200k_harmony) split of the same text
    assert pieces == ["Hello", "World's", " ", "123", "45", " DON'T", " stop", "!!/\n\n", " ", " x"]
    assert ckpt.tokenizer_config["chat_template"].startswith("{% for m in messages %}<|im_start|>")


def test_harmony_turns_end_where_llama_cpp_ends_them(tmp_path):
    """<|return|> (an answer), <|call|> (a tool call) and <|endoftext|> end a gpt-oss turn, and
    <|end|> (the analysis message's end, before the answer) does not, as in llama.cpp."""
    tokens = ["a", "b", "<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|start|>", "ab"]
    meta = {"general.architecture": "gpt-oss", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 3, 3, 3, 3, 3, 1], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.eos_token_id": 3}
    _, _, generation = tokenizer_files(tmp_path / "m.gguf", meta)
    assert generation["eos_token_id"] == [3, 2, 5]
    _, _, generation = tokenizer_files(tmp_path / "m.gguf", {**meta, "general.architecture": "qwen3moe"})
    assert generation["eos_token_id"] == 3


# ---------------------------------------------------------------- layer order, refusals

def test_layer_order_is_llama_cpps_period():
    assert gpt_oss_layer_types(2, 4) == ["sliding_attention", "full_attention"] * 2
    assert gpt_oss_layer_types(3, 4) == ["sliding_attention", "sliding_attention", "full_attention",
                                         "sliding_attention"]
    assert gpt_oss_layer_types(1, 2) == ["full_attention"] * 2
    assert gpt_oss_layer_types(0, 2) == ["sliding_attention"] * 2


def _edited(src: Path, dst: Path, meta: dict | None = None, drop: tuple = (), tensors: dict | None = None) -> Path:
    """A copy of the GGUF `src` with metadata keys set ({key: (value, GGUFValueType, array item
    type)}) or dropped and tensors added ({name: (data, GGML type)})."""
    from gguf import GGUFValueType

    from colibri.io.gguf.reader import _field_value

    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), _field_value(reader.fields["general.architecture"]))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in (meta or {}):
            continue
        vtype = field.types[0]
        w.add_key_value(key, _field_value(field), vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY
                        else None)
    for key, (value, vtype, sub) in (meta or {}).items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, (data, qtype) in (tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_sliding_window_pattern_sets_the_layer_order(models, tmp_path):
    from gguf import GGUFValueType as V

    _, _, path = models["f32"]
    out = _edited(path, tmp_path / "p.gguf", meta={"gpt-oss.attention.sliding_window_pattern": (1, V.UINT32, None)})
    assert read_gguf(out).config["layer_types"] == ["full_attention", "full_attention"]


@pytest.mark.parametrize("edit, words", [
    (dict(meta={"gpt-oss.attention.sliding_window_pattern": ([True, False], "array", "bool")}),
     ["gpt-oss.attention.sliding_window_pattern", "per-layer array"]),
    (dict(meta={"gpt-oss.rope.freq_base_swa": (10000.0, "float", None)}),
     ["gpt-oss.rope.freq_base_swa=10000.0", "one rope base"]),
    (dict(drop=("gpt-oss.attention.sliding_window",)), ["lacks gpt-oss.attention.sliding_window"]),
    (dict(drop=("gpt-oss.expert_feed_forward_length",)), ["lacks gpt-oss.expert_feed_forward_length"]),
    (dict(tensors={"blk.0.ffn_gate_up_exps.weight": (np.zeros((4, 128, 64), np.float32), "F32")}),
     ["tensor blk.0.ffn_gate_up_exps.weight has no place in a gpt-oss model"]),
])
def test_what_colibri_does_not_run_is_refused_in_one_line(models, tmp_path, edit, words):
    from gguf import GGUFValueType as V

    types = {"array": V.ARRAY, "bool": V.BOOL, "float": V.FLOAT32}
    meta = {k: (v, types[t], types.get(s)) for k, (v, t, s) in edit.get("meta", {}).items()}
    tensors = {k: (d, T[t]) for k, (d, t) in edit.get("tensors", {}).items()}
    _, _, path = models["f32"]
    out = _edited(path, tmp_path / "bad.gguf", meta=meta, drop=edit.get("drop", ()), tensors=tensors)
    with pytest.raises(ColibriError) as info:
        read_gguf(out)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("bad.gguf: ") and all(w in msg for w in words), msg


# ---------------------------------------------------------------- the synthetic benchmark twin

TWIN_PROMPT = np.random.default_rng(2).integers(100, 49000, size=160).tolist()  # past the preset's window of 128


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """A 2-layer gpt-oss-20b slice at width / 16 (tools/synthetic_moe: MXFP4 experts) and its
    GGUF twin (tools/gguf_synthetic)."""
    from tools import gguf_synthetic, synthetic_moe

    d = tmp_path_factory.mktemp("twin")
    container = synthetic_moe.write_container(d / "c", "gpt-oss-20b", progress=False, layers=2, width_divisor=16,
                                              vocab=gguf_synthetic.TOKENIZER_VOCAB)
    return container, gguf_synthetic.write_gguf(d / "m.gguf", container)


def test_twin_reads_back_as_the_container(twin):
    """The twin's config, every dense tensor's values (sinks, q/k/v/o biases, router and expert
    biases among them) and every expert's MXFP4 bytes are the container's."""
    from colibri.io.container import Container
    from colibri.models import gpt_oss

    container, path = twin
    ckpt = read_gguf(path)
    c = Container(container)
    c.interleave_rows = False
    want, got = c.config, ckpt.config
    for key in KEYS:
        if key != "rope_parameters":
            assert same_value(got.get(key), want.get(key)), f"{key}: {got.get(key)!r} != {want.get(key)!r}"
    assert np.float32(got["rms_norm_eps"]) == np.float32(want["rms_norm_eps"])
    args = [gpt_oss.ModelArgs.from_dict(cfg) for cfg in (got, want)]
    assert args[0].rope_params() == args[1].rope_params() and args[0].rope_params()["truncate"] is False
    assert set(ckpt.tensors) == set(c.manifest["tensors"])
    for name in ckpt.tensors:
        ours, theirs = (dequantize(t) if isinstance(t, QTensor) else t for t in (ckpt.tensors[name], c.tensor(name)))
        np.testing.assert_array_equal(np.asarray(ours, np.float32).reshape(-1),
                                      np.asarray(theirs, np.float32).reshape(-1), err_msg=name)
    assert set(ckpt.experts) == set(c.expert_layouts)
    for prefix, layout in c.expert_layouts.items():
        for e in range(layout.num_experts):
            _, off, n = c.expert_range(prefix, e)
            blob = layout.unpack(np.fromfile(c.expert_file(prefix).path, np.uint8, count=n, offset=off))
            for proj, stack in ckpt.experts[prefix].items():
                assert blob[proj].scheme == stack.scheme == "mxfp4"
                np.testing.assert_array_equal(stack.expert(e).q, blob[proj].q, err_msg=f"{prefix} {e} {proj}")


def test_twin_run_in_place_gives_the_containers_logits(twin):
    from colibri import Engine
    from colibri.default_model import gguf_model_dir

    container, path = twin
    want = Engine.load(container, stream_experts=False).logits(TWIN_PROMPT)
    got = Engine.load(gguf_model_dir(path, progress=False), stream_experts=False).logits(TWIN_PROMPT)
    np.testing.assert_array_equal(got, want)


def test_twin_refuses_a_layer_order_llama_cpp_would_not_run(tmp_path):
    from tools import gguf_synthetic, synthetic_moe

    container = synthetic_moe.write_container(tmp_path / "c", "gpt-oss-20b", progress=False, layers=2,
                                              width_divisor=16, vocab=gguf_synthetic.TOKENIZER_VOCAB)
    config = container / "config.json"
    cfg = json.loads(config.read_text())
    config.write_text(json.dumps({**cfg, "layer_types": ["full_attention", "sliding_attention"]}))
    with pytest.raises(ColibriError, match="not llama.cpp's gpt-oss order"):
        gguf_synthetic.write_gguf(tmp_path / "m.gguf", container)
    assert not (tmp_path / "m.gguf").exists()
