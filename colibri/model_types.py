"""Which config.json `model_type`s colibri runs: the registry alone, importing no model code, so
the converter (colibri/io) can refuse an unsupported checkpoint before reading weights without
depending on colibri/models (which builds on the kernels). It also holds, as plain data, how a
family's checkpoint names its tensors where they differ from the shared decoder's names
(CHECKPOINT_NAMES): the converter renames them as it writes a container, and the family's
`sanitize` (colibri/models/<family>.py) reads the same rules (docs/design.md section 5)."""
from __future__ import annotations

import re

from colibri.errors import ColibriError

SUPPORTED = ("llama", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa",
             "qwen3_next", "qwen3_5_moe", "gpt_oss", "minimax_m2", "kimi_linear", "deepseek_v4", "glm5_next")
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe", "glm5_next_text": "glm5_next"}

# Multimodal wrappers whose config.json holds the language model's config under a key: convert
# writes that config (its model_type, default below, names the family) and skips the parts
# colibri does not run, each a pattern over checkpoint names, saying so in one line.
WRAPPERS: dict[str, dict] = {
    # Kimi-K2.5 / K2.6 (Kimi_K25ForConditionalGeneration): a Kimi-K2 (DeepSeek-V3) text_config
    "kimi_k25": {"text_config": "text_config", "default_model_type": "deepseek_v3",
                 "skip": {"vision tower": r"^(model\.)?vision_tower\.",
                          "multimodal projector": r"^(model\.)?mm_projector\."}},
    # Qwen3.5 / 3.6 MoE (Qwen3_5MoeForConditionalGeneration): its text model, `qwen3_5_moe_text`,
    # under `model.language_model.`; its MTP block (`mtp.`) is kept for drafting (io/convert.py, models/mtp.py).
    "qwen3_5_moe": {"text_config": "text_config", "default_model_type": "qwen3_5_moe_text",
                    "skip": {"vision tower": r"^model\.visual\."}},
    # GLM-5.3-Flash (Glm5NextForConditionalGeneration): its text model, `glm5_next_text`, under
    # `model.language_model.`.
    "glm5_next": {"text_config": "text_config", "default_model_type": "glm5_next_text",
                  "skip": {"vision tower": r"^model\.visual\."}},
}

# Per family (module name), or per wrapper model_type: (pattern, replacement) rules, re.sub'd
# over a checkpoint tensor's name in order, giving the shared decoder's name. A family without
# an entry keeps its names.
CHECKPOINT_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    # Mixtral's routed experts: w1 (gate), w3 (up), w2 (down).
    "mixtral": tuple((rf"(\.experts\.\d+)\.{old}\.weight$", rf"\1.{new}.weight")
                     for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))),
    # Qwen3.5 / 3.6 MoE: the language model of the multimodal checkpoint.
    "qwen3_5_moe": ((r"^model\.language_model\.", "model."),),
    # MiniMax-M2: Mixtral's names under `block_sparse_moe`, the routing bias beside the router.
    "minimax_m2": ((r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
                   (r"\.block_sparse_moe\.", ".mlp."),
                   *((rf"(\.experts\.\d+)\.{old}\.weight$", rf"\1.{new}.weight")
                     for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")))),
    # Kimi Linear: Mixtral's expert names under `block_sparse_moe` (its routing bias under the gate
    # already); the forget gate's tensors beside the projections, as the checkpoint keeps them
    # (transformers' in-memory `forget_gate.` prefix read back the same).
    "kimi_linear": ((r"\.block_sparse_moe\.", ".mlp."), (r"\.self_attn\.forget_gate\.", ".self_attn."),
                    *((rf"(\.experts\.\d+)\.{old}\.weight$", rf"\1.{new}.weight")
                      for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")))),
    # DeepSeek V4: its own checkpoint names (with or without transformers' `model.` prefix) onto
    # transformers' module names (its conversion_mapping.py), the indexer under the compressor.
    "deepseek_v4": ((r"^layers\.", "model.layers."), (r"^embed\.weight$", "model.embed_tokens.weight"),
                    (r"^head\.weight$", "lm_head.weight"), (r"^norm\.weight$", "model.norm.weight"),
                    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
                    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
                    (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
                    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
                    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
                    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
                    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
                    (r"(\.self_attn(?:\.compressor(?:\.indexer)?)?)\.norm\.weight$", r"\1.kv_norm.weight"),
                    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."),
                    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
                    (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
                    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
                    *((rf"(\.(?:experts\.\d+|shared_experts))\.{old}\.weight$", rf"\1.{new}.weight")
                      for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")))),
    # GLM-5.3-Flash: the language model of the multimodal checkpoint; the hyper-connections'
    # `hc_attn_fn`-style names and the forget gate beside the projections (as transformers'
    # conversion_mapping.py reads them), onto transformers' module names and Kimi's KDA layout.
    "glm5_next": ((r"^model\.language_model\.", "model."), (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
                  (r"\.self_attn\.forget_gate\.", ".self_attn.")),
    # Kimi-K2.5's language model under `language_model.` (transformers 5 saves its layers as
    # `blocks`, and names them `model.language_model.` in memory).
    "kimi_k25": ((r"^language_model\.model\.(?:blocks|layers)\.", "model.layers."),
                 (r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head."),
                 (r"^model\.language_model\.", "model.")),
}
_COMPILED = {family: tuple((re.compile(p), r) for p, r in rules) for family, rules in CHECKPOINT_NAMES.items()}
_SKIPS = {model_type: tuple((part, re.compile(p)) for part, p in w["skip"].items()) for model_type, w in WRAPPERS.items()}


def module_name(model_type: str | None) -> str:
    """The colibri.models module that implements `model_type`, or a ColibriError naming what is
    supported."""
    name = ALIASES.get(model_type, model_type)
    if name not in SUPPORTED:
        raise ColibriError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return name


def language_model_config(config: dict) -> dict:
    """config.json of a multimodal wrapper (WRAPPERS) -> its language model's, as a container
    keeps it; any other config as it is. The wrapper's own tie_word_embeddings decides
    (transformers ties on it), and a quantization_config or token ids it holds apply to the
    language model."""
    model_type = config.get("model_type")
    wrapper = WRAPPERS.get(model_type)
    if wrapper is None:
        return config
    key = wrapper["text_config"]
    text = config.get(key)
    if text is None and model_type in SUPPORTED:  # a text model's own config (a container's, a preset's)
        return config
    if not isinstance(text, dict):
        raise ColibriError(f"config field {key} is missing: a {model_type} checkpoint's config.json holds its "
                           f"language model's config there")
    out = {"model_type": wrapper["default_model_type"], **text}
    for field in ("tie_word_embeddings", "quantization_config", "bos_token_id", "eos_token_id"):
        if field in config and (field == "tie_word_embeddings" or field not in text):
            out[field] = config[field]
    return out


def skipped_part(model_type: str | None, name: str) -> str | None:
    """The wrapper part (WRAPPERS' "skip") checkpoint tensor `name` belongs to, or None."""
    for part, pattern in _SKIPS.get(model_type, ()):
        if pattern.search(name):
            return part
    return None


def checkpoint_name(model_type: str | None, name: str) -> str:
    """The shared decoder's name for `model_type`'s checkpoint tensor `name` (itself when the
    family keeps the checkpoint's names)."""
    rules = _COMPILED.get(model_type) or _COMPILED.get(ALIASES.get(model_type, model_type), ())
    for pattern, replacement in rules:
        name = pattern.sub(replacement, name)
    return name
