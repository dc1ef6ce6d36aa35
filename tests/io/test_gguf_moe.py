"""GGUF import of colibri's MoE families, through tools/gguf_writer (llama.cpp's layout, checked
against llama.cpp's own converter by bench/io/gguf_layout_oracle.py): tiny random transformers
models -> GGUF (f32) -> colibri must give the HF config on the keys the family reads, every
tensor and every expert bit for bit, and colibri's tokens on the HF checkpoint; transformers'
own GGUF loader agrees where it has the architecture; split sets, block types and the one-line
refusals."""
import os
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
from tools.gguf_writer import save_fixture_tokenizer, write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from harness import add_mtp_layer, make_hf_model, prompts_for

VOCAB = 320
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.7, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=256)


def random_bias(model):
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn_like(b))


# arch -> (model class, config kwargs, prepare, after_save, config keys the family reads)
CASES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                 dict(num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
                 None, None,
                 ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "head_dim", "attention_bias"]),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
                 None, None,
                 ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias"]),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(num_hidden_layers=2, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                   num_experts=4, num_experts_per_tok=2),
              None, None, ["num_experts", "num_experts_per_tok", "intermediate_size", "norm_topk_prob", "clip_qkv"]),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_hidden_layers=2, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                None, None, ["num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window"]),
    "glm4moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                     num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, n_group=2,
                     topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True),
                random_bias, add_mtp_layer,
                ["n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "intermediate_size", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group",
                 "topk_group", "use_qk_norm", "attention_bias", "head_dim", "num_nextn_predict_layers"]),
    "deepseek2": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                  dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
                       qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, n_group=2,
                       topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                       norm_topk_prob=True, rope_parameters=YARN, scoring_func="sigmoid", topk_method="noaux_tc"),
                  random_bias, None,
                  ["n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "intermediate_size", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group",
                   "topk_group", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                   "rope_interleave", "head_dim"]),
}
COMMON_KEYS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "hidden_act"]
ARCHES = sorted(CASES)


