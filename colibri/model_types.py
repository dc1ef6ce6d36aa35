"""Which config.json `model_type`s colibri runs: the registry alone, importing no model code, so
the converter (colibri/io) can refuse an unsupported checkpoint before reading weights without
depending on colibri/models (which builds on the kernels)."""
from __future__ import annotations

from colibri.errors import ColibriError

SUPPORTED = ("llama", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa")
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}


def module_name(model_type: str | None) -> str:
    """The colibri.models module that implements `model_type`, or a ColibriError naming what is
    supported."""
    name = ALIASES.get(model_type, model_type)
    if name not in SUPPORTED:
        raise ColibriError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return name
