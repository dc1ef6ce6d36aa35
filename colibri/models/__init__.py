"""Model families, one module per config.json `model_type` (mlx-lm's layout).

Each module exposes `ModelArgs` (a dataclass built from config.json) and
`build(config, weights, experts) -> DecoderModel`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from colibri.model_types import module_name


def family(model_type: str | None) -> ModuleType:
    """The module implementing `model_type`, or a ColibriError naming what is supported."""
    return importlib.import_module(f"colibri.models.{module_name(model_type)}")
