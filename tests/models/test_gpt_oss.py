"""gpt_oss against transformers' GptOssForCausalLM (attention sinks, sliding-window layers over
prompts longer than the window, q/k/v/o biases, router bias, expert biases, the clamped
SwiGLU), with float experts and with MXFP4 experts as the released checkpoints store them
(`*_blocks` / `*_scales`), which convert keeps as MXFP4: their values must be transformers' own
dequantization (integrations/mxfp4.py) bit for bit."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import check_against_transformers, prompts_for, requantized_checkpoint
from safetensors.torch import load_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor, dequantize, quantize
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.io.gpt_oss_experts import mxfp4_rows
from colibri.models import gpt_oss

CASES = {
    # the released checkpoints' rope (yarn x32, truncate=False) and GptOssConfig's layer order
    "yarn_sliding_first": {"num_local_experts": 4, "num_experts_per_tok": 2,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 16}},
    # the other layer order, plain rope, a low swiglu_limit so the clamps bite, top-1
    "full_first_clamped": {"num_local_experts": 4, "num_experts_per_tok": 1, "swiglu_limit": 0.3,
                           "layer_types": ["full_attention", "sliding_attention"],
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}
MODEL = GptOssForCausalLM
PROMPT_LENGTHS = (1, 5, 23)  # 23 and the 32 tokens generated after it: past the window of 8


def config(case: str) -> GptOssConfig:
    return GptOssConfig(vocab_size=130, num_hidden_layers=2, hidden_size=64, intermediate_size=64, head_dim=16,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        max_position_embeddings=512, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 91


def ocp_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float experts [E, in, out] (transformers' layout) -> OCP MXFP4 blocks uint8
    [E, out, in/32, 16] and scales [E, out, in/32], as the released checkpoints store them:
    quantized by colibri's MXFP4 quantizer, its ggml bytes unpacked into OCP order (the
    inverse of mxfp4_rows)."""
    E, n_in, n_out = w.shape
    G = n_in // 32
    blocks, scales = np.empty((E, n_out, G, 16), np.uint8), np.empty((E, n_out, G), np.uint8)
    for e in range(E):
        q = quantize(np.ascontiguousarray(w[e].T.numpy(), np.float32), "mxfp4").q.reshape(n_out, G, 17)
        qs = q[..., 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # ggml: value j low, j + 16 high
        blocks[e] = codes[..., 0::2] | (codes[..., 1::2] << 4)  # OCP: value 2j low, 2j + 1 high
        scales[e] = q[..., 0]
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def to_mxfp4_checkpoint(hf_dir: Path) -> Path:
    """Rewrite the saved checkpoint's experts as MXFP4 (`*_blocks`, `*_scales`, and config.json's
    quantization_config) in place; returns a float checkpoint of the same values, dequantized
    by transformers' convert_moe_packed_tensors, for transformers to load as the reference."""
    path = hf_dir / "model.safetensors"
    state = load_file(str(path))
    reference = dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = ocp_mxfp4(state.pop(name))
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return requantized_checkpoint(hf_dir, state, reference,
                                  {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]})


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_oss_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed, PROMPT_LENGTHS))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
def test_gpt_oss_mxfp4_experts_match_transformers(tmp_path, bits):
    case = "yarn_sliding_first"
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed, PROMPT_LENGTHS),
                               after_save=to_mxfp4_checkpoint)