def hf_model(arch: str, out: Path, seed: int = 0) -> Path:
    cls_name, cfg_name, kw, prepare, after_save, _ = CASES[arch]
    cfg = getattr(transformers, cfg_name)(**_COMMON, **kw)
    d = make_hf_model(getattr(transformers, cls_name), cfg, seed, out, prepare=prepare)
    if after_save is not None:
        after_save(d)
    save_fixture_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (HF dir, its GGUF at f32), built once per module on first use."""
    built = {}

    def get(arch):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            hf = hf_model(arch, root / "hf", seed=ARCHES.index(arch) + 3)
            (path,) = write_gguf(hf, root / f"{arch}.gguf")
            built[arch] = hf, path
        return built[arch]

    return get


def same_value(a, b) -> bool:
    """Config values equal as the model reads them (floats as float32, dicts key by key)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.float32(a) == np.float32(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------- (a) config and tensors

@pytest.mark.parametrize("arch", ARCHES)
def test_config_matches_hf(models, arch):
    hf, path = models(arch)
    ckpt = read_gguf(path)
    ref = transformers.AutoConfig.from_pretrained(hf)
    ours = type(ref)(**ckpt.config)
    for key in COMMON_KEYS + CASES[arch][-1]:
        assert same_value(getattr(ours, key), getattr(ref, key)), f"{key}: {getattr(ours, key)!r} != {getattr(ref, key)!r}"
    assert same_value(ours.rope_parameters, ref.rope_parameters), (ours.rope_parameters, ref.rope_parameters)
    # colibri's family code reads the same layer kinds
    from colibri.models import family

    args, ref_args = (family(c["model_type"]).ModelArgs.from_dict(c) for c in (ckpt.config, ref.to_dict()))
    assert [args.mlp_kind(i) for i in range(ref.num_hidden_layers)] == \
        [ref_args.mlp_kind(i) for i in range(ref.num_hidden_layers)]


def _hf_state(hf: Path, arch: str, n_layers: int) -> dict[str, np.ndarray]:
    state = {k: v.numpy() for k, v in load_file(str(hf / "model.safetensors")).items()}
    if arch == "deepseek2":  # llama.cpp drops DeepSeek's MTP layers
        state = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{n_layers}.")}
    return state


@pytest.mark.parametrize("arch", ARCHES)
def test_every_tensor_and_expert_equals_hf(models, arch):
    import re

    hf, path = models(arch)
    ckpt = read_gguf(path)
    state = _hf_state(hf, arch, ckpt.config["num_hidden_layers"])
    expert = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
    rename = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    seen_dense, seen_experts = set(), 0
    for name, want in state.items():
        if m := expert.match(name):
            stack = ckpt.experts[m["prefix"]][rename.get(m["proj"], m["proj"])]
            assert isinstance(stack, GGUFStack) and stack.path == path
            got = stack.expert(int(m["e"]))
            seen_experts += 1
        else:
            got = ckpt.tensors[name]
            seen_dense.add(name)
        if isinstance(got, QTensor):
            assert got.scheme == "f32", name
            got = dequantize(got)
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert seen_dense == set(ckpt.tensors), set(ckpt.tensors) ^ seen_dense
    assert seen_experts == sum(s.num_experts for stacks in ckpt.experts.values() for s in stacks.values())


def test_stack_contract(models):
    """GGUFStack: expert e is one contiguous byte range of its file, row-major rows."""
    hf, path = models("qwen3moe")
    stack = read_gguf(path).experts["model.layers.1.mlp"]["down_proj"]
    assert (stack.scheme, stack.num_experts, stack.rows, stack.cols) == ("f32", 4, 64, 256)
    assert stack.row_bytes == 256 * 4 and stack.expert_bytes == 64 * 256 * 4
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert stack.offset == t.data_offset
    with open(path, "rb") as f:
        f.seek(stack.offset + 3 * stack.expert_bytes)
        raw = np.frombuffer(f.read(stack.expert_bytes), np.float32).reshape(64, 256)
    np.testing.assert_array_equal(stack.expert(3).q, raw)
    assert stack.expert_range(3) == (path, stack.offset + 3 * stack.expert_bytes, stack.expert_bytes)
    with pytest.raises(IndexError):
        stack.expert(4)


# ---------------------------------------------------------------- (b) colibri tokens

@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_converted_gguf_decodes_like_hf(models, arch, tmp_path):
    from colibri import Engine
    from colibri.io.convert import convert

    hf, path = models(arch)
    ours = Engine.load(convert(path, tmp_path / "from_gguf", progress=False))
    ref = Engine.load(convert(hf, tmp_path / "from_hf", bits=32, progress=False))
    for prompt in prompts_for(VOCAB, ARCHES.index(arch), lengths=(1, 9)):
        got = ours.generate(prompt, max_tokens=16, stop_at_eos=False).token_ids
        want = ref.generate(prompt, max_tokens=16, stop_at_eos=False).token_ids
        assert got == want, f"{arch} {prompt}: {got} != {want}"
        np.testing.assert_allclose(ours.logits(prompt + got)[-1], ref.logits(prompt + want)[-1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- (c) transformers reads the same GGUF

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_transformers_reads_the_gguf_alike(models, arch, monkeypatch):
    hf, path = models(arch)
    # transformers' Qwen2MoeTensorProcessor adds a leading dim to ffn_gate_inp_shexp whatever its
    # shape ("quantized one is (2048)"), but llama.cpp writes it F32 as [1, D] (GGUF dims [D, 1]),
    # which then loads as [1, 1, D] and is refused: only expand a 1-D one
    from transformers import modeling_gguf_pytorch_utils as mg

    process = mg.Qwen2MoeTensorProcessor.process

    def fixed(self, weights, name, **kwargs):
        out = process(self, weights, name, **kwargs)
        if "ffn_gate_inp_shexp" in name and out.weights.ndim == 3:
            out = out._replace(weights=out.weights[0])
        return out

    monkeypatch.setattr(mg.Qwen2MoeTensorProcessor, "process", fixed)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    # transformers' GGUF config mapping has no key for moe_intermediate_size & co, so it is given
    # the checkpoint's config; the tensors come from the GGUF
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=ref.config, dtype=torch.float32).eval()
    ids = torch.tensor([prompts_for(VOCAB, 5, lengths=(12,))[0]])
    with torch.no_grad():
        np.testing.assert_array_equal(theirs(ids).logits.numpy(), ref(ids).logits.numpy())
    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ours = read_gguf(path).config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "num_experts", "num_experts_per_tok", "norm_topk_prob"):
        assert same_value(ours[key], getattr(cfg, key)), key


# ---------------------------------------------------------------- (d) split sets

@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_split_set(models, arch, tmp_path):
    hf, path = models(arch)
    whole = read_gguf(path)
    parts = write_gguf(hf, tmp_path / "m.gguf", split=3)
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for named in parts:
        ckpt = read_gguf(named)
        assert ckpt.paths == parts and ckpt.config == whole.config
        assert list(ckpt.tensors) == list(whole.tensors)
        for name in whole.tensors:
            a, b = ckpt.tensors[name], whole.tensors[name]
            np.testing.assert_array_equal(a.q if isinstance(a, QTensor) else a, b.q if isinstance(b, QTensor) else b)
        assert ckpt.experts.keys() == whole.experts.keys()
        for prefix, stacks in whole.experts.items():
            for proj, s in stacks.items():
                mine = ckpt.experts[prefix][proj]
                assert mine.path in parts and (mine.num_experts, mine.rows, mine.cols) == (s.num_experts, s.rows, s.cols)
                np.testing.assert_array_equal(mine.expert(1).q, s.expert(1).q)
    paths_used = {s.path for stacks in read_gguf(parts[0]).experts.values() for s in stacks.values()}
    assert len(paths_used) > 1, "the experts should spread over several parts"
    os.remove(parts[1])
    for named in (parts[0], parts[2]):
        with pytest.raises(ColibriError, match="part m-00002-of-00003.gguf is missing") as info:
            read_gguf(named)
        assert "\n" not in str(info.value)


# ---------------------------------------------------------------- block types, refusals

def _rewrite(src: Path, dst: Path, replace: dict | None = None, meta: dict | None = None, arch: str | None = None):
    """Copy a GGUF, replacing some tensors ({name: (array, raw_dtype)}) and metadata values."""
    from gguf import GGUFValueType

    from colibri.io.gguf.reader import _field_value

    reader = gguf.GGUFReader(src)
    arch = arch or _field_value(reader.fields["general.architecture"])
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (meta or {}).get(key, _field_value(field))
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key.replace(_field_value(reader.fields["general.architecture"]) + ".", arch + ".", 1),
                        value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in (replace or {}):
            data, qtype = replace[t.name]
            w.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _random_blocks(qtype, *shape_in):
    """Random bytes of `qtype` for a tensor of numpy shape shape_in (last dim: weights per row)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    *outer, cols = shape_in
    raw = np.random.default_rng(int(qtype)).integers(0, 256, size=(*outer, cols // block * nbytes), dtype=np.uint8)
    if qtype in (T.Q4_K, T.Q5_K, T.Q2_K):  # keep the f16 d / dmin finite (the first 4 bytes)
        raw.reshape(-1, nbytes)[:, 0:4] = np.frombuffer(np.float16([0.01, 0.001]).tobytes(), np.uint8)
    return raw


def test_block_types_import_as_raw_rows(models, tmp_path):
    hf, path = models("qwen3moe")
    E, I, D = 4, 256, 64
    swaps = {"blk.0.ffn_down_exps.weight": (_random_blocks(T.Q4_K, E, D, I), T.Q4_K),
             "blk.0.ffn_gate_exps.weight": (_random_blocks(T.IQ4_NL, E, I, D), T.IQ4_NL),
             "blk.0.ffn_up_exps.weight": (_random_blocks(T.Q5_1, E, I, D), T.Q5_1),
             "blk.1.ffn_down_exps.weight": (_random_blocks(T.Q6_K, E, D, I), T.Q6_K),
             "blk.1.ffn_gate_exps.weight": (_random_blocks(T.MXFP4, E, I, D), T.MXFP4),
             "blk.1.ffn_up_exps.weight": (_random_blocks(T.Q5_0, E, I, D), T.Q5_0),
             "blk.0.attn_q.weight": (_random_blocks(T.IQ4_NL, 4 * 32, D), T.IQ4_NL),
             "blk.0.attn_norm.weight": (_random_blocks(T.Q5_0, D), T.Q5_0)}
    out = _rewrite(path, tmp_path / "blocks.gguf", swaps)
    ckpt = read_gguf(out)
    schemes = {"blk.0.ffn_down_exps": "q4_k", "blk.0.ffn_gate_exps": "iq4_nl", "blk.0.ffn_up_exps": "q5_1",
               "blk.1.ffn_down_exps": "q6_k", "blk.1.ffn_gate_exps": "mxfp4", "blk.1.ffn_up_exps": "q5_0"}
    proj = {"ffn_down_exps": "down_proj", "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj"}
    for stem, scheme in schemes.items():
        _, layer, kind = stem.split(".")
        s = ckpt.experts[f"model.layers.{layer}.mlp"][proj[kind]]
        raw = swaps[stem + ".weight"][0]
        assert s.scheme == scheme and s.row_bytes == raw.shape[-1]
        for e in range(E):
            t = s.expert(e)
            assert t.scheme == scheme and t.shape == (raw.shape[1], s.cols) and t.q.dtype == np.uint8
            np.testing.assert_array_equal(t.q, raw[e])
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.scheme == "iq4_nl" and q.shape == (128, 64)
    np.testing.assert_array_equal(q.q, swaps["blk.0.attn_q.weight"][0])
    norm = ckpt.tensors["model.layers.0.input_layernorm.weight"]  # 1-D in a block type: dequantized
    np.testing.assert_array_equal(norm, gguf.quants.dequantize(swaps["blk.0.attn_norm.weight"][0], T.Q5_0))
    from colibri.io.container import Container
    from colibri.io.convert import convert

    c = Container(convert(out, tmp_path / "c", progress=False))
    c.interleave_rows = False
    assert c.manifest["experts"]["model.layers.0.mlp"]["projections"]["down_proj"]["scheme"] == "q4_k"
    f = c.expert_file("model.layers.1.mlp")
    blob = np.array(f.raw("model.layers.1.mlp.experts.2"))
    unpacked = c.expert_layouts["model.layers.1.mlp"].unpack(blob)
    np.testing.assert_array_equal(unpacked["gate_proj"].q, swaps["blk.1.ffn_gate_exps.weight"][0][2])
    assert c.tensor("model.layers.0.self_attn.q_proj.weight").scheme == "iq4_nl"


def _one_line(info) -> str:
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ3_S, T.TQ1_0, T.IQ1_S])
def test_unsupported_type_is_refused(models, tmp_path, qtype):
    hf, path = models("qwen3moe")
    out = _rewrite(path, tmp_path / "bad.gguf", {"blk.1.ffn_up_exps.weight": (_random_blocks(qtype, 4, 256, 64), qtype)})
    with pytest.raises(ColibriError) as info:
        read_gguf(out)
    msg = _one_line(info)
    assert "bad.gguf" in msg and "blk.1.ffn_up_exps.weight" in msg and qtype.name in msg
    assert "supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q2_K" in msg and "MXFP4" in msg


def test_unknown_architecture_is_refused(models, tmp_path):
    hf, path = models("olmoe")
    out = _rewrite(path, tmp_path / "arch.gguf", arch="gpt2")
    with pytest.raises(ColibriError, match=r"arch\.gguf: GGUF architecture 'gpt2' is not supported") as info:
        read_gguf(out)
    assert "qwen3moe" in _one_line(info)


def test_truncated_expert_stack_is_refused(models, tmp_path):
    hf, path = models("mixtral")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up_exps.weight")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(path).read_bytes()[: int(t.data_offset) + 100])
    with pytest.raises(ColibriError) as info:
        read_gguf(cut)
    msg = _one_line(info)
    assert "cut.gguf" in msg and "truncated" in msg


@pytest.mark.parametrize("key,value,tensor", [("qwen3moe.expert_count", 8, "ffn_gate_inp.weight"),
                                              ("qwen3moe.expert_feed_forward_length", 128, "ffn_"),
                                              ("qwen3moe.embedding_length", 96, ".weight")])
def test_shape_disagreeing_with_metadata_is_refused(models, tmp_path, key, value, tensor):
    hf, path = models("qwen3moe")
    out = _rewrite(path, tmp_path / "shape.gguf", meta={key: value})
    with pytest.raises(ColibriError) as info:
        read_gguf(out)
    msg = _one_line(info)
    assert msg.startswith("shape.gguf: tensor ") and tensor in msg and "metadata" in msg


def test_deepseek2_without_gating_func_is_refused(models, tmp_path):
    """llama.cpp reads a deepseek2 file without expert_gating_func as DeepSeek-V2 (softmax)."""
    hf, path = models("deepseek2")
    reader = gguf.GGUFReader(path)
    assert "deepseek2.expert_gating_func" in reader.fields
    out = tmp_path / "v2.gguf"
    w_meta = {"deepseek2.expert_gating_func": 1}
    _rewrite(path, out, meta=w_meta)
    with pytest.raises(ColibriError, match="softmax") as info:
        read_gguf(out)
    _one_line(info)


def test_quantized_mla_halves_join_as_their_values(models, tmp_path):
    """deepseek2: attn_k_b / attn_v_b in Q8_0 -> kv_b_proj in f32 holding exactly their values."""
    hf, path = models("deepseek2")
    reader = gguf.GGUFReader(path)
    swaps = {}
    for t in reader.tensors:
        if t.name in ("blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"):
            swaps[t.name] = (gguf.quants.quantize(np.asarray(t.data), T.Q8_0), T.Q8_0)
    ckpt = read_gguf(_rewrite(path, tmp_path / "q8.gguf", swaps))
    kv_b = ckpt.tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    assert kv_b.scheme == "f32" and ckpt.tensors.gguf_type("model.layers.1.self_attn.kv_b_proj.weight") == "Q8_0"
    k = gguf.quants.dequantize(swaps["blk.1.attn_k_b.weight"][0], T.Q8_0)   # [H, r, Dn]
    v = gguf.quants.dequantize(swaps["blk.1.attn_v_b.weight"][0], T.Q8_0)   # [H, Dv, r]
    want = np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(kv_b.shape)
    np.testing.assert_array_equal(kv_b.q, want)
    hf_kv_b = load_file(str(hf / "model.safetensors"))["model.layers.1.self_attn.kv_b_proj.weight"].numpy()
    np.testing.assert_allclose(kv_b.q, hf_kv_b, atol=np.abs(hf_kv_b).max() / 100)


# ---------------------------------------------------------------- file types, tokenizers

@pytest.mark.parametrize("qtype,scheme", [("q8_0", "q8_0"), ("f16", "f16"), ("q4_0", "q4_0"), ("bf16", "bf16")])
def test_quantized_file_repacks_losslessly(models, tmp_path, qtype, scheme):
    """Every tensor and expert of a --type file holds exactly gguf-py's dequantized values; routers,
    norms and biases stay F32 (llama.cpp's rule)."""
    hf, _ = models("qwen2moe")
    (path,) = write_gguf(hf, tmp_path / f"{qtype}.gguf", qtype=qtype)
    ckpt = read_gguf(path)
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
           for t in gguf.GGUFReader(path).tensors}
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.scheme == scheme
    np.testing.assert_array_equal(dequantize(q), raw["blk.0.attn_q.weight"])
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"):
        assert ckpt.tensors[name].scheme == "f32", name
    stack = ckpt.experts["model.layers.1.mlp"]["down_proj"]
    assert stack.scheme == scheme
    for e in range(stack.num_experts):
        np.testing.assert_array_equal(dequantize(stack.expert(e)), raw["blk.1.ffn_down_exps.weight"][e])


@pytest.mark.parametrize("pre,pieces", [
    ("deepseek-v3", ["123", "45", " hello", "世界", "!!"]),
    ("glm4", ["123", "45", " hello世界", "!!"]),  # llama3's regex: letters of any script are one run
    ("deepseek-coder", ["1", "2", "3", "4", "5", " hello", "世界", "!!"]),
    ("deepseek-llm", ["12345", " hello", "世界", "!!"]),
    ("qwen2", ["1", "2", "3", "4", "5", " hello世界", "!!"]),
])
def test_pre_tokenizers(models, tmp_path, pre, pieces):
    from tokenizers import Tokenizer

    hf, _ = models("qwen2moe")
    (path,) = write_gguf(hf, tmp_path / "t.gguf", pre=pre)
    ckpt = read_gguf(path)
    tok = Tokenizer.from_str(ckpt.tokenizer_json)
    got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("12345 hello世界!!")]
    decode = {v: k for k, v in __import__("colibri.io.gguf", fromlist=["x"]).bytes_to_unicode().items()}
    assert [bytes(decode[c] for c in p).decode() for p in got] == pieces
    assert ckpt.tokenizer_config["chat_template"].startswith("{% for m in messages %}<|im_start|>")
    assert ckpt.tokenizer_config["eos_token"] == "<|im_end|>"


