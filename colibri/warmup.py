"""First start: compile the numba kernels a model uses before its first answer, and say so.

numba compiles a kernel on its first call and caches it on disk (colibri.kernels.numba_cache_dir).
A first start therefore spends tens of seconds compiling; done inside the first answer, that
looks like a hang. `compile_kernels` runs one tiny prefill and one decode step in a throwaway
KV cache instead, so every kernel this model's forward calls is compiled (or loaded from the
cache) up front, with progress on stderr:

- a terminal: a spinner with the seconds elapsed, then "compiled kernels for MODEL in 23.4 s";
- anything else (a pipe, a log): "compiling kernels for MODEL (first start only)... done in 23.4 s".

What is missing is decided per kernel and signature, by numba itself: progress starts at the
first "numba:compile" event, which numba sends only on a cache miss. A model that needs a kernel
no earlier model compiled is therefore noticed, and a cached start prints nothing.

The tiny forward itself is skipped when this model's kernels are known to be cached: after a
warmup, the kernels the model called are listed in a marker file next to numba's cache, and a
later start checks that they are still colibri's kernels and were compiled by this numba for
this CPU (the cache directory's name is a digest of the kernel sources). That matters for large
models, whose forward reads experts from disk even for three tokens.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from colibri.progress import status_console, text_stream

MARKERS = "colibri-warm"   # folder in the numba cache: one marker per model directory


def compile_kernels(model, out=None, model_dir: str | Path | None = None, rows: bool = False) -> float | None:
    """Compile (or load from numba's cache) every kernel `model` uses, showing progress on `out`
    (a Rich Console or a text stream; default stderr) while numba really compiles. `model_dir`
    names the model in the message and keys the marker that lets a later start skip all this.
    rows: also the several-tokens-a-pass kernels (DecoderModel.forward_rows), for an engine
    that batches generations or drafts tokens: compiled at their first use instead, they held
    up that step ~26 s on SmolLM2, silently. Returns the seconds spent when something was
    compiled, else None."""
    marker = _marker_path(model_dir, rows)
    if marker is not None and _kernels_cached(marker):
        return None
    name = Path(model_dir).name if model_dir is not None else model.args.model_type
    progress = _Progress(out, name)
    t0 = time.perf_counter()
    with _on_first_compile(progress.start):
        cache = model.new_cache(8)
        model.forward(np.array([0, 1], dtype=np.int64), cache)   # prefill kernels
        model.forward(np.array([2], dtype=np.int64), cache)      # decode kernels
        _compile_long_prompt_tiles(model)
        if rows and hasattr(model, "forward_rows"):
            other = model.new_cache(4)
            model.forward(np.array([3], dtype=np.int64), other)
            model.forward_rows([4, 5], [cache, other])            # a batch: two sequences
            model.forward_rows([6, 7], [cache, cache])            # drafted tokens: one sequence
    seconds = time.perf_counter() - t0
    progress.stop(seconds)
    if marker is not None:
        _write_marker(marker)
    return seconds if progress.started else None


def _compile_long_prompt_tiles(model) -> None:
    """The long-prompt path's kernels: from gemm.BLAS_MIN_ROWS tokens a prompt's matrices are
    dequantized a tile at a time for BLAS, with kernels the two-token prefill above never
    calls, so a first start would compile them in the middle of its first long answer (~0.6 s
    on SmolLM2, unannounced). One tiny matmul per kind of matrix the model holds compiles
    them; the result is thrown away."""
    from colibri.kernels.gemm import BLAS_MIN_ROWS, matmul

    done = set()
    for t in _matrices(model):
        kind = (t.scheme, t.q.dtype, t.mins is None)
        if kind in done or t.shape[0] < max(t.interleave, 1):
            continue
        done.add(kind)
        rows = t.rows(0, max(t.interleave, 1))  # a view of whole interleaved blocks: the same array types
        matmul(rows, np.zeros((BLAS_MIN_ROWS, t.shape[1]), np.float32))


def _matrices(model):
    """The model's weight matrices (QTensors): the head, and those of each layer's parts, two
    attribute levels down (layer -> attention / MLP -> matrix)."""
    from colibri.formats.qtensor import QTensor

    def walk(obj, depth):
        for v in vars(obj).values():
            if isinstance(v, QTensor):
                yield v
            elif depth and hasattr(v, "__dict__") and not isinstance(v, type):
                yield from walk(v, depth - 1)

    for t in (getattr(model, "lm_head", None), getattr(model, "embed", None)):
        if isinstance(t, QTensor):
            yield t
    for layer in getattr(model, "layers", ()):
        yield from walk(layer, 2)


# ----------------------------------------------------------------------------- progress

class _Progress:
    """Shown from the first compile to the end of the warmup; nothing when nothing compiles."""

    def __init__(self, out, name: str):
        self.out, self.name = out, name
        self.started = False
        self._status = None
        self._t0 = 0.0

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self._t0 = time.perf_counter()
        console = status_console(self.out)
        if console is not None:
            self._console = console
            self._status = console.status(_Elapsed(f"compiling kernels for {self.name} (first start only)",
                                                   self._t0))
            self._status.start()
        else:
            stream = text_stream(self.out)
            stream.write(f"compiling kernels for {self.name} (first start only)... ")
            stream.flush()

    def stop(self, seconds: float) -> None:
        if not self.started:
            return
        if self._status is not None:
            self._status.stop()
            self._console.print(f"compiled kernels for {self.name} in {seconds:.1f} s (first start only)",
                                highlight=False)
        else:
            stream = text_stream(self.out)
            stream.write(f"done in {seconds:.1f} s\n")
            stream.flush()


class _Elapsed:
    """A status text that Rich re-renders at every refresh, so the seconds count up."""

    def __init__(self, text: str, t0: float):
        self.text, self.t0 = text, t0

    def __rich__(self) -> str:
        return f"{self.text} {time.perf_counter() - self.t0:.0f} s"


class _on_first_compile:
    """Calls `callback` when numba starts compiling (a cache miss), at most once per call."""

    def __init__(self, callback):
        from numba.core import event

        class Listener(event.Listener):
            def on_start(self, ev):
                callback()

            def on_end(self, ev):
                pass

        self._event = event
        self._listener = Listener()

    def __enter__(self):
        self._event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc):
        self._event.unregister("numba:compile", self._listener)
        return False


# ----------------------------------------------------------------------------- markers

def _marker_path(model_dir, rows: bool = False) -> Path | None:
    """The marker of a model's warmup, one per model directory and kind of warmup (with the
    several-rows kernels or not: a warmup without them must not let a start that needs them
    skip its own)."""
    if model_dir is None:
        return None
    from colibri.kernels import numba_cache_dir

    key = hashlib.sha1(str(Path(model_dir).resolve()).encode()).hexdigest()[:20]
    return numba_cache_dir() / MARKERS / f"{key}{'-rows' if rows else ''}.json"


def kernel_dispatchers() -> dict:
    """'module.qualname' -> numba dispatcher, for every kernel in the colibri.kernels modules."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    import colibri.kernels as pkg

    found = {}
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg.__name__}."):
        if info.name.startswith(f"{pkg.__name__}.cuda"):  # (CUDA kernels are not cached on disk)
            continue
        mod = importlib.import_module(info.name)
        for value in vars(mod).values():
            if isinstance(value, Dispatcher) and value.py_func.__module__ == mod.__name__:
                found[f"{mod.__name__}.{value.py_func.__qualname__}"] = value
    return found


