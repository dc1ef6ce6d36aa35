"""The one in-process Engine: container + tokenizer + model + expert source + KV slots.

    config.py   EngineConfig, the runtime knobs, and the one place they are checked
    loader.py   the container, the experts, the model over them, the tokenizer, the warm-up
    slots.py    KV slots: which one a prompt takes, how much of it is reused, saved and restored
    stats.py    expert-cache figures, cumulative and per generation
    engine.py   the Engine facade: load, stream / generate, score, the facts callers show

The token loop itself is colibri/generate.py; continuous batching colibri/batching.py;
drafting colibri/speculative.py.
"""
from colibri.engine.config import DEFAULT_MAX_CONTEXT, WEIGHT_LAYOUTS, EngineConfig
from colibri.engine.engine import Engine, Generation
from colibri.engine.slots import KVSlot, common_prefix
from colibri.generate import TokenEvent

__all__ = ["DEFAULT_MAX_CONTEXT", "WEIGHT_LAYOUTS", "Engine", "EngineConfig", "Generation", "KVSlot", "TokenEvent",
           "common_prefix"]
