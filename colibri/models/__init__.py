"""Model families, one module per config.json `model_type` (mlx-lm's layout).

Each module exposes `ModelArgs` (a dataclass built from config.json) and
`build(config, weights, experts) -> DecoderModel`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from colibri.errors import ColibriError

SUPPORTED = ("llama", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa")
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}


def family(model_type: str | None) -> ModuleType:
    """The module implementing `model_type`, or a ColibriError naming what is supported."""
    name = ALIASES.get(model_type, model_type)
    if name not in SUPPORTED:
        raise ColibriError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return importlib.import_module(f"colibri.models.{name}")
