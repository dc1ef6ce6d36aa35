"""FP8 checkpoints (float8_e4m3fn weights + 128x128 `weight_scale_inv`, as DeepSeek-V3 / Kimi-K2 /
GLM ship them): dequantization equals the reference block dequantization bit for bit (whole or
in row chunks), `convert` goes from FP8 straight to the container, its peak RSS stays below two
shards' size, and tools/synthetic_fp8.py's DeepSeek-V3-shaped checkpoint converts and decodes."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert, scheme_for
from colibri.io.fp8 import E4M3FN, dequantize_fp8
from colibri.formats.qtensor import dequantize, quantize

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
MiB = 1 << 20
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def random_fp8(rng, shape) -> torch.Tensor:
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
    return torch.from_numpy(raw).view(torch.float8_e4m3fn)


def reference_dequant(w: torch.Tensor, scale_inv: torch.Tensor) -> np.ndarray:
    """The block dequantization as DeepSeek's weight_dequant does it, in torch."""
    rows, cols = w.shape
    s = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w.to(torch.float32) * s).numpy()


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a float matrix to float8_e4m3fn with one scale_inv per 128x128 block."""
    rows, cols = w.shape
    nb = (-(-rows // BLOCK), -(-cols // BLOCK))
    scale = torch.empty(nb, dtype=torch.float32)
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_e4m3fn_table_matches_torch():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    np.testing.assert_array_equal(E4M3FN, every)  # NaN codes compare equal in assert_array_equal


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (5, 700)])
def test_block_dequantization_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    w = random_fp8(rng, shape)
    blocks = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    scales = torch.from_numpy(rng.uniform(1e-4, 1e-2, size=blocks).astype(np.float32))
    got = dequantize_fp8(w.view(torch.uint8).numpy(), scales.numpy(), (BLOCK, BLOCK))
    np.testing.assert_array_equal(got, reference_dequant(w, scales))


def test_row_chunks_equal_whole_tensor(tmp_path):
    """Slabs and row chunks that cross each other and the 128-row scale blocks give the values
    of the whole-tensor path, and convert's chunked quantization equals quantizing it whole."""
    from colibri.io import convert as conv
    from colibri.io.fp8 import CheckpointReader
    from colibri.io.safetensors_io import SafetensorsFile

    rng = np.random.default_rng(7)
    tensors = {"a.weight": random_fp8(rng, (300, 200)),
               "a.weight_scale_inv": torch.from_numpy(rng.uniform(1e-3, 1e-2, size=(3, 2)).astype(np.float32)),
               "d.weight": random_fp8(rng, (130, 256)),
               "d.weight_scale_inv": torch.from_numpy(rng.uniform(1e-3, 1e-2, size=(2, 2)).astype(np.float32)),
               "b.weight": torch.randn(37, 64).to(torch.bfloat16), "c.weight": torch.randn(5, 70)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    reader = CheckpointReader([f], (BLOCK, BLOCK))
    for name in ("a.weight", "d.weight", "b.weight", "c.weight"):
        whole = reader.float32(f, name)
        for max_elements, slab_bytes in ((1, 1), (450, 3000), (1000, 1 << 20), (1 << 16, 16 << 20)):
            chunks = list(reader.row_chunks(f, name, max_elements, slab_bytes))
            assert [r for r, _ in chunks] == list(np.cumsum([0] + [len(c) for _, c in chunks[:-1]]))
            np.testing.assert_array_equal(np.concatenate([c for _, c in chunks]), whole, err_msg=name)
        for scheme in ("int4_g64", "q8_0", "f32"):
            if whole.shape[1] % {"int4_g64": 64, "q8_0": 32, "f32": 1}[scheme]:
                continue
            got, want = conv._quantized(reader, f, name, scheme), quantize(whole, scheme)
            assert got.scheme == want.scheme and got.shape == want.shape
            for part, a in want.parts().items():
                np.testing.assert_array_equal(got.parts()[part], a, err_msg=f"{name} {scheme} {part}")


def tiny_fp8_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny DeepSeek-V3 saved as FP8 the way the real checkpoints are: every linear weight FP8
    (embeddings, lm_head, norms, router and its bias stay as they were), split over two shards,
    with one weight's scale stored in the other shard. Returns the directory and the reference
    float32 value of every tensor."""
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=192, intermediate_size=256, moe_intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64,
                           kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                           first_k_dense_replace=1, max_position_embeddings=128)
    torch.manual_seed(0)
    src = tmp_path / "bf16"
    DeepseekV3ForCausalLM(cfg).save_pretrained(src)
    state = load_file(str(src / "model.safetensors"))
    out, expected = {}, {}
    for name, t in state.items():
        keep = t.ndim != 2 or any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.weight"))
        if keep:
            out[name], expected[name] = t, t.numpy()
        else:
            q, s = to_fp8(t)
            out[name], out[name + "_scale_inv"] = q, s
            expected[name] = reference_dequant(q, s)
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    names = sorted(out)
    moved = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"  # its weight lives in shard 1
    first = [n for n in names if n.startswith("model.layers.0.") and n != moved]
    save_file({n: out[n] for n in first}, str(fp8_dir / "model-00001-of-00002.safetensors"))
    save_file({n: out[n] for n in names if n not in first}, str(fp8_dir / "model-00002-of-00002.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return fp8_dir, expected


def test_convert_fp8_checkpoint_equals_reference_dequantization(tmp_path):
    src, expected = tiny_fp8_checkpoint(tmp_path)
    for bits in (32, 4):
        c = Container(convert(src, tmp_path / f"c{bits}", bits=bits, progress=False))
        assert "quantization_config" not in c.config  # the container's weights are not FP8
        experts = {p: [layout.unpack(np.array(c.expert_file(p).raw(f"{p}.experts.{e}")))
                       for e in range(layout.num_experts)] for p, layout in c.expert_layouts.items()}
        for name, ref in expected.items():
            if ".experts." in name:
                prefix, rest = name.split(".experts.")
                e, proj = rest.split(".")[:2]
                got = experts[prefix][int(e)][proj]
            else:
                got = c.tensor(name)
            want = ref if bits == 32 or ref.ndim != 2 else dequantize(quantize(ref, scheme_for(name, ref.shape, bits)))
            value = got if isinstance(got, np.ndarray) else dequantize(got)
            np.testing.assert_array_equal(value.reshape(ref.shape), want, err_msg=f"{name} at --bits {bits}")


@pytest.mark.parametrize("change,field", [
    ({"quantization_config": {**FP8_CONFIG, "quant_method": "gptq"}}, "quantization_config.quant_method"),
    ({"quantization_config": {**FP8_CONFIG, "weight_block_size": None}}, "quantization_config.weight_block_size"),
    ({"quantization_config": {**FP8_CONFIG, "fmt": "e5m2"}}, "quantization_config.fmt"),
    ({"quantization_config": {**FP8_CONFIG, "scale_fmt": "e4m3"}}, "quantization_config.scale_fmt"),
    ({"quantization_config": {**FP8_CONFIG, "expert_dtype": "int4"}}, "quantization_config.expert_dtype"),
])
def test_unsupported_quantization_is_rejected(tmp_path, change, field):
    src, _ = tiny_fp8_checkpoint(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ColibriError, match=field.replace(".", r"\.")):
        convert(src, tmp_path / "c", bits=4, progress=False)


def test_missing_scale_is_an_error(tmp_path):
    src, _ = tiny_fp8_checkpoint(tmp_path)
    shard = src / "model-00002-of-00002.safetensors"
    state = load_file(str(shard))
    del state["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(state, str(shard))
    with pytest.raises(ColibriError, match="o_proj.weight_scale_inv"):
        convert(src, tmp_path / "c", bits=4, progress=False)


# ------------------------------------------------------------------ bounded memory

CHILD = """
import json, sys
import numpy as np
from colibri.io.convert import convert
from colibri.kernels import quantize
quantize(np.ones((64, 64), np.float32), "int4_g64")

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

base = status("VmRSS:")
convert(sys.argv[1], sys.argv[2], bits=4, progress=False)
print(json.dumps({"base": base, "peak": status("VmHWM:")}))
"""


def big_fp8_checkpoint(path: Path) -> list[int]:
    """A DeepSeek-V3-shaped FP8 checkpoint of ~300 MB: one shard per decoder layer (~77 MB for an
    MoE layer, as in the real checkpoints most bytes are routed experts). Returns shard sizes."""
    d, inter, moe, experts, layers = 1024, 2048, 512, 48, 4
    rng = np.random.default_rng(0)
    cfg = dict(model_type="deepseek_v3", vocab_size=2048, hidden_size=d, intermediate_size=inter,
               moe_intermediate_size=moe, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
               q_lora_rank=512, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
               n_routed_experts=experts, n_shared_experts=1, n_group=1, topk_group=1, num_experts_per_tok=4,
               first_k_dense_replace=1, max_position_embeddings=4096, rope_theta=10000.0, hidden_act="silu",
               quantization_config=FP8_CONFIG)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))

    def fp8(shape):
        scale = rng.uniform(1e-3, 1e-2, size=(-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))).astype(np.float32)
        return random_fp8(rng, shape), torch.from_numpy(scale)

    sizes = []
    for i in range(layers):
        p = f"model.layers.{i}"
        mats = {f"{p}.self_attn.q_a_proj.weight": (512, d), f"{p}.self_attn.q_b_proj.weight": (8 * 96, 512),
                f"{p}.self_attn.kv_a_proj_with_mqa.weight": (256 + 32, d),
                f"{p}.self_attn.kv_b_proj.weight": (8 * 128, 256), f"{p}.self_attn.o_proj.weight": (d, 8 * 64)}
        if i == 0:
            mats.update({f"{p}.mlp.{n}.weight": s for n, s in
                         (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter)))})
        else:
            for e in [*range(experts), "shared"]:
                q = f"{p}.mlp.experts.{e}" if e != "shared" else f"{p}.mlp.shared_experts"
                mats.update({f"{q}.gate_proj.weight": (moe, d), f"{q}.up_proj.weight": (moe, d),
                             f"{q}.down_proj.weight": (d, moe)})
        tensors = {f"{p}.input_layernorm.weight": torch.ones(d), f"{p}.post_attention_layernorm.weight": torch.ones(d),
                   f"{p}.self_attn.q_a_layernorm.weight": torch.ones(512),
                   f"{p}.self_attn.kv_a_layernorm.weight": torch.ones(256)}
        if i > 0:
            tensors[f"{p}.mlp.gate.weight"] = torch.randn(experts, d) * 0.02
            tensors[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
        for name, shape in mats.items():
            tensors[name], tensors[name + "_scale_inv"] = fp8(shape)
        if i == 0:
            tensors.update({"model.embed_tokens.weight": torch.randn(2048, d).to(torch.bfloat16),
                            "lm_head.weight": torch.randn(2048, d).to(torch.bfloat16),
                            "model.norm.weight": torch.ones(d)})
        shard = path / f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(shard))
        sizes.append(shard.stat().st_size)
    return sizes


def test_fp8_conversion_peak_rss_below_two_shards(tmp_path):
    sizes = big_fp8_checkpoint(tmp_path / "fp8")
    assert max(sizes) > 64 * MiB and sum(sizes) > 3 * max(sizes)
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "fp8"), str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    grown = out["peak"] - out["base"]
    print(f"checkpoint {sum(sizes) / MiB:.0f} MiB in {len(sizes)} shards (largest {max(sizes) / MiB:.0f} MiB): "
          f"converter peak RSS {grown / MiB:.0f} MiB above its {out['base'] / MiB:.0f} MiB baseline")
    assert grown < 2 * max(sizes), f"peak RSS grew {grown / MiB:.0f} MiB; two shards are {2 * max(sizes) / MiB:.0f} MiB"
    c = Container(tmp_path / "c")
    assert c.manifest["tensors"]["model.layers.1.self_attn.o_proj.weight"]["scheme"] == "int4_g64"
    assert len(c.expert_layouts) == 3


# ------------------------------------------------------------------ tools/synthetic_fp8.py

def test_synthetic_deepseek_v3_fp8_checkpoint_converts_and_decodes(tmp_path):
    """tools/synthetic_fp8.py at reduced width (DeepSeek-V3 names, dtypes and block scales; one
    scale in another shard than its weight, an expert straddling two shards) converts, decodes,
    and every FP8 weight lands in the container as fp8 * scale_inv within int4 rounding."""
    from colibri import Engine
    from colibri.io.safetensors_io import SafetensorsFile

    src = tmp_path / "fp8"
    r = subprocess.run([sys.executable, "-m", "tools.synthetic_fp8",
                        str(src), "--layers", "2", "--experts", "4", "--width-divisor", "16", "--vocab", "1024",
                        "--shard-mb", "1", "--no-tokenizer"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count(" written (") == 2  # a progress line per layer
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK] and cfg["num_hidden_layers"] == 2
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 4
    where = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {p.name: SafetensorsFile(p) for p in src.glob("*.safetensors")}
    assert len(shards) > 2 and set(where.values()) == set(shards)
    assert all(n in shards[s].tensors for n, s in where.items())
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert where[o_proj] != where[o_proj + "_scale_inv"]
    assert any(len({where[f"model.layers.1.mlp.experts.{e}.{p}.weight"] for p in EXPERT_PROJS}) > 1 for e in range(4))
    dtypes = {n: shards[s].tensors[n].dtype for n, s in where.items()}
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.layers.1.mlp.gate.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    fp8_names = [n for n, d in dtypes.items() if d == "F8_E4M3"]
    assert len(fp8_names) == 2 * 5 + 3 + (4 + 1) * 3 and all(dtypes[n + "_scale_inv"] == "F32" for n in fp8_names)

    c = Container(convert(src, tmp_path / "c", bits=4, progress=False))
    layout = c.expert_layouts["model.layers.1.mlp"]
    experts = [layout.unpack(np.array(c.expert_file("model.layers.1.mlp").raw(f"model.layers.1.mlp.experts.{e}")))
               for e in range(4)]
    assert len({experts[e]["up_proj"].q.tobytes() for e in range(4)}) == 4  # every expert distinct
    for name in fp8_names:
        raw = shards[where[name]].raw(name)
        assert not np.isnan(E4M3FN[raw]).any()
        scale = shards[where[name + "_scale_inv"]].raw(name + "_scale_inv")
        rows, cols = raw.shape
        ref = E4M3FN[raw] * np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:rows, :cols]
        if ".experts." in name:
            e, proj = name.split(".experts.")[1].split(".")[:2]
            t = experts[int(e)][proj]
        else:
            t = c.tensor(name)
        got = dequantize(t)
        if t.scheme == "f32":
            np.testing.assert_array_equal(got, ref, err_msg=name)
            continue
        assert t.scheme == "int4_g64", name
        groups = ref.reshape(ref.shape[0], -1, 64)
        half_step = np.abs(groups).max(axis=2, keepdims=True) / 14  # int4 g64: |error| <= amax / 7 / 2
        err = np.abs(got.reshape(groups.shape) - groups)
        assert (err <= half_step * (1 + 1e-5) + 1e-12).all(), name

    engine = Engine.load(c.dir)
    out = engine.generate([1, 2, 3, 4], max_tokens=8, stop_at_eos=False).token_ids
    assert len(out) == 8 and all(0 <= t < 1024 for t in out)


def test_fp4_values_and_scales_as_deepseek_v4_ships_them(tmp_path):
    """E2M1 codes two a byte (value 2j low) with E8M0 scales per 32 dequantize to every code's
    value times its power of two, as transformers' Fp8Dequantize does; float scales that are
    not powers of two have no E8M0 form and are refused, naming the tensor."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from colibri.io.fp8 import CheckpointReader
    from colibri.io.safetensors_io import SafetensorsFile

    rng = np.random.default_rng(0)
    codes = torch.from_numpy(rng.integers(-128, 128, (4, 32), dtype=np.int8))   # 4 rows of 64 values
    exps = torch.from_numpy(rng.integers(120, 134, (4, 2), dtype=np.uint8))
    save_file({"x.weight": codes, "x.scale": exps.view(torch.float8_e8m0fnu),
               "y.weight": codes.clone(), "y.scale": torch.full((4, 2), 0.3)}, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    reader = CheckpointReader([f], (128, 128))
    assert reader.is_fp4(f, "x.weight") and reader.shape(f, "x.weight") == (4, 64) and reader.is_scale("x.scale")
    want = Fp8Dequantize(None)._dequantize_one(codes, exps.view(torch.float8_e8m0fnu), torch.float32).numpy()
    np.testing.assert_array_equal(reader.float32(f, "x.weight"), want)
    with pytest.raises(ColibriError, match="y.scale are not powers of two"):
        reader.fp4_parts(f, "y.weight")
