"""Working memory of a prompt's forward pass, beyond the weights and the KV cache: what the plan
reserves so that a long prompt stays inside the memory budget.

Prefill runs in chunks of `prefill_chunk` tokens (engine.py) and attention over key blocks of a
bounded size (kernels/attention.py), so this is O(chunk x width) plus, for GLM-5's sparse
indexer, O(chunk x context) for the per-query token scores; never O(prompt x context).
"""
from __future__ import annotations

F32 = 4
# Bytes of scores one attention task holds at a time (kernels/attention.py): a few MB stays in
# L2/L3 while exp and the value product read it back, and bounds a prompt's attention memory
# whatever its length.
SCORE_BLOCK_BYTES = 4 << 20
MIN_BLOCK, MAX_BLOCK = 64, 2048
# Snapshots of a recurrent state kept per sequence (the newest prefill-chunk ends: prefix reuse,
# models/recurrent.py), each the size of the live state: the planner counts 1 + this many.
STATE_SNAPSHOTS = 4
# DeepSeek V4: positions of compressor rows a sequence keeps beyond two windows (models/deepseek_v4.py,
# V4Cache): how far back a cut (a rejected draft, a re-rendered end of a turn) stays exact.
V4_ROW_SLACK = 64


def key_block(rows: int, score_bytes: int = SCORE_BLOCK_BYTES, min_block: int = MIN_BLOCK,
              max_block: int = MAX_BLOCK) -> int:
    """Keys per block so that `rows` score rows of float32 fit `score_bytes`."""
    return int(min(max_block, max(min_block, score_bytes // (4 * max(rows, 1)))))


def prefill_workspace_bytes(config: dict, chunk: int, context: int, threads: int) -> int:
    """Peak bytes of one prefill chunk's temporaries for a model `config` (an upper estimate:
    bench/engine/long_prompt.py measures the real growth)."""
    L = max(1, min(chunk, context))
    D = int(config.get("hidden_size") or 0)
    H = int(config.get("num_attention_heads") or 1)
    shared = max(1, int(config.get("n_shared_experts") or config.get("num_shared_experts") or 1))
    inner = max(int(config.get("intermediate_size") or 0),
                int(config.get("moe_intermediate_size") or 0) * shared,
                int(config.get("shared_expert_intermediate_size") or 0))
    mla = bool(config.get("kv_lora_rank"))
    head_dim = int(config.get("head_dim") or (D // H if H else 0))
    qk_dim = int(config.get("qk_nope_head_dim") or 0) + int(config.get("qk_rope_head_dim") or 0) if mla else head_dim
    v_dim = int(config.get("v_head_dim") or 0) if mla else head_dim
    # residual stream, norms, fused q/k/v and its split, gate/up and their product, attention output
    activations = F32 * L * (6 * D + 3 * inner + 3 * H * max(qk_dim, v_dim))
    # a score block (and its exp) per thread in flight, plus every query row's softmax state
    attention = threads * 2 * SCORE_BLOCK_BYTES + 2 * F32 * L * H * (v_dim + 2)
    if mla:  # the expanded path holds one block of per-head k_nope and v
        attention += 2 * F32 * key_block(L * H) * H * qk_dim
    index = 0
    if config.get("index_topk"):  # DSA: every query's score of every past token, and the selection
        index = (2 * F32 + 2) * L * context
    logits = 2 * F32 * int(config.get("vocab_size") or 0)
    return activations + attention + index + logits
