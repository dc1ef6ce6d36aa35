"""tools/synthetic_moe.py: real-shape presets match transformers' models, slices build and
decode, placement never changes tokens, routing is skewed and token-dependent, bad input is a
clear error that leaves nothing behind, and the GGUF twin holds the same weights."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from tools import moe_presets
from tools import synthetic_moe
from colibri.errors import ColibriError

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- shapes

def _transformers_shapes(cfg: dict) -> dict[str, tuple]:
    """Parameter shapes of transformers' model for cfg, built on the meta device (no memory),
    with fused expert tensors split into colibri's per-expert names."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    hf = {k: v for k, v in cfg.items() if k not in ("architectures", "colibri_synthetic")}
    # (qwen3_5_moe's own config is the multimodal wrapper: its text model is qwen3_5_moe_text)
    model_type = {"kimi_k2": "deepseek_v3", "qwen3_5_moe": "qwen3_5_moe_text"}.get(hf["model_type"], hf["model_type"])
    hf.pop("model_type", None)
    if "num_experts" in hf:
        hf["num_local_experts"] = hf["num_experts"]  # transformers 5 names Qwen3-MoE's expert count so
    config = AutoConfig.for_model(model_type, **hf)
    glm5 = model_type == "glm5_next_text"  # (no causal-LM class of its own: the text model, plus its head)
    with torch.device("meta"):
        model = AutoModel.from_config(config) if glm5 else AutoModelForCausalLM.from_config(config)
    shapes = {}
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "rotary_emb" not in n]
    if glm5:  # the checkpoint's names: under model., KDA's forget gate and q/k/v convolutions as stored
        tensors = [(f"model.{n}".replace(".forget_gate.", "."), p) for n, p in tensors]
        tensors.append(("lm_head.weight", torch.empty(config.vocab_size, config.hidden_size, device="meta")))
        for name, p in list(tensors):
            if name.endswith(".conv1d.weight"):
                tensors.remove((name, p))
                tensors += [(name.replace(".conv1d.", f".{n}_conv1d."), p[: p.shape[0] // 3]) for n in "qkv"]
    for name, p in tensors:
        shape = tuple(p.shape)
        if model_type == "gpt_oss" and ".mlp.experts." in name:  # [E, D, 2I] gate/up interleaved, [E, I, D]
            prefix, proj = name.rsplit(".", 1)
            E, a, b = (*shape, 0)[:3]
            shapes.update({"gate_up_proj": {f"{prefix}.*.gate_proj": (b // 2, a), f"{prefix}.*.up_proj": (b // 2, a)},
                           "down_proj": {f"{prefix}.*.down_proj": (b, a)},
                           "gate_up_proj_bias": {f"{prefix}.gate_proj.bias": (E, a // 2),
                                                 f"{prefix}.up_proj.bias": (E, a // 2)},
                           "down_proj_bias": {f"{prefix}.down_proj.bias": (E, a)}}[proj])
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, D]
            prefix = name[: -len(".gate_up_proj")]
            shapes[f"{prefix}.*.gate_proj"] = shapes[f"{prefix}.*.up_proj"] = (shape[1] // 2, shape[2])
        elif name.endswith("mlp.experts.down_proj"):
            shapes[f"{name[: -len('.down_proj')]}.*.down_proj"] = tuple(shape[1:])
        else:  # MiniMax-M2 keeps its routing bias beside the router; colibri's decoder, in it
            shapes[name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")] = shape
    return shapes


def _preset_shapes(cfg: dict) -> dict[str, tuple]:
    shapes = {s.name: s.shape for s in moe_presets.model_specs(cfg)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({s.name: s.shape for s in moe_presets.layer_specs(cfg, i)})
        if moe_presets.is_moe_layer(cfg, i):
            for proj, shape in moe_presets.expert_shapes(cfg).items():
                shapes[f"model.layers.{i}.mlp.experts.*.{proj}"] = shape
    return shapes


@pytest.mark.parametrize("preset", sorted(moe_presets.REAL))
def test_real_presets_have_transformers_shapes(preset):
    """Every tensor the preset writes has the shape transformers' model of the same config has,
    and nothing is missing (checked on the dense layers and the first two MoE layers)."""
    cfg = moe_presets.preset_config(preset)
    first_moe = moe_presets.moe_layers(cfg)[0]
    cfg = moe_presets.slice_config(cfg, preset, first_moe + 2, 1.0, 0)
    ours, theirs = _preset_shapes(cfg), _transformers_shapes(cfg)
    assert ours == theirs


def test_full_preset_sizes():
    """The headline numbers: Qwen3-30B-A3B is ~17 GB at int4, DeepSeek-V3's experts ~25 MB."""
    q3 = synthetic_moe.build_config("qwen3-30b-a3b")
    assert 16e9 < synthetic_moe.container_bytes(q3) < 19e9
    ds = moe_presets.preset_config("deepseek-v3")
    per_expert = sum(r * c for r, c in moe_presets.expert_shapes(ds).values()) * 9 / 16
    assert 24e6 < per_expert < 25e6
    assert len(moe_presets.moe_layers(ds)) == 58


# ----------------------------------------------------------------------------- slices decode

SLICES = {"qwen3-30b-a3b": 2, "qwen3-235b-a22b": 2, "deepseek-v3": 4, "kimi-k2": 2, "glm-5": 4, "glm-4.5-air": 2,
          "gpt-oss-20b": 2, "qwen3.6-35b-a3b": 4,
          "minimax-m2": 2, "deepseek-v4-flash": 4, "deepseek-v4-pro": 4, "glm-5.3-flash": 5}


@pytest.fixture(scope="module")
def slices(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    return {p: synthetic_moe.write_container(root / p, p, progress=False, layers=n, width_divisor=16, vocab=512)
            for p, n in SLICES.items()}


def _forced_run(model, **options):
    """(greedy tokens after a prompt, final logits of a forced 24-token sequence fed one
    token at a time after an 8-token prefill)."""
    from colibri import generate as gen
    from colibri.engine import Engine

    e = Engine.load(model, max_context=64, **options)
    seq = np.random.default_rng(1).integers(0, 512, size=24).tolist()
    greedy = e.generate(seq[:8], max_tokens=4, stop_at_eos=False).token_ids
    e.reset()
    cache = e.slots[0].cache
    gen.prefill(e.model, cache, seq[:8])
    for tok in seq[8:-1]:
        gen.decode_one(e.model, cache, tok)
    logits = gen.decode_one(e.model, cache, seq[-1])
    return greedy, logits


@pytest.mark.parametrize("preset", sorted(SLICES))
def test_slice_records_what_it_kept_and_decodes(slices, preset):
    import json

    cfg = json.loads((slices[preset] / "config.json").read_text())
    meta = cfg["colibri_synthetic"]
    assert meta["layers_kept"] == cfg["num_hidden_layers"] == SLICES[preset]
    assert meta["full_num_hidden_layers"] == moe_presets.REAL[preset]["num_hidden_layers"]
    assert moe_presets.moe_layers(cfg), "a slice keeps at least one MoE layer"
    tokens, logits = _forced_run(slices[preset])
    assert np.isfinite(logits).all()
    assert len(tokens) == 4 and all(0 <= t < 512 for t in tokens)


@pytest.mark.parametrize("preset, activations", [("deepseek-v3", "f32"), ("qwen3-30b-a3b", "f32"),
                                                 ("qwen3-30b-a3b", "int8"), ("gpt-oss-20b", "f32"),
                                                 ("qwen3.6-35b-a3b", "int8")])
def test_placement_never_changes_tokens(slices, preset, activations):
    """Resident experts, a RAM cache holding a few experts, and no cache at all (every expert
    read from disk, pread and mmap): the same greedy tokens and the same final logits, with
    exact and with int8 activations."""
    dense = _dense_gb(slices[preset])
    runs = {"resident": dict(stream_experts=False),
            "small cache": dict(stream_experts=True, ram_gb=dense + 0.0005),
            "no cache": dict(stream_experts=True, ram_gb=dense + 1e-6),
            "mmap": dict(stream_experts=True, expert_io="mmap")}
    runs = {label: {**opts, "activations": activations} for label, opts in runs.items()}
    results = {label: _forced_run(slices[preset], **opts) for label, opts in runs.items()}
    tokens, logits = results["resident"]
    for label, (t, l) in results.items():
        assert t == tokens, label
        np.testing.assert_array_equal(l, logits, err_msg=label)


def _dense_gb(model) -> float:
    from colibri.io.container import Container

    return Container(model).dense_bytes / (1 << 30)


# ----------------------------------------------------------------------------- routing skew

def _lru_hit_rate(ids: np.ndarray, capacity: int) -> float:
    lru, hits = OrderedDict(), 0
    for e in ids.reshape(-1):
        if e in lru:
            hits += 1
            lru.move_to_end(e)
        else:
            lru[e] = True
            if len(lru) > capacity:
                lru.popitem(last=False)
    return hits / ids.size


def _routes(model, tokens: int = 160) -> dict[str, np.ndarray]:
    """Expert ids chosen per MoE layer for random tokens, recorded at the router."""
    from colibri.engine import Engine
    from colibri.models import moe as common

    e = Engine.load(model, max_context=tokens + 8, stream_experts=False)
    seen: dict[str, list] = {}
    original = common.SparseMoE.route

    def route(self, x):
        w, ids = original(self, x)
        seen.setdefault(self.prefix, []).append(ids)
        return w, ids

    common.SparseMoE.route = route
    try:
        e.feed(np.random.default_rng(0).integers(0, 512, size=tokens).tolist())
    finally:
        common.SparseMoE.route = original
    return {p: np.concatenate(v) for p, v in seen.items()}


def test_routing_is_skewed_and_token_dependent(tmp_path):
    """skew 1 vs 0 at 64 experts, top-4, 4 layers: a quarter-sized LRU cache hits far more often
    with skew (as the analytic router model says), in the last layer as in the first, and
    tokens still route differently from one another."""
    rates = {}
    for skew in (0.0, 1.0):
        cfg_model = synthetic_moe.write_container(tmp_path / f"s{skew}", "medium", progress=False, skew=skew,
                                                  layers=4, vocab=512)
        routes = _routes(cfg_model)
        rates[skew] = [_lru_hit_rate(ids, 16) for ids in routes.values()]
        distinct = {tuple(sorted(r)) for r in routes[max(routes)].tolist()}
        assert len(distinct) > 40, f"skew {skew}: routing barely depends on the token"
    assert max(rates[0.0]) < 0.4, rates            # uniform: about 16 / 64 + chance repeats
    assert min(rates[1.0]) > 0.45, rates
    assert min(rates[1.0]) - max(rates[0.0]) > 0.15, rates


# ----------------------------------------------------------------------------- bad input

def _run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.synthetic_moe", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("args, message", [
    (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
    (["--preset", "deepseek-v3", "--layers", "0"], "--layers must be at least 1"),
    (["--preset", "deepseek-v3", "--layers", "3"], "keeps no MoE layer"),
    (["--preset", "tiny", "--layers", "9"], "has only 3 layers"),
])
def test_bad_arguments_are_clear_errors(tmp_path, args, message):
    r = _run_tool(tmp_path / "m", *args)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "m").exists()


def test_existing_target_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("mine")
    r = _run_tool(tmp_path / "m", "--preset", "tiny")
    assert r.returncode != 0 and "already exists" in r.stderr
    assert (tmp_path / "m" / "keep.txt").read_text() == "mine"


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs (needs root); skipped where it cannot be mounted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_too_little_space_is_refused_before_writing(small_disk):
    with pytest.raises(ColibriError, match="needs ~.* GB free"):
        synthetic_moe.write_container(small_disk / "m", "small", progress=False)
    assert not (small_disk / "m").exists()


def test_full_disk_mid_write_leaves_nothing(small_disk, monkeypatch):
    """The size check passes (the disk is said to be large) and the disk fills mid-write: a
    clear error and no directory left behind to look like a model."""
    class Plenty:
        free = 1 << 40

    monkeypatch.setattr(synthetic_moe.shutil, "disk_usage", lambda p: Plenty)
    with pytest.raises(ColibriError, match="disk full"):
        synthetic_moe.write_container(small_disk / "m", "small", progress=False)
    assert not (small_disk / "m").exists()
    monkeypatch.undo()
    assert shutil.disk_usage(small_disk).used < 1 << 20


# ----------------------------------------------------------------------------- GGUF twin

def test_gguf_twin_blocks_hold_the_same_weights():
    import gguf
    from tools import gguf_synthetic

    from colibri.formats.qtensor import dequantize

    rng = np.random.default_rng(0)
    t = synthetic_moe.random_int4(rng, 24, 256)
    ours = dequantize(t)
    theirs = gguf.quants.dequantize(gguf_synthetic.q4_0_blocks(t), gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(theirs.reshape(ours.shape), ours)
    q8 = synthetic_moe.random_q8(rng, 8, 128)
    theirs8 = gguf.quants.dequantize(gguf_synthetic.q8_0_blocks(q8), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(theirs8.reshape(8, 128), dequantize(q8))


def test_gguf_twin_file_holds_the_containers_weights(tmp_path):
    """A Qwen3-MoE slice written as its GGUF twin: every tensor there, experts stacked per layer,
    each weight equal to the container's; a vocabulary smaller than the tokenizer is refused."""
    import gguf
    from tools import gguf_synthetic

    from colibri.io.container import Container
    from colibri.formats.qtensor import dequantize

    model = synthetic_moe.write_container(tmp_path / "m", "qwen3-30b-a3b", progress=False, layers=1,
                                          width_divisor=16, vocab=49152)
    out = gguf_synthetic.write_gguf(tmp_path / "m.gguf", model)
    r = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in r.tensors}
    c = Container(model)
    assert len(tensors) == 3 + 12 and str(r.fields["general.architecture"].contents()) == "qwen3moe"
    q = tensors["blk.0.attn_q.weight"]
    want = dequantize(c.tensor("model.layers.0.self_attn.q_proj.weight"))
    np.testing.assert_array_equal(gguf.quants.dequantize(q.data, q.tensor_type).reshape(want.shape), want)
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    layout = c.expert_layouts["model.layers.0.mlp"]
    stacked = gguf.quants.dequantize(gate.data, gate.tensor_type)
    assert stacked.shape[0] == layout.num_experts
    _, off, n = c.expert_range("model.layers.0.mlp", 3)
    blob = np.fromfile(c.expert_file("model.layers.0.mlp").path, np.uint8, count=n, offset=off)
    np.testing.assert_array_equal(stacked[3], dequantize(layout.unpack(blob)["gate_proj"]))
    small = synthetic_moe.write_container(tmp_path / "s", "qwen3-30b-a3b", progress=False, layers=1,
                                          width_divisor=16, vocab=512)
    with pytest.raises(ColibriError, match="smaller than SmolLM2's tokenizer"):
        gguf_synthetic.write_gguf(tmp_path / "s.gguf", small)
    assert not (tmp_path / "s.gguf").exists()


def _hybrid_twin_dims(meta: dict, arch: str, layer: int, full: bool) -> dict[str, tuple]:
    """GGUF dims (innermost first) of one layer's tensors as llama.cpp's loader creates them from
    the metadata (src/models/qwen35moe.cpp, qwen3next.cpp load_arch_tensors)."""
    g = lambda k: int(meta[f"{arch}.{k}"])
    d, h, kv, dh = g("embedding_length"), g("attention.head_count"), g("attention.head_count_kv"), g("attention.key_length")
    s, hk, hv, inner = g("ssm.state_size"), g("ssm.group_count"), g("ssm.time_step_rank"), g("ssm.inner_size")
    e, i, i_sh = g("expert_count"), g("expert_feed_forward_length"), g("expert_shared_feed_forward_length")
    b = f"blk.{layer}"
    dims = {f"{b}.attn_norm.weight": (d,), f"{b}.post_attention_norm.weight": (d,),
            f"{b}.ffn_gate_inp.weight": (d, e), f"{b}.ffn_gate_inp_shexp.weight": (d, 1),
            f"{b}.ffn_gate_exps.weight": (d, i, e), f"{b}.ffn_up_exps.weight": (d, i, e),
            f"{b}.ffn_down_exps.weight": (i, d, e), f"{b}.ffn_gate_shexp.weight": (d, i_sh),
            f"{b}.ffn_up_shexp.weight": (d, i_sh), f"{b}.ffn_down_shexp.weight": (i_sh, d)}
    if full:
        dims.update({f"{b}.attn_q.weight": (d, 2 * h * dh), f"{b}.attn_k.weight": (d, kv * dh),
                     f"{b}.attn_v.weight": (d, kv * dh), f"{b}.attn_output.weight": (h * dh, d),
                     f"{b}.attn_q_norm.weight": (dh,), f"{b}.attn_k_norm.weight": (dh,)})
    else:
        dims.update({f"{b}.attn_qkv.weight": (d, 2 * hk * s + inner), f"{b}.attn_gate.weight": (d, inner),
                     f"{b}.ssm_conv1d.weight": (g("ssm.conv_kernel"), 2 * hk * s + inner),
                     f"{b}.ssm_dt.bias": (hv,), f"{b}.ssm_a": (hv,), f"{b}.ssm_norm.weight": (s,),
                     f"{b}.ssm_out.weight": (inner, d)})
        if arch == "qwen35moe":
            dims.update({f"{b}.ssm_beta.weight": (d, hv), f"{b}.ssm_alpha.weight": (d, hv)})
        else:
            dims[f"{b}.ssm_ba.weight"] = (d, 2 * hv)
    return dims


@pytest.mark.parametrize("preset, arch", [("qwen3.6-35b-a3b", "qwen35moe"), ("qwen3-next-80b-a3b", "qwen3next")])
def test_hybrid_twin_is_the_layout_llama_cpp_loads(tmp_path, preset, arch):
    """A Gated DeltaNet hybrid slice (two value heads per key head) as its GGUF twin: exactly the
    tensor names of gguf-py's list for the arch, the dims llama.cpp's loader asks of them, the
    metadata keys it reads, and the converter's transforms on the weights (1 + w norms,
    ssm_a = -exp(A_log); qwen35moe's value heads tiled, qwen3next's in_proj_qkvz split).
    bench/io/gguf_twin_logits.py runs llama.cpp on it."""
    import gguf
    from tools import gguf_synthetic

    from colibri.formats.qtensor import dequantize
    from colibri.io.container import Container
    from colibri.io.gguf.reader import _metadata

    model = synthetic_moe.write_container(tmp_path / "m", preset, progress=False, layers=4,
                                          width_divisor=8, vocab=49152)
    r = gguf.GGUFReader(str(gguf_synthetic.write_gguf(tmp_path / "m.gguf", model)))
    meta = _metadata(r)
    c = Container(model)
    cfg = c.config
    assert meta["general.architecture"] == arch
    K = gguf.Keys
    want_meta = {K.LLM.BLOCK_COUNT: 4, K.LLM.EMBEDDING_LENGTH: cfg["hidden_size"],
                 K.Attention.HEAD_COUNT: cfg["num_attention_heads"], K.Attention.HEAD_COUNT_KV: cfg["num_key_value_heads"],
                 K.Attention.KEY_LENGTH: cfg["head_dim"], K.LLM.EXPERT_COUNT: cfg["num_experts"],
                 K.LLM.EXPERT_USED_COUNT: cfg["num_experts_per_tok"],
                 K.LLM.EXPERT_FEED_FORWARD_LENGTH: cfg["moe_intermediate_size"],
                 K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: cfg["shared_expert_intermediate_size"],
                 K.SSM.CONV_KERNEL: cfg["linear_conv_kernel_dim"], K.SSM.STATE_SIZE: cfg["linear_key_head_dim"],
                 K.SSM.GROUP_COUNT: cfg["linear_num_key_heads"], K.SSM.TIME_STEP_RANK: cfg["linear_num_value_heads"],
                 K.SSM.INNER_SIZE: cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"],
                 K.LLM.FULL_ATTENTION_INTERVAL: 4, K.Rope.DIMENSION_COUNT: cfg["head_dim"] // 4,
                 "{arch}.attention.recurrent_layers": [True, True, True, False]}
    if arch == "qwen35moe":  # the loader requires the M-RoPE sections
        want_meta[K.Rope.DIMENSION_SECTIONS] = [11, 11, 10, 0]
    for key, value in want_meta.items():
        assert meta[key.format(arch=arch)] == value, key
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    assert hv == 2 * hk  # the value-head reorder is exercised

    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]}
    tensors = {t.name: t for t in r.tensors}
    for name in tensors:
        stem = name if name.endswith("ssm_a") else name.rpartition(".")[0]
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", stem) in allowed, name
    want_dims = {"token_embd.weight": (cfg["hidden_size"], 49152), "output.weight": (cfg["hidden_size"], 49152),
                 "output_norm.weight": (cfg["hidden_size"],)}
    for i in range(4):
        want_dims.update(_hybrid_twin_dims(meta, arch, i, full=i == 3))
    assert {n: tuple(int(x) for x in t.shape) for n, t in tensors.items()} == want_dims

    def values(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))

    src = lambda n: c.tensor(f"model.layers.{n}")
    tiled = gguf_synthetic.tiled_order(hk, hv // hk, cfg["linear_value_head_dim"])
    np.testing.assert_array_equal(values("blk.0.attn_norm.weight"), np.float32(1) + src("0.input_layernorm.weight"))
    np.testing.assert_array_equal(values("blk.3.attn_q_norm.weight"), np.float32(1) + src("3.self_attn.q_norm.weight"))
    np.testing.assert_array_equal(values("blk.0.ssm_norm.weight"), src("0.linear_attn.norm.weight"))
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key, conv = 2 * hk * dk, src("0.linear_attn.conv1d.weight").q.reshape(-1, cfg["linear_conv_kernel_dim"])
    a_log = -np.exp(src("1.linear_attn.A_log"))
    if arch == "qwen3next":  # value heads stay grouped; in_proj_qkvz's groups split into [q | k | v] and z
        np.testing.assert_array_equal(values("blk.1.ssm_a"), a_log)
        np.testing.assert_array_equal(values("blk.0.ssm_conv1d.weight"), conv)
        qkvz = dequantize(src("2.linear_attn.in_proj_qkvz.weight")).reshape(hk, 2 * dk + 2 * hv // hk * dv, -1)
        vz = hv // hk * dv
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + vz], axis=1)
        qkv = np.concatenate([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hk * vz, -1)])
        np.testing.assert_array_equal(values("blk.2.attn_qkv.weight"), qkv)
        np.testing.assert_array_equal(values("blk.2.attn_gate.weight"), z.reshape(hk * vz, -1))
        return
    heads = gguf_synthetic.tiled_order(hk, hv // hk, 1)
    np.testing.assert_array_equal(values("blk.1.ssm_a"), a_log[heads])
    np.testing.assert_array_equal(values("blk.1.ssm_dt.bias"), src("1.linear_attn.dt_bias")[heads])
    out = dequantize(src("2.linear_attn.out_proj.weight"))
    np.testing.assert_array_equal(values("blk.2.ssm_out.weight"), out[:, tiled])
    z = dequantize(src("2.linear_attn.in_proj_z.weight"))
    np.testing.assert_array_equal(values("blk.2.attn_gate.weight"), z[tiled])
    np.testing.assert_array_equal(values("blk.0.ssm_conv1d.weight"), np.concatenate([conv[:key], conv[key:][tiled]]))
