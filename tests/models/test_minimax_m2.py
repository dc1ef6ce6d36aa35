"""minimax_m2 against transformers' MiniMaxM2ForCausalLM: q/k RMSNorm over all heads, partial
rotary (the checkpoint's rotary_dim), sigmoid routing with e_score_correction_bias and
renormalised top-k, block_sparse_moe / w1 w3 w2 checkpoint names renamed by convert."""
import json

import numpy as np
import pytest
import torch
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.formats.qtensor import dequantize
from colibri.model_types import checkpoint_name
from harness import check_against_transformers, make_hf_model, prompts_for

CASES = {
    "quarter_rotary": dict(hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=3, rotary_dim=4),
    "yarn_half_rotary": dict(hidden_size=64, intermediate_size=64, head_dim=32, num_attention_heads=4,
                             num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 5e6, "factor": 4.0,
                                              "original_max_position_embeddings": 64,
                                              "partial_rotary_factor": 0.5}),
}

MODEL = MiniMaxM2ForCausalLM


def random_bias(model):
    """The routing bias is zeros at init; large enough here to change which experts are picked."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))


def config(case: str) -> MiniMaxM2Config:
    return MiniMaxM2Config(vocab_size=150, num_hidden_layers=2, max_position_embeddings=256,
                           bos_token_id=1, eos_token_id=2, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 91


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_minimax_m2_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed),
                               prepare=random_bias)


def test_checkpoint_names_become_the_decoders(tmp_path):
    hf = make_hf_model(MODEL, config("quarter_rotary"), 5, tmp_path / "hf", prepare=random_bias)
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    c = Container(out)
    assert c.has("model.layers.1.mlp.gate.weight") and c.has("model.layers.1.mlp.gate.e_score_correction_bias")
    assert not c.has("model.layers.1.block_sparse_moe.gate.weight")
    assert sorted(c.expert_layouts) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert Engine.load(out).model.layers[1].mlp.bias.any()  # the routing bias, not the zeros default


def test_the_checkpoints_rotary_dim_sets_the_rotated_width(tmp_path):
    """MiniMax's own config.json says rotary_dim and rope_theta, not transformers' rope_parameters:
    the same model under either spelling gives the same logits."""
    hf = make_hf_model(MODEL, config("quarter_rotary"), 7, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    prompt = prompts_for(150, 7, lengths=(9,))[0]
    expected = Engine.load(out).logits(prompt)
    cfg = json.loads((out / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    (out / "config.json").write_text(json.dumps({**cfg, "rope_theta": theta, "rotary_dim": 4}))
    np.testing.assert_array_equal(Engine.load(out).logits(prompt), expected)


@pytest.mark.parametrize("field,value", [("attn_type_list", [1, 0]), ("shared_intermediate_size", 1024),
                                         ("qk_norm_type", "per_head"), ("scoring_func", "softmax"),
                                         ("sliding_window", 4096)])
def test_unimplemented_config_fields_are_rejected(tmp_path, field, value):
    hf = make_hf_model(MODEL, config("quarter_rotary"), 9, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field):
        Engine.load(out)


def to_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """float8_e4m3fn with one scale_inv per block x block, as MiniMax-M2's checkpoint stores its
    linear weights, and the float32 values they stand for."""
    rows, cols = w.shape
    nb = (-(-rows // block), -(-cols // block))
    scale = torch.empty(nb, dtype=torch.float32)
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    s = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q, scale, (q.to(torch.float32) * s).numpy()


def test_fp8_checkpoint_converts_under_the_decoders_names(tmp_path):
    """MiniMax-M2 ships FP8 (fmt "float8_e4m3fn", 128x128 weight_scale_inv) under its own names:
    every tensor lands under the decoder's name with the value its FP8 bytes and scales give."""
    from safetensors.torch import load_file, save_file

    hf = make_hf_model(MODEL, config("quarter_rotary"), 3, tmp_path / "hf", prepare=random_bias)
    state, out, expected = load_file(str(hf / "model.safetensors")), {}, {}
    for name, t in state.items():
        if t.ndim == 2 and not any(k in name for k in ("embed_tokens", "lm_head", "gate.weight")):
            out[name], out[name + "_scale_inv"], expected[name] = to_fp8(t)
        else:
            out[name], expected[name] = t, t.numpy()
    src = tmp_path / "fp8"
    src.mkdir()
    save_file(out, str(src / "model.safetensors"))
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    c = Container(convert(src, tmp_path / "c", bits=32, progress=False))
    experts = {p: [layout.unpack(np.array(c.expert_file(p).raw(f"{p}.experts.{e}"))) for e in range(layout.num_experts)]
               for p, layout in c.expert_layouts.items()}
    for name, want in expected.items():
        target = checkpoint_name("minimax_m2", name)
        if ".experts." in target:
            prefix, rest = target.split(".experts.")
            e, proj = rest.split(".")[:2]
            got = dequantize(experts[prefix][int(e)][proj])
        else:
            t = c.tensor(target)
            got = t if isinstance(t, np.ndarray) else dequantize(t)
        np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=name)