@pytest.mark.slow
@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q8_0"), ("deepseek2", "q8_0"), ("mixtral", "q8_0"),
                                        ("qwen3moe", "q4_k"), ("qwen3moe", "q6_k"), ("qwen3moe", "q2_k"),
                                        ("olmoe", "mxfp4"), ("olmoe", "iq4_nl"), ("qwen2moe", "q5_0")])
def test_quantized_gguf_decodes_like_transformers_on_its_values(models, arch, qtype, tmp_path):
    """A --type file through colibri's kernels for that type (the K-quants where rows hold whole
    256-blocks, here qwen3moe's expert down rows, q8_0 elsewhere: a per-tensor mix): transformers on
    the same (dequantized) weights gives the same greedy tokens (the harness's --bits 4
    comparison), and the file read in place gives the same tokens as its repacked container."""
    from colibri.io.gguf_link import link_gguf

    from harness import dequantized_reference, hf_greedy

    from colibri import Engine
    from colibri.io.convert import convert

    hf, _ = models(arch)
    (path,) = write_gguf(hf, tmp_path / f"{qtype}.gguf", qtype=qtype)
    container = convert(path, tmp_path / "c", progress=False)
    linked = Engine.load(link_gguf(path, tmp_path / "linked", progress=False))
    ref_dir = dequantized_reference(hf, container, tmp_path / "deq")
    ref = getattr(transformers, CASES[arch][0]).from_pretrained(ref_dir, attn_implementation="eager",
                                                                dtype=torch.float32).eval()
    engine = Engine.load(container)
    for prompt in prompts_for(VOCAB, 11, lengths=(3, 10)):
        want, _ = hf_greedy(ref, prompt, 12)
        assert engine.generate(prompt, max_tokens=12, stop_at_eos=False).token_ids == want, prompt
        assert linked.generate(prompt, max_tokens=12, stop_at_eos=False).token_ids == want, prompt


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_int8_activations_on_a_k_quant_file(models, qtype, tmp_path):
    """`--activations int8` on a K-quant file (its expert down rows Q4_K / Q6_K: block_idot.py's
    int8 tiles in the fused MoE kernel, q8_0 elsewhere, exact): close to the exact path but not
    equal to it, and sequences decoded together get the bits of decoding each alone."""
    from colibri import Engine
    from colibri.io.convert import convert

    hf, _ = models("qwen3moe")
    (path,) = write_gguf(hf, tmp_path / f"{qtype}.gguf", qtype=qtype)
    container = convert(path, tmp_path / "c", progress=False)
    exact, int8 = (Engine.load(container, activations=mode, max_context=64) for mode in ("f32", "int8"))
    ids = np.asarray(prompts_for(VOCAB, 7, lengths=(24,))[0])
    lp = {}
    for mode, engine in (("f32", exact), ("int8", int8)):
        z = engine.logits(ids.tolist()).astype(np.float64)
        lp[mode] = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    kl = (np.exp(lp["f32"]) * (lp["f32"] - lp["int8"])).sum(-1)
    assert 0 < kl.mean() < 1e-3, kl.mean()
    assert (lp["f32"].argmax(-1) == lp["int8"].argmax(-1)).mean() >= 0.9
    model = int8.model  # several sequences decoded in one pass: each row the bits of decoding it alone
    pa, pb, ta, tb = ids[:9], ids[9:14], ids[14:18], ids[18:22]

    def prefilled(prompt):
        cache = model.new_cache(32)
        model.forward(prompt, cache)
        return cache

    ca, cb = prefilled(pa), prefilled(pb)
    alone = [np.concatenate([model.forward(np.asarray([t]), c) for t in ts]) for c, ts in ((prefilled(pa), ta),
                                                                                        (prefilled(pb), tb))]
    for s in range(4):
        rows = model.forward_rows([ta[s], tb[s]], [ca, cb])
        np.testing.assert_array_equal(rows[0], alone[0][s])
        np.testing.assert_array_equal(rows[1], alone[1][s])