def _compiled_for() -> dict:
    """What cached machine code depends on besides the sources (which name the cache directory,
    colibri.kernels.numba_cache_dir): numba's version and the CPU it compiles for (the host's,
    or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, as for measuring another CPU class)."""
    import numba
    from llvmlite import binding
    from numba.core import config

    return {"numba": numba.__version__, "cpu": config.CPU_NAME or binding.get_host_cpu_name(),
            "features": config.CPU_FEATURES or binding.get_host_cpu_features().flatten()}


def _kernels_cached(marker: Path) -> bool:
    """The marker's kernels were compiled into this cache directory by this numba for this CPU,
    and each is still one of colibri's kernels. (A cache emptied by hand while its markers stay
    costs a silent compile at the first token, never a wrong result: numba checks its own
    index before it loads anything.)"""
    try:
        recorded = json.loads(marker.read_text())
        names = recorded["kernels"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if any(recorded.get(k) != v for k, v in _compiled_for().items()):
        return False
    kernels = kernel_dispatchers()
    return bool(names) and all(n in kernels for n in names)


def _write_marker(marker: Path) -> None:
    """List the kernels this process has called (the warmup's, at least)."""
    used = sorted(n for n, d in kernel_dispatchers().items() if d.overloads)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kernels": used, **_compiled_for()}))
        tmp.replace(marker)
    except OSError:  # an unwritable cache only costs the tiny forward at the next start
        pass
