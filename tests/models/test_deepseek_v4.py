"""deepseek_v4 against transformers' DeepseekV4ForCausalLM: sliding-window, compressed sparse
(CSA: overlapping 4-token windows, the lightning indexer's top-k) and heavily compressed (HCA)
layers, mHC hyper-connections over several streams, hash-routed and score-routed MoE layers
with the clipped SwiGLU, attention sinks and the grouped output projection. Prompts and
generations run past the sliding window, past several compression windows and past more
CSA entries than the indexer keeps; the other checks (streamed experts, slots, drafts, bad
config fields) are in tests/test_deepseek_v4_cache.py."""
import pytest
import torch
from harness import check_against_transformers, prompts_for
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
