"""GGUF import of the Gated DeltaNet hybrids (qwen35moe, qwen3next): the GGUF twin of a synthetic
container (tools/gguf_synthetic.py, llama.cpp's converter layout: 1 + w norms, ssm_a = -exp(A_log),
qwen35moe's value heads tiled, qwen3next's in_proj_qkvz split) read back by colibri gives the
container's config, every tensor (A_log up to its float32 exp, which is what the model uses)
and, run in place as `-m FILE.gguf` does, the container's logits exactly; a block-quantized ssm_out
regroups its value heads; a tiny transformers model in the converter's layout (tools/gguf_writer)
decodes as its checkpoint. bench/io/gguf_twin_logits.py checks the same twins against llama.cpp,
bench/io/gguf_twin_oracle.py against its converter."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from tools import gguf_synthetic, synthetic_moe

from colibri import Engine
from colibri.default_model import gguf_model_dir
from colibri.formats.qtensor import QTensor, dequantize
from colibri.io.container import Container
from colibri.io.gguf import read_gguf
from colibri.models import qwen3_5_moe, qwen3_next

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py: the link index goes there

PRESETS = {"qwen35moe": "qwen3.6-35b-a3b", "qwen3next": "qwen3-next-80b-a3b"}
MODELS = {"qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next}
PROMPT = np.random.default_rng(1).integers(100, 49000, size=24).tolist()
KEYS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings"]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """arch -> (container, its GGUF twin), built once per module on first use; width / 8 keeps
    two value heads per key head, so the value-head reorder is undone for real."""
    built = {}

    def get(arch):
        if arch not in built:
            d = tmp_path_factory.mktemp(arch)
            container = synthetic_moe.write_container(d / "c", PRESETS[arch], progress=False, layers=4,
                                                      width_divisor=8, vocab=gguf_synthetic.TOKENIZER_VOCAB)
            built[arch] = container, gguf_synthetic.write_gguf(d / "m.gguf", container)
        return built[arch]

    return get


def _values(t) -> np.ndarray:
    return (dequantize(t) if isinstance(t, QTensor) else np.asarray(t, np.float32)).reshape(-1)


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_twin_reads_back_as_the_container(twins, arch):
    container, path = twins(arch)
    ckpt = read_gguf(path)
    c = Container(container)
    c.interleave_rows = False
    want, got = c.config, ckpt.config
    for key in KEYS:
        assert got.get(key) == want.get(key), key
    assert np.float32(got["rms_norm_eps"]) == np.float32(want["rms_norm_eps"])
    args = lambda cfg: MODELS[cfg["model_type"]].ModelArgs.from_dict(cfg)
    assert args(got).layer_types == args(want).layer_types and "full_attention" in args(got).layer_types
    assert args(got).rope_params() == {**want["rope_parameters"], "rope_theta": want["rope_parameters"]["rope_theta"]}
    assert set(ckpt.tensors) == set(c.manifest["tensors"])
    for name in ckpt.tensors:
        ours, theirs = _values(ckpt.tensors[name]), _values(c.tensor(name))
        if name.endswith("A_log"):  # log(-ssm_a) comes back as an A_log with the same float32 exp
            ours, theirs = -np.exp(ours), -np.exp(theirs)
        np.testing.assert_array_equal(ours, theirs, err_msg=name)
    layers = {p for p in c.expert_layouts}
    assert set(ckpt.experts) == layers
    prefix = sorted(layers)[1]
    layout = c.expert_layouts[prefix]
    _, off, n = c.expert_range(prefix, 5)
    blob = np.fromfile(c.expert_file(prefix).path, np.uint8, count=n, offset=off)
    for proj, stack in ckpt.experts[prefix].items():
        np.testing.assert_array_equal(dequantize(stack.expert(5)), dequantize(layout.unpack(blob)[proj]))


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_twin_run_in_place_gives_the_containers_logits(twins, arch):
    container, path = twins(arch)
    want = Engine.load(container, stream_experts=False).logits(PROMPT)
    got = Engine.load(gguf_model_dir(path, progress=False), stream_experts=False).logits(PROMPT)
    np.testing.assert_array_equal(got, want)


def _with_tensor(src, dst, name: str, raw: np.ndarray, qtype):
    """A copy of the GGUF `src` with tensor `name` replaced by `raw` bytes of `qtype`."""
    from gguf import GGUFValueType

    from colibri.io.gguf.reader import _field_value

    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), _field_value(reader.fields["general.architecture"]))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            vtype = field.types[0]
            w.add_key_value(key, _field_value(field), vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY
                            else None)
    for t in reader.tensors:
        data, tt = (raw, qtype) if t.name == name else (np.asarray(t.data), t.tensor_type)
        w.add_tensor(t.name, data, raw_dtype=tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("qtype, scheme", [(gguf.GGMLQuantizationType.Q8_0, "q8_0"),
                                           (gguf.GGMLQuantizationType.Q4_K, "f32")])
def test_block_quantized_ssm_out_regroups_its_value_heads(twins, tmp_path, qtype, scheme):
    """ssm_out's columns are qwen35moe's tiled value heads: whole blocks move where each head is
    whole blocks (Q8_0's 32 columns), the exact values otherwise (a Q4_K block spans 256 columns:
    several heads)."""
    container, path = twins("qwen35moe")
    name = "blk.0.ssm_out.weight"
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    cols, rows = (int(n) for n in t.shape)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block * nbytes), dtype=np.uint8)
    raw.reshape(-1, nbytes)[:, 0:4] = np.frombuffer(np.float16([0.01, 0.001]).tobytes(), np.uint8)  # finite d
    got = read_gguf(_with_tensor(path, tmp_path / "m.gguf", name, raw, qtype)).tensors[
        "model.layers.0.linear_attn.out_proj.weight"]
    cfg = Container(container).config
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    tiled = gguf_synthetic.tiled_order(hk, hv // hk, cfg["linear_value_head_dim"])
    want = np.empty((rows, cols), np.float32)
    want[:, tiled] = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)  # tiled[:, c] = grouped[:, tiled[c]]
    assert got.scheme == scheme
    np.testing.assert_array_equal(dequantize(got), want)


HF_CONFIGS = {  # tiny transformers models, two value heads per key head
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", {}),
    "qwen3next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {"intermediate_size": 96}),
}


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_converter_layout_decodes_like_the_hf_checkpoint(arch, tmp_path):
    """A tiny transformers model written in llama.cpp's converter layout (tools/gguf_writer, which
    bench/io/gguf_layout_oracle.py finds byte-identical to convert_hf_to_gguf.py) decodes in
    colibri as the checkpoint itself does."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    from colibri.io.convert import convert
    from tools.gguf_writer import save_fixture_tokenizer, write_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from harness import make_hf_model, prompts_for

    cls, cfg_cls, extra = HF_CONFIGS[arch]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=320, hidden_size=64, max_position_embeddings=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, **extra)
    hf = make_hf_model(getattr(transformers, cls), cfg, 7, tmp_path / "hf")
    save_fixture_tokenizer(hf)
    (path,) = write_gguf(hf, tmp_path / "m.gguf")
    ours = Engine.load(convert(path, tmp_path / "from_gguf", progress=False))
    ref = Engine.load(convert(hf, tmp_path / "from_hf", bits=32, progress=False))
    for prompt in prompts_for(320, 5, lengths=(1, 9)):
        got = ours.generate(prompt, max_tokens=12, stop_at_eos=False).token_ids
        want = ref.generate(prompt, max_tokens=12, stop_at_eos=False).token_ids
        assert got == want, f"{arch} {prompt}: {got} != {want}"
        np.testing.assert_allclose(ours.logits(prompt + got)[-1], ref.logits(prompt + want)[-1], rtol=0, atol=1e-5)
