"""The tensors (Hugging Face name, shape) a config.json implies, to size a model without its
weights: what `colibri plan` estimates from config.json alone, and how it sizes a layer kind that a
slice does not hold. Shapes follow the families in colibri/models (mla.py, moe.py,
qwen2_moe.py, qwen3_moe.py, ...); the names let io/convert.py's scheme_for pick each tensor's
quantization as `colibri convert` would."""
from __future__ import annotations

from colibri.errors import ColibriError

Tensor = tuple[str, tuple[int, ...]]

# first_k_dense_replace when a config leaves it out: the families' ModelArgs defaults
# (moe.GroupedMoEArgs: DeepseekV3Config's 3; glm4_moe: Glm4MoeConfig's 1).
_FIRST_DENSE_DEFAULT = {"deepseek_v3": 3, "kimi_k2": 3, "glm_moe_dsa": 3, "glm4_moe": 1, "kimi_linear": 1,
                        "glm5_next_text": 3}


def num_experts(config: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return 0


def expert_width(config: dict) -> int:
    """Intermediate size of one routed expert (Mixtral and OLMoE name it intermediate_size)."""
    return int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)


def mlp_kinds(config: dict, num_layers: int) -> list[str]:
    """'moe' or 'dense' for each of `num_layers` decoder layers, by the rule colibri's families
    apply (moe.GroupedMoEArgs.mlp_kind, qwen3_moe.ModelArgs.mlp_kind). A slice's config keeps
    mlp_layer_types only for the layers it holds: every layer past the list routes."""
    if not num_experts(config):
        return ["dense"] * num_layers
    types = config.get("mlp_layer_types")
    if types:
        return ["dense" if i < len(types) and types[i] == "dense" else "moe" for i in range(num_layers)]
    first_moe = config.get("first_k_dense_replace", _FIRST_DENSE_DEFAULT.get(config.get("model_type")))
    if first_moe is not None:
        return ["moe" if i >= (first_moe or 0) else "dense" for i in range(num_layers)]
    step = max(int(config.get("decoder_sparse_step") or 1), 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    return ["moe" if (i + 1) % step == 0 and i not in dense_only else "dense" for i in range(num_layers)]


def _need(config: dict, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ColibriError(f"config.json has no usable {key} ({value!r}): sizes cannot be estimated without it")
    return value


def outside_layers(config: dict) -> list[Tensor]:
    """Embedding, final norm and (unless tied) lm_head: counted once, whatever the layer count."""
    V, D = _need(config, "vocab_size"), _need(config, "hidden_size")
    out = [("model.embed_tokens.weight", (V, D)), ("model.norm.weight", (D,))]
    if _deepseek_v4(config):  # the last hyper-connection mix, collapsing the streams
        S = int(config.get("hc_mult") or 4)
        out += [("model.hc_head.hc_fn", (S, S * D)), ("model.hc_head.hc_base", (S,)), ("model.hc_head.hc_scale", (1,))]
    if not config.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (V, D)))
    return out


def _swiglu(prefix: str, D: int, inner: int) -> list[Tensor]:
    return [(f"{prefix}.gate_proj.weight", (inner, D)), (f"{prefix}.up_proj.weight", (inner, D)),
            (f"{prefix}.down_proj.weight", (D, inner))]