def test_mxfp4_experts_dequantize_as_transformers(tmp_path):
    """convert keeps MXFP4 experts as ggml MXFP4 blocks (a byte repack) whose values are
    transformers' dequantization exactly, gate and up de-interleaved, biases split the same way."""
    cfg = config("yarn_sliding_first")
    torch.manual_seed(0)
    model = MODEL(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    ref_dir = to_mxfp4_checkpoint(hf_dir)
    reference = load_file(str(ref_dir / "model.safetensors"))
    c = Container(convert(hf_dir, tmp_path / "c", bits=4, progress=False))
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        layout, f = c.expert_layouts[prefix], c.expert_file(prefix)
        gate_up, down = (reference[f"{prefix}.experts.{p}"].numpy() for p in ("gate_up_proj", "down_proj"))
        bias = reference[f"{prefix}.experts.gate_up_proj_bias"].numpy()
        for e in range(cfg.num_local_experts):
            ew = layout.unpack(np.array(f.raw(f"{prefix}.experts.{e}")))
            assert {t.scheme for t in ew.values()} == {"mxfp4"}
            assert np.array_equal(dequantize(ew["gate_proj"]), gate_up[e][:, 0::2].T)
            assert np.array_equal(dequantize(ew["up_proj"]), gate_up[e][:, 1::2].T)
            assert np.array_equal(dequantize(ew["down_proj"]), down[e].T)
        assert np.array_equal(c.tensor(f"{prefix}.experts.gate_proj.bias").q, bias[:, 0::2])
        assert np.array_equal(c.tensor(f"{prefix}.experts.up_proj.bias").q, bias[:, 1::2])


def test_mxfp4_rows_repack_is_lossless():
    """Random OCP blocks (every byte value, a range of exponents) repack to ggml MXFP4 bytes
    that dequantize to transformers' values."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 32, 16), dtype=np.uint8)
    blocks[0, :16] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scales = rng.integers(100, 150, (3, 32), dtype=np.uint8)
    ours = dequantize(QTensor("mxfp4", (3, 32 * 32), mxfp4_rows(blocks, scales)))
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks[None]), torch.from_numpy(scales[None]),
                                        dtype=torch.float32)[0].T.numpy()
    assert np.array_equal(ours, theirs)


class _Sinks(torch.nn.Module):
    """What transformers' eager_attention_forward reads off its attention module."""

    def __init__(self, sinks: torch.Tensor, groups: int):
        super().__init__()
        self.sinks, self.num_key_value_groups = torch.nn.Parameter(sinks), groups


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("pos0, L", [(0, 19), (11, 6), (17, 1)])
def test_sink_attention_matches_transformers_in_query_blocks(monkeypatch, window, pos0, L):
    """sink_attention against transformers' eager_attention_forward (sinks, the sliding mask),
    with the score budget that holds all queries at once and one that cuts them into blocks."""
    rng = np.random.default_rng(L + pos0)
    H, KV, Dh, N = 4, 2, 8, pos0 + L
    q = rng.standard_normal((L, H, Dh), dtype=np.float32)
    k, v = (rng.standard_normal((KV, N, Dh), dtype=np.float32) for _ in range(2))
    sinks = rng.standard_normal(H, dtype=np.float32)
    qpos, kpos = np.arange(pos0, N)[:, None], np.arange(N)[None, :]
    visible = (kpos <= qpos) & (True if window is None else kpos > qpos - window)
    mask = torch.from_numpy(np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32))[None, None]
    scale = np.float32(Dh ** -0.5)
    ref, _ = eager_attention_forward(_Sinks(torch.from_numpy(sinks), H // KV),
                                     torch.from_numpy(q).transpose(0, 1)[None], torch.from_numpy(k)[None],
                                     torch.from_numpy(v)[None], mask, float(scale))
    ref = ref[0].reshape(L, H * Dh).detach().numpy()
    whole = gpt_oss.sink_attention(q, k, v, pos0, scale, sinks, window)
    monkeypatch.setattr(gpt_oss, "SCORE_ELEMENTS", H * N * 2)  # two queries a block
    blocked = gpt_oss.sink_attention(q, k, v, pos0, scale, sinks, window)
    np.testing.assert_allclose(whole, ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(blocked, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("field,value", [("layer_types", ["chunked_attention", "full_attention"]),
                                         ("layer_types", ["full_attention"]), ("sliding_window", 0),
                                         ("num_experts_per_tok", 9), ("hidden_act", "gelu")])
def test_unimplemented_config_fields_are_rejected(field, value):
    cfg = {**config("yarn_sliding_first").to_dict(), field: value}
    with pytest.raises(ColibriError, match=field):
        gpt_oss.ModelArgs.from_dict(cfg)


def test_mxfp4_is_refused_for_other_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                      "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ColibriError, match="quant_method='mxfp4'"):
        convert(tmp_path, tmp_path / "c", bits=4, progress=False)
