"""kimi_k25 (Kimi-K2.5 / K2.6) against transformers' Kimi_K25ForConditionalGeneration: convert
takes the wrapper's DeepSeek-V3 text_config, skips the vision tower and the projector, renames
`language_model.model.*` onto the decoder, and keeps compressed-tensors int4 experts
(pack-quantized, group 32, symmetric) int4 as q4_0 with not one value changed."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import save_file as save_torch
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

from colibri.errors import ColibriError
from colibri.formats.qtensor import dequantize
from colibri.io.compressed_tensors import from_q4_0_values
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.plan import analyze_model
from harness import check_against_transformers, make_hf_model, prompts_for

TEXT = dict(model_type="kimi_k2", vocab_size=140, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=64,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=3, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 1, "beta_slow": 1})
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
CASES = {"bf16_experts": {}, "int4_experts": {}}
MODEL = Kimi_K25ForConditionalGeneration
# compressed-tensors' quantization_config as Kimi-K2-Thinking / K2.5 ship it (here the shared expert packed too)
QUANTIZATION = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                              "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                          "strategy": "group", "group_size": 32,
                                                          "dynamic": False}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}
# what checkpoint_as_int4 packs: the routed experts as released, and the shared expert too (so a
# dense int4 matrix is converted as well)
_PACKED = re.compile(r"\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight$")


def config(case: str) -> Kimi_K25Config:
    return Kimi_K25Config(text_config=dict(TEXT), vision_config=dict(VISION), projection_hidden_size=32,
                          tie_word_embeddings=False)


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 131


def prepare(case: str):
    def run(model):
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
        if case == "int4_experts":  # the experts on compressed-tensors' int4 grid: q * scale
            g = torch.Generator().manual_seed(case_seed(case))
            for name, p in model.named_parameters():
                if ".experts." in name or ".shared_experts." in name:
                    p.copy_(int4_grid(p.shape, g))
    return run


def int4_grid(shape, g) -> torch.Tensor:
    """Random q in -8..7 times a bf16 scale per group of 32 inputs; each group holds a -8, so its
    scale is amax / 8 exactly (how checkpoint_as_int4 reads it back)."""
    *lead, cols = shape
    q = torch.randint(-8, 8, (*lead, cols // 32, 32), generator=g)
    q[..., 0] = -8
    scale = (0.005 + 0.02 * torch.rand((*lead, cols // 32, 1), generator=g)).to(torch.bfloat16).float()
    return (q * scale).reshape(shape)


def checkpoint_as_int4(hf_dir, out_dir):
    """The saved checkpoint with its experts as compressed-tensors int4 (weight_packed,
    weight_scale in bf16, weight_shape), names as the released checkpoints spell them
    (`language_model.model.layers`), quantization_config in the text config."""
    out_dir.mkdir()
    state = load_numpy(str(hf_dir / "model.safetensors"))
    packed = {}
    for name, w in state.items():
        name = name.replace("language_model.model.blocks.", "language_model.model.layers.")
        if not _PACKED.search(name):
            packed[name] = w
            continue
        rows, cols = w.shape
        groups = w.reshape(rows, cols // 32, 32)
        scale = np.abs(groups).max(axis=2) / np.float32(8)
        q = np.rint(groups / scale[:, :, None]).astype(np.int64).reshape(rows, cols)
        assert np.array_equal((q.reshape(rows, cols // 32, 32) * scale[:, :, None]).reshape(rows, cols), w)
        base = name[: -len(".weight")]
        packed[base + ".weight_packed"], packed[base + ".weight_shape"] = from_q4_0_values(q, scale)
        packed[base + ".weight_scale"] = torch.from_numpy(scale).to(torch.bfloat16)  # exact: bf16 values
    save_torch({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in packed.items()},
               str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["text_config"].update(model_type="kimi_k2", quantization_config=QUANTIZATION)  # as released
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kimi_k25_matches_transformers(tmp_path, case, bits):
    seed = case_seed(case)
    source = (lambda hf: checkpoint_as_int4(hf, tmp_path / "int4")) if case == "int4_experts" else None
    engine = check_against_transformers(MODEL, config(case), tmp_path, seed, bits, prompts_for(140, seed),
                                        prepare=prepare(case), convert_source=source)
    assert engine.model.args.model_type == ("kimi_k2" if source else "deepseek_v3")  # text_config's


def test_convert_takes_the_language_model_and_keeps_int4_experts(tmp_path, capfd):
    hf = make_hf_model(MODEL, config("int4_experts"), 5, tmp_path / "hf", prepare=prepare("int4_experts"))
    src = checkpoint_as_int4(hf, tmp_path / "int4")
    capfd.readouterr()  # transformers' own progress lines
    out = convert(src, tmp_path / "c", bits=4, progress=False)
    err = capfd.readouterr().err
    assert "skipping the vision tower" in err and "multimodal projector" in err and len(err.strip().splitlines()) == 1
    c = Container(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and "quantization_config" not in cfg and "vision_config" not in cfg
    assert not [n for n in c.manifest["tensors"] if "vision" in n or "projector" in n or "language_model" in n]
    assert c.has("model.layers.1.mlp.gate.e_score_correction_bias") and c.has("lm_head.weight")
    shared = c.tensor("model.layers.1.mlp.shared_experts.down_proj.weight")
    assert shared.scheme == "q4_0"
    assert np.array_equal(dequantize(shared), load_numpy(str(hf / "model.safetensors"))[
        "language_model.model.blocks.1.mlp.shared_experts.down_proj.weight"])
    state = load_numpy(str(hf / "model.safetensors"))
    layout = c.expert_layouts["model.layers.1.mlp"]
    f = c.expert_file("model.layers.1.mlp")
    for e in range(8):
        expert = layout.unpack(np.array(f.raw(f"model.layers.1.mlp.experts.{e}")))
        for proj, t in expert.items():
            assert t.scheme == "q4_0"  # int4 as shipped, not requantized
            want = state[f"language_model.model.blocks.1.mlp.experts.{e}.{proj}.weight"]
            assert np.array_equal(dequantize(t), want), (e, proj)


@pytest.mark.parametrize("field,value", [("format", "float-quantized"), ("group_size", 128), ("symmetric", False)])
def test_other_compressed_tensors_layouts_are_refused(tmp_path, field, value):
    hf = make_hf_model(MODEL, config("int4_experts"), 6, tmp_path / "hf", prepare=prepare("int4_experts"))
    src = checkpoint_as_int4(hf, tmp_path / "int4")
    cfg = json.loads((src / "config.json").read_text())
    q = cfg["text_config"]["quantization_config"]
    if field == "format":
        q["format"] = value
    else:
        q["config_groups"]["group_0"]["weights"][field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ColibriError, match=field):
        convert(src, tmp_path / "c", bits=4, progress=False)


def test_plan_sizes_the_checkpoint_as_convert_writes_it(tmp_path):
    """`colibri plan` on the released form (wrapper config, int4 experts, vision tower) sizes what
    `colibri convert --bits 4` keeps: the language model, the experts at q4_0."""
    hf = make_hf_model(MODEL, config("int4_experts"), 7, tmp_path / "hf", prepare=prepare("int4_experts"))
    src = checkpoint_as_int4(hf, tmp_path / "int4")
    estimated = analyze_model(src)
    converted = analyze_model(convert(src, tmp_path / "c", bits=4, progress=False))
    assert estimated.kind == "hf" and estimated.model_type == converted.model_type == "kimi_k2"
    assert [(l.prefix, l.num_experts, l.expert_bytes) for l in estimated.expert_layers] == \
        [(l.prefix, l.num_experts, l.expert_bytes) for l in converted.expert_layers]
    assert estimated.dense_bytes == converted.dense_bytes
    assert estimated.dense_bytes_per_token == converted.dense_bytes_per_token
