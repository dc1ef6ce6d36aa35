"""deepseek_v4 against transformers' DeepseekV4ForCausalLM: sliding-window, compressed sparse
(CSA: overlapping 4-token windows, the lightning indexer's top-k) and heavily compressed (HCA)
layers, mHC hyper-connections over several streams, hash-routed and score-routed MoE layers
with the clipped SwiGLU, attention sinks and the grouped output projection. Prompts and
generations run past the sliding window, past several compression windows and past more
CSA entries than the indexer keeps; the other checks (streamed experts, slots, drafts, bad
config fields) are in tests/test_deepseek_v4_cache.py."""
import numpy as np
import pytest
import torch
from harness import check_against_transformers, prompts_for, requantized_checkpoint
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

MODEL = DeepseekV4ForCausalLM
PROMPT_LENGTHS = (1, 5, 23)  # 23 + 32 generated: past the window (6), 13 CSA entries (top-3), 6 HCA

CASES = {
    # V4-Flash's choices at small widths: sqrt(softplus) scores, the first layer hash-routed, a
    # sliding layer, then CSA / HCA; a low swiglu_limit so the clips bite
    "flash_layout": {"scoring_func": "sqrtsoftplus", "hc_mult": 3, "swiglu_limit": 0.4,
                     "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention", "compressed_sparse_attention"],
                     "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]},
    # HCA first (DeepseekV4Config's default order), two hash layers, sigmoid scores, yarn on the
    # compressed layers' rope as the released configs set it
    "hca_first_yarn": {"scoring_func": "sigmoid", "hc_mult": 2, "swiglu_limit": 10.0,
                       "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                                       "sliding_attention", "compressed_sparse_attention"],
                       "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                           "beta_fast": 32, "beta_slow": 1}},
}


def config(case: str) -> DeepseekV4Config:
    return DeepseekV4Config(vocab_size=130, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                            num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8,
                            num_experts_per_tok=2, n_routed_experts=6,
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                            hc_sinkhorn_iters=6, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8,
                            index_head_dim=16, index_topk=3, max_position_embeddings=512, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 41


def routing_tables(model) -> None:
    """Buffers save_pretrained keeps but the random init leaves at zero: each token's hash
    experts (distinct, as in a real table), the routing correction bias."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            E, K = gate.num_experts, gate.top_k
            gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(gate.tid2eid.shape[0])]))
        else:
            gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=g) * 0.05)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_v4_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    engine = check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed, PROMPT_LENGTHS),
                                        prepare=routing_tables)
    kinds = [type(layer.attn.indexer).__name__ for layer in engine.model.layers]
    assert kinds.count("Indexer") == 2


# ----------------------------------------------------------------------------- the released checkpoints' formats
FP8_MODULES = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "shared_experts")


def e8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two at least x, as float8_e8m0fnu (what V4's scales are)."""
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0 ** -126)))).to(torch.float8_e8m0fnu)


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (float8_e4m3fn [R, C], E8M0 scales [ceil(R / 128), ceil(C / 128)])."""
    R, C = w.shape
    gr, gc = -(-R // block), -(-C // block)
    pad = torch.zeros(gr * block, gc * block)
    pad[:R, :C] = w
    amax = pad.reshape(gr, block, gc, block).abs().amax(dim=(1, 3))
    scale = e8m0(amax / 448.0)
    s = scale.to(torch.float32).repeat_interleave(block, 0).repeat_interleave(block, 1)[:R, :C]
    return (w / s).to(torch.float8_e4m3fn), scale


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, K] -> (int8 [R, K / 2]: E2M1 codes, value 2j in the low nibble; E8M0 [R, K / 32]),
    quantized by colibri's MXFP4 quantizer and unpacked from ggml's byte order."""
    from colibri.formats.qtensor import quantize

    R, K = w.shape
    q = quantize(np.ascontiguousarray(w.numpy(), np.float32), "mxfp4").q.reshape(R, K // 32, 17)
    qs = q[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)      # ggml: value j low, j + 16 high
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)          # V4 / OCP: value 2j low, 2j + 1 high
    return (torch.from_numpy(packed.reshape(R, K // 2).view(np.int8).copy()),
            torch.from_numpy(q[..., 0].copy()).view(torch.float8_e8m0fnu))


def to_release_checkpoint(hf_dir):
    """Rewrite the saved checkpoint as DeepSeek ships V4: attention projections and the shared
    expert in FP8 with 128x128 E8M0 block scales (`.scale`), routed experts in FP4 (E8M0 per 32),
    the rest as it was; returns a float checkpoint of the same values, dequantized by transformers'
    own Fp8Dequantize, for transformers to load as the reference."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    undo = Fp8Dequantize(None)._dequantize_one
    path = hf_dir / "model.safetensors"
    state = load_file(str(path))
    reference = dict(state)
    for name in [n for n in state if n.endswith(".weight") and state[n].dim() == 2]:
        w, base = state[name], name[: -len(".weight")]
        if ".experts." in name:
            q, scale = fp4_rows(w)
        elif any(f".{m}." in name for m in FP8_MODULES) and ".compressor." not in name:
            q, scale = fp8_block(w)
        else:
            continue
        state[name], state[f"{base}.scale"] = q, scale
        reference[name] = undo(q, scale, torch.float32)
    return requantized_checkpoint(hf_dir, state, reference, {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
        "expert_dtype": "fp4", "activation_scheme": "dynamic"})


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
def test_the_released_fp8_and_fp4_formats_match_transformers(tmp_path, bits):
    """FP8 weights dequantize as transformers does, FP4 experts are kept as MXFP4 (their values,
    never requantized), and the model then decodes as transformers on the same values."""
    case = "flash_layout"
    cfg, seed = config(case), case_seed(case)
    engine = check_against_transformers(MODEL, cfg, tmp_path, seed, bits,
                                        prompts_for(cfg.vocab_size, seed, PROMPT_LENGTHS),
                                        prepare=routing_tables, after_save=to_release_checkpoint)
    experts = engine.experts.layers["model.layers.1.mlp"][0]
    assert {t.scheme for t in experts.values()} == {"mxfp4"}
