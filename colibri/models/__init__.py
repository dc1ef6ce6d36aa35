"""Model families, one module per config.json `model_type` (mlx-lm's layout).

Each module exposes `ModelArgs` (a dataclass built from config.json) and
`build(config, weights, experts) -> DecoderModel` (decoder.build_decoder with the family's
pieces), and may define `sanitize(weights) -> weights`, mapping its checkpoint's tensor names
onto the shared decoder's (docs/design.md section 5; default: `identity`).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from colibri.model_types import module_name


def family(model_type: str | None) -> ModuleType:
    """The module implementing `model_type`, or a ColibriError naming what is supported."""
    return importlib.import_module(f"colibri.models.{module_name(model_type)}")


def identity(weights: dict) -> dict:
    """The default `sanitize`: the family's checkpoint already uses the shared decoder's names."""
    return weights


def sanitize(module: ModuleType, weights: dict) -> dict:
    """{checkpoint name: tensor} -> {the shared decoder's name: tensor}, by the family `module`'s
    `sanitize` (identity where it has none)."""
    return getattr(module, "sanitize", identity)(weights)