def default_indexer_types(cfg: dict, num_layers: int) -> list:
    """Per-layer "full"/"shared" from index_topk_pattern ("FSSF...") or index_topk_freq /
    index_skip_topk_offset, as GlmMoeDsaConfig and Glm5NextTextConfig derive it when
    indexer_types is absent (models/glm_moe_dsa.py, models/glm5_next.py)."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        try:
            return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        except KeyError:
            raise ColibriError(f"config field index_topk_pattern={pattern!r} is not implemented "
                               "(one 'F' or 'S' per layer)") from None
    freq = max(cfg.get("index_topk_freq", 1), 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _has_indexer(config: dict, i: int) -> bool:
    """Whether MLA layer i runs its own DSA indexer (a "shared" layer reuses the one before's)."""
    if not config.get("index_topk"):
        return False
    n = _need(config, "num_hidden_layers")
    kinds = config.get("indexer_types") or default_indexer_types(config, n)
    return i >= len(kinds) or kinds[i] != "shared"


def _mla_attention(config: dict, p: str, i: int) -> list[Tensor]:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5) of layer i, plus GLM-5's sparse
    indexer where it has one."""
    D, H = _need(config, "hidden_size"), _need(config, "num_attention_heads")
    r, R = int(config["kv_lora_rank"]), int(config.get("qk_rope_head_dim") or 0)
    Dn, Dv = int(config.get("qk_nope_head_dim") or 0), int(config.get("v_head_dim") or 0)
    q_rank = int(config.get("q_lora_rank") or 0)
    if q_rank:
        out = [(f"{p}.q_a_proj.weight", (q_rank, D)), (f"{p}.q_a_layernorm.weight", (q_rank,)),
               (f"{p}.q_b_proj.weight", (H * (Dn + R), q_rank))]
    else:
        out = [(f"{p}.q_proj.weight", (H * (Dn + R), D))]
    out += [(f"{p}.kv_a_proj_with_mqa.weight", (r + R, D)), (f"{p}.kv_a_layernorm.weight", (r,)),
            (f"{p}.kv_b_proj.weight", (H * (Dn + Dv), r)), (f"{p}.o_proj.weight", (D, H * Dv))]
    if _has_indexer(config, i):
        Hi, Di = int(config.get("index_n_heads") or 0), int(config.get("index_head_dim") or 0)
        i = f"{p}.indexer"
        out += [(f"{i}.wq_b.weight", (Hi * Di, q_rank or D)), (f"{i}.wk.weight", (Di, D)),
                (f"{i}.k_norm.weight", (Di,)), (f"{i}.k_norm.bias", (Di,)), (f"{i}.weights_proj.weight", (Hi, D))]
        if _glm5_next(config):  # the pools' gate projection and per-offset bias
            P = int(config.get("index_kpool") or 16)
            out += [(f"{i}.index_kpool_compress_ape", (P, Di)), (f"{i}.index_kpool_compress_gate", (Di, D))]
    return out


def indexer_width(config: dict) -> int:
    """Values per position and MLA layer that a DSA indexer caches: GLM-5's key; GLM-5.3-Flash's
    key and pool-gate row (models/glm5_next.PooledIndexer). 0 without an indexer."""
    if not config.get("index_topk"):
        return 0
    return int(config.get("index_head_dim") or 0) * (2 if _glm5_next(config) else 1)


def _gqa_attention(config: dict, p: str) -> list[Tensor]:
    D, H = _need(config, "hidden_size"), _need(config, "num_attention_heads")
    KV = int(config.get("num_key_value_heads") or H)
    Dh = int(config.get("head_dim") or D // H)
    out = [(f"{p}.q_proj.weight", (H * Dh, D)), (f"{p}.k_proj.weight", (KV * Dh, D)),
           (f"{p}.v_proj.weight", (KV * Dh, D)), (f"{p}.o_proj.weight", (D, H * Dh))]
    model_type = config.get("model_type")
    if model_type in ("olmoe", "minimax_m2"):  # q/k RMSNorm over all heads
        out += [(f"{p}.q_norm.weight", (H * Dh,)), (f"{p}.k_norm.weight", (KV * Dh,))]
    elif model_type == "qwen3_moe" or config.get("use_qk_norm"):  # per head
        out += [(f"{p}.q_norm.weight", (Dh,)), (f"{p}.k_norm.weight", (Dh,))]
    if config.get("attention_bias") or model_type == "qwen2_moe":  # Qwen2 has q/k/v biases by design
        out += [(f"{p}.{n}_proj.bias", (rows,)) for n, rows in (("q", H * Dh), ("k", KV * Dh), ("v", KV * Dh))]
    if model_type == "gpt_oss":  # an o_proj bias too, and one sink logit per head
        out += [(f"{p}.o_proj.bias", (D,)), (f"{p}.sinks", (H,))]
    return out


def _deepseek_v4(config: dict) -> bool:
    return config.get("model_type") == "deepseek_v4"


V4_CSA, V4_HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def v4_schedule(config: dict) -> tuple[list[str], list[str], dict[str, int]]:
    """DeepSeek V4's (attention kind per layer, "hash_moe" / "moe" per layer, compression rate per
    kind), as DeepseekV4Config derives them, legacy fields included (models/deepseek_v4.ModelArgs
    takes them from here and checks them)."""
    n = _need(config, "num_hidden_layers")
    rates = {V4_CSA: 4, V4_HCA: 128, **(config.get("compress_rates") or {})}
    for key, kind in (("compress_rate_csa", V4_CSA), ("compress_rate_hca", V4_HCA)):
        if config.get(key) is not None:
            rates[kind] = config[key]
    types = config.get("layer_types")
    if types is None and config.get("compress_ratios") is not None:  # (an unknown ratio stays, to be refused)
        types = [{0: "sliding_attention", 4: V4_CSA, 128: V4_HCA}.get(r, r) for r in config["compress_ratios"]]
    if types is None:
        types = [V4_HCA] * min(n, 2) + [V4_CSA if i % 2 else V4_HCA for i in range(max(n - 2, 0))]
    mlp = config.get("mlp_layer_types")
    if mlp is None:
        hashed = config.get("num_hash_layers", 3)
        mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    return list(types[:n]), list(mlp[:n]), rates


def _v4_attention(config: dict, p: str, i: int) -> list[Tensor]:
    """DeepSeek V4 attention: low-rank query, one key=value head, grouped output projection,
    sinks; a CSA layer's compressor (two series) and indexer, an HCA layer's compressor."""
    D, H, Dh = _need(config, "hidden_size"), _need(config, "num_attention_heads"), _need(config, "head_dim")
    Rq, G, Ro = _need(config, "q_lora_rank"), _need(config, "o_groups"), _need(config, "o_lora_rank")
    out = [(f"{p}.q_a_proj.weight", (Rq, D)), (f"{p}.q_a_norm.weight", (Rq,)), (f"{p}.q_b_proj.weight", (H * Dh, Rq)),
           (f"{p}.kv_proj.weight", (Dh, D)), (f"{p}.kv_norm.weight", (Dh,)),
           (f"{p}.o_a_proj.weight", (G * Ro, H * Dh // G)), (f"{p}.o_b_proj.weight", (D, G * Ro)), (f"{p}.sinks", (H,))]
    types, _, rates = v4_schedule(config)

    def compressor(c: str, width: int, series: int, rate: int) -> list[Tensor]:
        return [(f"{c}.kv_proj.weight", (series * width, D)), (f"{c}.gate_proj.weight", (series * width, D)),
                (f"{c}.position_bias", (rate, series * width)), (f"{c}.kv_norm.weight", (width,))]

    if types[i] == V4_HCA:
        out += compressor(f"{p}.compressor", Dh, 1, rates[V4_HCA])
    elif types[i] == V4_CSA:
        c, Hi, Di = f"{p}.compressor", _need(config, "index_n_heads"), _need(config, "index_head_dim")
        out += compressor(c, Dh, 2, rates[V4_CSA]) + compressor(f"{c}.indexer", Di, 2, rates[V4_CSA])
        out += [(f"{c}.indexer.q_b_proj.weight", (Hi * Di, Rq)), (f"{c}.indexer.scorer.weights_proj.weight", (Hi, D))]
    return out


def _hyper_connections(config: dict, p: str) -> list[Tensor]:
    """The two mHC mixes of a DeepSeek V4 or GLM-5.3-Flash layer (models/hyper_connections.py)."""
    D, S = _need(config, "hidden_size"), int(config.get("hc_mult") or 4)
    return [t for hc in ("attn_hc", "ffn_hc") for t in (
        (f"{p}.{hc}.fn", ((2 + S) * S, S * D)), (f"{p}.{hc}.base", ((2 + S) * S,)), (f"{p}.{hc}.scale", (3,)))]


def _v4_block(config: dict, p: str, i: int) -> list[Tensor]:
    """A DeepSeek V4 layer's hyper-connections and its MoE block's router (a token -> experts
    table in hash layers, a correction bias in the others) and shared expert."""
    D = _need(config, "hidden_size")
    E, K = num_experts(config), int(config.get("num_experts_per_tok") or 6)
    out = _hyper_connections(config, p)
    hashed = v4_schedule(config)[1][i] == "hash_moe"
    out.append((f"{p}.mlp.gate.weight", (E, D)))
    out.append((f"{p}.mlp.gate.tid2eid", (_need(config, "vocab_size"), K)) if hashed
               else (f"{p}.mlp.gate.e_score_correction_bias", (E,)))
    return out + _swiglu(f"{p}.mlp.shared_experts", D, expert_width(config))


def is_hybrid(config: dict) -> bool:
    """A Gated DeltaNet hybrid (Qwen3-Next, Qwen3.5 / 3.6 MoE), Kimi Linear or GLM-5.3-Flash:
    linear attention layers with a recurrent state between full attention ones
    (models/linear_attention.py, models/kimi_linear.py, models/glm5_next.py)."""
    return bool(config.get("linear_num_value_heads")) or _kda_family(config)


def stores_norm_offsets(config: dict) -> bool:
    """The Gated DeltaNet hybrids store their RMSNorm weights as offsets from 1
    (models/linear_attention.UnitOffsetNorms); the KDA families store the weights."""
    return bool(config.get("linear_num_value_heads"))


def _kimi_linear(config: dict) -> bool:
    return config.get("model_type") == "kimi_linear"


def _glm5_next(config: dict) -> bool:
    return config.get("model_type") in ("glm5_next_text", "glm5_next")


def _kda_family(config: dict) -> bool:
    """Kimi Delta Attention in the linear layers, MLA in the others: Kimi Linear, GLM-5.3-Flash."""
    return _kimi_linear(config) or _glm5_next(config)


def _kda(config: dict) -> tuple[int, int, int]:
    """KDA's (heads H, head dim Dk, conv width K): linear_attn_config's, else the flat fields
    (models/kimi_linear.ModelArgs, models/glm5_next.ModelArgs: their defaults)."""
    sub = config.get("linear_attn_config") or {}
    heads = 64 if _glm5_next(config) else 32
    return (int(sub.get("num_heads") or config.get("linear_num_heads") or heads),
            int(sub.get("head_dim") or config.get("linear_head_dim") or 128),
            int(sub.get("short_conv_kernel_size") or config.get("linear_conv_kernel_dim") or 4))


def layer_types(config: dict) -> list[str]:
    """'linear_attention' or 'full_attention' per decoder layer of a hybrid (its layer_types, else
    one full attention layer in every full_attention_interval, as the configs derive it;
    GLM-5.3-Flash's MLA layers, "indexed_attention", count as full attention)."""
    n = _need(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types and len(types) >= n:
        return ["full_attention" if t == "indexed_attention" else t for t in types[:n]]
    if _glm5_next(config):  # MLA in every fourth layer
        return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if _kimi_linear(config):  # linear_attn_config's 1-indexed full layers, else every fourth from the fifth
        full = (config.get("linear_attn_config") or {}).get("full_attn_layers")
        if full is not None:
            return ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    interval = int(config.get("full_attention_interval") or 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def linear_state_shapes(config: dict) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One sequence's state in one linear layer: (conv [K-1, C], delta rule [Hv, Dk, Dv])."""
    if _kda_family(config):  # q, k, v convolved; H heads of Dk for all three
        H, Dk, K = _kda(config)
        return (K - 1, 3 * H * Dk), (H, Dk, Dk)
    Hk, Hv = int(config.get("linear_num_key_heads") or 16), int(config["linear_num_value_heads"])
    Dk, Dv = int(config.get("linear_key_head_dim") or 128), int(config.get("linear_value_head_dim") or 128)
    return (int(config.get("linear_conv_kernel_dim") or 4) - 1, 2 * Hk * Dk + Hv * Dv), (Hv, Dk, Dv)


def _linear_attention(config: dict, p: str) -> list[Tensor]:
    """Gated DeltaNet: Qwen3-Next's grouped in_proj_qkvz / in_proj_ba, Qwen3.5's four projections."""
    D = _need(config, "hidden_size")
    (K1, C), (Hv, Dk, Dv) = linear_state_shapes(config)
    if config.get("model_type") == "qwen3_next":
        proj = [(f"{p}.in_proj_qkvz.weight", (C + Hv * Dv, D)), (f"{p}.in_proj_ba.weight", (2 * Hv, D))]
    else:
        proj = [(f"{p}.in_proj_qkv.weight", (C, D)), (f"{p}.in_proj_z.weight", (Hv * Dv, D)),
                (f"{p}.in_proj_b.weight", (Hv, D)), (f"{p}.in_proj_a.weight", (Hv, D))]
    return proj + [(f"{p}.conv1d.weight", (C, 1, K1 + 1)), (f"{p}.A_log", (Hv,)), (f"{p}.dt_bias", (Hv,)),
                   (f"{p}.norm.weight", (Dv,)), (f"{p}.out_proj.weight", (D, Hv * Dv))]


def _kda_attention(config: dict, p: str) -> list[Tensor]:
    """Kimi Delta Attention as the checkpoint names it: q/k/v and their convolutions, the low-rank
    forget gate (f_a / f_b, A_log, dt_bias), beta, the low-rank output gate (g_a / g_b)."""
    D = _need(config, "hidden_size")
    H, Dk, K = _kda(config)
    W = H * Dk
    a_log = (H,) if _glm5_next(config) else (1, 1, H, 1)  # as each checkpoint stores it
    return ([(f"{p}.{n}_proj.weight", (W, D)) for n in "qkv"] + [(f"{p}.{n}_conv1d.weight", (W, 1, K)) for n in "qkv"]
            + [(f"{p}.f_a_proj.weight", (Dk, D)), (f"{p}.f_b_proj.weight", (W, Dk)), (f"{p}.A_log", a_log),
               (f"{p}.dt_bias", (W,)), (f"{p}.b_proj.weight", (H, D)), (f"{p}.g_a_proj.weight", (Dk, D)),
               (f"{p}.g_b_proj.weight", (W, Dk)), (f"{p}.o_norm.weight", (Dk,)), (f"{p}.o_proj.weight", (D, W))])


def _gated_attention(config: dict, p: str) -> list[Tensor]:
    """The hybrids' full attention: q_proj also yields the output gate (2 H Dh rows); per-head q/k norm."""
    D, H = _need(config, "hidden_size"), _need(config, "num_attention_heads")
    KV, Dh = int(config.get("num_key_value_heads") or H), int(config.get("head_dim") or 256)
    return [(f"{p}.q_proj.weight", (2 * H * Dh, D)), (f"{p}.k_proj.weight", (KV * Dh, D)),
            (f"{p}.v_proj.weight", (KV * Dh, D)), (f"{p}.o_proj.weight", (D, H * Dh)),
            (f"{p}.q_norm.weight", (Dh,)), (f"{p}.k_norm.weight", (Dh,))]


def layer_tensors(config: dict, i: int, kind: str) -> list[Tensor]:
    """The resident (dense) tensors of decoder layer i of `kind` ('dense' or 'moe'): attention,
    norms and the dense MLP, or the router and shared experts; routed experts: expert_tensors."""
    D = _need(config, "hidden_size")
    p = f"model.layers.{i}"
    if _deepseek_v4(config):
        return (_v4_attention(config, f"{p}.self_attn", i) + _v4_block(config, p, i)
                + [(f"{p}.input_layernorm.weight", (D,)), (f"{p}.post_attention_layernorm.weight", (D,))])
    if _kda_family(config):
        linear = layer_types(config)[i] == "linear_attention"
        attention = _kda_attention(config, f"{p}.self_attn") if linear else _mla_attention(config, f"{p}.self_attn", i)
        if _glm5_next(config):
            attention += _hyper_connections(config, p)
    elif is_hybrid(config):
        linear = layer_types(config)[i] == "linear_attention"
        attention = _linear_attention(config, f"{p}.linear_attn") if linear else _gated_attention(config, f"{p}.self_attn")
    else:
        attention = (_mla_attention(config, f"{p}.self_attn", i) if config.get("kv_lora_rank")
                     else _gqa_attention(config, f"{p}.self_attn"))
    out = attention + [(f"{p}.input_layernorm.weight", (D,)), (f"{p}.post_attention_layernorm.weight", (D,))]
    if kind == "dense":
        return out + _swiglu(f"{p}.mlp", D, _need(config, "intermediate_size"))
    E = num_experts(config)
    if config.get("model_type") == "gpt_oss":  # a router with a bias; the experts' biases stay resident
        inner = expert_width(config)
        return out + [(f"{p}.mlp.router.weight", (E, D)), (f"{p}.mlp.router.bias", (E,)),
                      (f"{p}.mlp.experts.gate_proj.bias", (E, inner)), (f"{p}.mlp.experts.up_proj.bias", (E, inner)),
                      (f"{p}.mlp.experts.down_proj.bias", (E, D))]
    out.append((f"{p}.mlp.gate.weight", (E, D)))
    # grouped routing (DeepSeek, Kimi, GLM): a routing bias, shared experts
    if config.get("n_routed_experts") or _kda_family(config):
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (E,)))
        shared = int(config.get("n_shared_experts") or config.get("num_shared_experts")
                     or (1 if _kda_family(config) else 0))  # (KimiLinearConfig's default)
        if shared:
            out += _swiglu(f"{p}.mlp.shared_experts", D, expert_width(config) * shared)
    elif config.get("model_type") == "minimax_m2":  # the routing bias alone: no groups, no shared expert
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (E,)))
    elif config.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert behind a gate
        out += _swiglu(f"{p}.mlp.shared_expert", D, int(config["shared_expert_intermediate_size"]))
        out.append((f"{p}.mlp.shared_expert_gate.weight", (1, D)))
    return out


def expert_tensors(config: dict, prefix: str) -> list[Tensor]:
    """One routed expert of the MoE block at `prefix` (one blob in a container)."""
    D, inner = _need(config, "hidden_size"), expert_width(config)
    return _swiglu(f"{prefix}.experts.0", D, inner)
