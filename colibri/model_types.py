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
             "qwen3_next", "qwen3_5_moe", "gpt_oss")
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe"}

# Multimodal checkpoints whose language model colibri runs: family -> the tensor names of the
# parts it does not (a vision tower, its projector). Their config.json holds the language
# model's config as `text_config`; io/convert.py converts that and skips these tensors.
MULTIMODAL: dict[str, str] = {"qwen3_5_moe": r"^model\.visual\.|^mtp\."}

# Per family (module name): (pattern, replacement) rules, re.sub'd over a checkpoint tensor's
# name in order, giving the shared decoder's name. A family without an entry keeps its names.
CHECKPOINT_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    # Mixtral's routed experts: w1 (gate), w3 (up), w2 (down).
    "mixtral": tuple((rf"(\.experts\.\d+)\.{old}\.weight$", rf"\1.{new}.weight")
                     for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))),
    # Qwen3.5 / 3.6 MoE: the language model of the multimodal checkpoint.
    "qwen3_5_moe": ((r"^model\.language_model\.", "model."),),
}
_COMPILED = {family: tuple((re.compile(p), r) for p, r in rules) for family, rules in CHECKPOINT_NAMES.items()}


def module_name(model_type: str | None) -> str:
    """The colibri.models module that implements `model_type`, or a ColibriError naming what is
    supported."""
    name = ALIASES.get(model_type, model_type)
    if name not in SUPPORTED:
        raise ColibriError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return name


def checkpoint_name(model_type: str | None, name: str) -> str:
    """The shared decoder's name for `model_type`'s checkpoint tensor `name` (itself when the
    family keeps the checkpoint's names)."""
    for pattern, replacement in _COMPILED.get(ALIASES.get(model_type, model_type), ()):
        name = pattern.sub(replacement, name)
    return name
