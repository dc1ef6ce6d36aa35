"""First start: compile the numba kernels a model uses before its first answer, and say so.

numba compiles a kernel on its first call and caches it on disk (colibri.kernels.numba_cache_dir).
A first start therefore spends tens of seconds compiling; done inside the first answer, that
looks like a hang. `compile_kernels` runs one tiny prefill and one decode step in a throwaway
KV cache instead, so every kernel the first answer calls is compiled (or loaded from the
cache) up front, with progress on stderr:

- a terminal: a spinner with the seconds elapsed, then "compiled kernels for MODEL in 9.4 s";
- anything else (a pipe, a log): "compiling kernels for MODEL (first start only)... done in 9.4 s".

Only what the first answer needs is compiled before it, on both cores: a process of its own
(colibri.compile_worker) compiles the decode step's kernels by signature while this one
compiles the prefill's. A dense model's first tokens then decode through decode.token_steps,
the same bits as the whole-token kernel (decode.token_layers), whose compile (~20 s on 2 cores,
most of a first start) goes on in that process after the first answer has started, with the
long-prompt tiles; a token switches to it once it is in the cache (DecoderModel.program_wait).
The several-rows kernels of an engine that batches or drafts compile on a background thread here.
That process outlives this one if it must (`colibri run` answers and exits): it finishes the
cache and writes the marker below. `finish()` waits for all of it (tests, benchmarks).

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

import copy
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from colibri.progress import status_console, text_stream

MARKERS = "colibri-warm"   # folder in the numba cache: one marker per model directory


def start_compile_process(model_dir: str | Path | None, rows: bool = False):
    """The compile process for a coming compile_kernels(process=...), started before the model
    is loaded (its imports then overlap the loading); None when the warm-up will be skipped
    (this model's kernels are known to be cached) or the process cannot start."""
    marker = _marker_path(model_dir, rows)
    if marker is not None and _kernels_cached(marker):
        return None
    return _Worker.spawn()


def compile_kernels(model, out=None, model_dir: str | Path | None = None, rows: bool = False,
                    background: bool = True, process=None) -> float | None:
    """Compile (or load from numba's cache) every kernel `model`'s first answer uses, showing
    progress on `out` (a Rich Console or a text stream; default stderr) while numba really
    compiles. `model_dir` names the model in the message and keys the marker that lets a later
    start skip all this. rows: also the several-tokens-a-pass kernels (DecoderModel.forward_rows),
    for an engine that batches generations or drafts tokens (compiled at their first use
    instead, they held up that step ~26 s on SmolLM2, silently). What the first answer does not
    need (the whole-token decode kernel, long-prompt tiles, the several-rows kernels) compiles in
    the background (module docstring); background=False compiles all of it here, in this process.
    process: the compile process start_compile_process started (else it is started here).
    Returns the seconds spent when something was compiled before returning, else None."""
    marker = _marker_path(model_dir, rows)
    if marker is not None and _kernels_cached(marker):
        if process is not None:
            process.close()
        return None
    name = Path(model_dir).name if model_dir is not None else model.args.model_type
    progress = _Progress(out, name)
    t0 = time.perf_counter()
    with _on_first_compile(progress.start):
        cache = model.new_cache(8)
        steps, program, tiles = _plans(model, cache)
        worker = process if process is not None else _Worker.spawn() if background else None
        if worker is not None and not (background and (steps or program or tiles) and worker.submit(
                [("first", steps), ("program", program), ("tiles", tiles)], marker, progress.start)):
            worker.close()
            worker = None
        model.forward(np.array([0, 1], dtype=np.int64), cache)   # prefill kernels, while the worker compiles
        if worker is not None:
            worker.share("first")  # the decode step's kernels it has not started yet: here
            if program and worker.wait("first"):
                model.program_wait = worker.event("program")  # token_steps until token_layers is in the cache
        model.forward(np.array([2], dtype=np.int64), cache)      # decode kernels (the step's: loaded)
        if worker is None:
            _compile(program + tiles)
    seconds = time.perf_counter() - t0
    progress.stop(seconds)
    rows = rows and hasattr(model, "forward_rows")
    if worker is not None and not rows:  # this process's part is in the cache: the worker may write the marker
        worker.send_used(_used())
    later = _Later(model, marker, worker, program, tiles, rows)
    if background:
        later.start()
    else:
        later.run()
    return seconds if progress.started else None


def finish(timeout: float | None = None) -> bool:
    """Wait for every warm-up's background work of this process (threads and compile processes)
    to end; whether all did within `timeout` seconds."""
    end = None if timeout is None else time.monotonic() + timeout
    ok = True
    for job in list(_PENDING):
        left = None if end is None else max(0.0, end - time.monotonic())
        ok = job.join(left) and ok
    return ok


def _plans(model, cache) -> tuple[list, list, list]:
    """[(kernel, numba signature)] the first decode step compiles (decode.token_steps), the
    whole-token kernel (decode.token_layers) and the long-prompt tiles, found without compiling
    anything; the first two are empty for a model decode.token_layers does not cover."""
    from numba import get_num_threads

    steps, program = [], []
    plans = model.token_plans(cache, get_num_threads()) if hasattr(model, "token_plans") else None
    if plans is not None:
        calls, program = plans
        # (a kernel the prefill compiles too, the norm and SwiGLU, last: compiled here by then, loaded)
        steps = sorted(_unique((k, _signature(k, args)) for k, args in calls),
                       key=lambda job: job[0].py_func.__module__ != "colibri.kernels.decode")
        program = _unique(program)
    return steps, program, _unique(_long_prompt_tiles(model))


def _signature(kernel, args) -> tuple:
    return tuple(kernel.typeof_pyval(a) for a in args)


def _unique(jobs) -> list:
    out, seen = [], set()
    for kernel, sig in jobs:
        if (id(kernel), tuple(sig)) not in seen:
            seen.add((id(kernel), tuple(sig)))
            out.append((kernel, tuple(sig)))
    return out


def _compile(jobs) -> None:
    """Compile (or load from the cache) each (kernel, signature) here, in this process."""
    for kernel, sig in jobs:
        kernel.compile(sig)


def _long_prompt_tiles(model) -> list:
    """The long-prompt path's kernels: from gemm.BLAS_MIN_ROWS tokens a prompt's matrices are
    dequantized a tile at a time for BLAS, with kernels the two-token prefill above never
    calls, so a first start would compile them in the middle of its first long answer (~0.6 s
    on SmolLM2, unannounced): one per kind of matrix the model holds, as (kernel, signature)."""
    from colibri.kernels.gemm import blas_tile_call

    jobs, done = [], set()
    for t in _matrices(model):
        kind = (t.scheme, t.q.dtype, t.mins is None)
        if kind in done or t.shape[0] < max(t.interleave, 1):
            continue
        done.add(kind)
        call = blas_tile_call(t)
        if call is not None:
            jobs.append((call[0], _signature(*call)))
    return jobs


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


# ----------------------------------------------------------------------------- after the first answer

_PENDING: list = []  # background work of this process's warm-ups (finish() waits for it)


class _Later:
    """What compiles after compile_kernels has returned: the several-rows kernels here (on a
    shallow copy of the model, whose state a forward pass writes: rows_hidden, the K/V lists'
    memo), and, should the compile process have failed, its work; then the marker."""

    def __init__(self, model, marker, worker, program, tiles, rows: bool):
        self.model, self.marker, self.worker = model, marker, worker
        self.program, self.tiles, self.rows = program, tiles, rows
        self.thread = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="colibri-compile", daemon=True)
        _PENDING.append(self)
        self.thread.start()

    def join(self, timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                return False
        if self.worker is not None:
            return self.worker.join(None if end is None else max(0.0, end - time.monotonic()))
        return True

    def run(self) -> None:
        w = self.worker
        if self.rows:
            try:
                _compile_rows(copy.copy(self.model))
            except BaseException:
                if w is not None:
                    w.close()  # no marker: the next start warms up again
                raise
        if w is None:
            if self.marker is not None:
                _write_marker(self.marker)
            return
        if self.rows:
            w.send_used(_used())  # the worker writes the marker once its own work is in the cache too
        if not w.wait("program"):  # the process failed: here, then
            _compile(self.program)
        wait = getattr(self.model, "program_wait", None)
        if wait is not None:
            wait.set()
        if not w.wait("tiles"):
            _compile(self.tiles)
        if not w.wait("all") and self.marker is not None:  # (it failed before writing the marker)
            _write_marker(self.marker)


def _used() -> list[str]:
    """The kernels this process has called (or loaded)."""
    return sorted(n for n, d in kernel_dispatchers().items() if d.overloads)


def _compile_rows(model) -> None:
    """The several-tokens-a-pass kernels: a batch of two sequences, and drafted tokens of one."""
    cache, other = model.new_cache(8), model.new_cache(4)
    model.forward(np.array([0, 1], dtype=np.int64), cache)
    model.forward(np.array([2], dtype=np.int64), cache)
    model.forward(np.array([3], dtype=np.int64), other)
    model.forward_rows([4, 5], [cache, other])            # a batch: two sequences
    model.forward_rows([6, 7], [cache, cache])            # drafted tokens: one sequence


class _Worker:
    """The compile process (colibri.compile_worker): its groups' progress as events. Started
    before its work is known (start_compile_process), so that its imports overlap the model's
    loading; submit() hands it the work."""

    def __init__(self, proc):
        self.proc = proc
        self.on_compiling = lambda: None
        self.events: dict[str, threading.Event] = {}
        self.ok: dict[str, bool] = {}
        self.failed: list[str] = []
        self.ended = threading.Event()
        self._reader = None

    @classmethod
    def spawn(cls):
        """The process, waiting for its work; None where it cannot start (the engine then
        compiles everything itself, as it would without it)."""
        from colibri.kernels import loaded_cache_dir

        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "COLIBRI_WORKER_CACHE_DIR": loaded_cache_dir(),
               "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "colibri.compile_worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                    start_new_session=True)  # (a Ctrl-C of the engine leaves it its work)
        except OSError:
            return None
        return cls(proc)

    def submit(self, groups, marker, on_compiling) -> bool:
        """Hand it the groups of (kernel, signature) to compile, in order; False if it has gone."""
        names = {id(d): n for n, d in kernel_dispatchers().items()}
        # (a kernel it cannot name is left to this process's first call)
        self.jobs = {g: [(k, sig) for k, sig in jobs if id(k) in names] for g, jobs in groups}
        work = [(g, [(names[id(k)], sig) for k, sig in jobs]) for g, jobs in self.jobs.items()]
        self.on_compiling = on_compiling
        self.events = {g: threading.Event() for g, _ in work + [("all", None)]}
        self.claims = tempfile.mkdtemp(prefix="colibri-claims-")
        try:
            write_frame(self.proc.stdin, {"groups": work, "marker": None if marker is None else str(marker),
                                          "nice": 10, "claims": {work[0][0]: self.claims}})
        except (OSError, ValueError, pickle.PicklingError):
            self.close()
            return False
        self._reader = threading.Thread(target=self._read, name="colibri-compile-reader", daemon=True)
        self._reader.start()
        return True

    def share(self, group: str) -> None:
        """Compile the group's jobs here too, from its last one back, each one neither process has
        claimed (claim()): the two meet where the other process has got to, and the group is done
        in about half the time of either alone. Then the claims go."""
        jobs = self.jobs[group]
        for i in reversed(range(len(jobs))):
            if self.events[group].is_set() or not claim(self.claims, i):
                break
            kernel, sig = jobs[i]
            kernel.compile(sig)
        self.events[group].wait()
        shutil.rmtree(self.claims, ignore_errors=True)

    def close(self) -> None:
        """No work after all: its input ends, and so does it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "compiling":
                self.on_compiling()
            elif line.startswith("done ") and line[5:] in self.events:
                self.ok[line[5:]] = True
                self.events[line[5:]].set()
            elif line.startswith("failed "):
                self.failed.append(line[7:])
        self.ended.set()
        for e in self.events.values():  # a group it never finished: waiters go on without it
            e.set()

    def event(self, group: str) -> threading.Event:
        return self.events[group]

    def wait(self, group: str) -> bool:
        """Block until the group is compiled; False if the process ended before that."""
        self.events[group].wait()
        return self.ok.get(group, False)

    def send_used(self, names: list[str]) -> None:
        """The kernels this process used (for the marker); the process's input ends here."""
        if self.proc.stdin.closed:
            return
        try:
            write_frame(self.proc.stdin, names)
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass

    def join(self, timeout: float | None) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        if self._reader is not None:
            self._reader.join(timeout)
        return True


def claim(claims: str, i: int) -> bool:
    """Whether this process takes job i of a group shared with the other (the first to create
    its file in `claims` does; a claims folder already gone: the group is over, so yes, a
    compile that loads the kernel from the cache)."""
    try:
        os.close(os.open(os.path.join(claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def write_frame(stream, obj) -> None:
    """obj pickled, after its length (8 bytes): colibri.compile_worker's input."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read_frame(stream):
    """The next write_frame object of `stream`, or None at its end."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    data = stream.read(n)
    return pickle.loads(data) if len(data) == n else None


# ----------------------------------------------------------------------------- progress

class _Progress:
    """Shown from the first compile to the end of the warmup; nothing when nothing compiles
    (the compile process's first compile may start it, from another thread; after the end,
    its compiles go on unannounced)."""

    def __init__(self, out, name: str):
        self.out, self.name = out, name
        self.started = self.stopped = False
        self._status = None
        self._t0 = 0.0
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self.started or self.stopped:
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
        with self._lock:
            self.stopped = True
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
            "features": (config.CPU_FEATURES if config.CPU_FEATURES is not None
                         else binding.get_host_cpu_features().flatten())}


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
    write_marker(marker, {n for n, d in kernel_dispatchers().items() if d.overloads})


def write_marker(marker: str | Path, used) -> None:
    """The marker of a finished warm-up: the kernels it used, and what they were compiled for
    (written by this process, or by the compile process once its part is in the cache too)."""
    marker = Path(marker)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"kernels": sorted(used), **_compiled_for()}))
        tmp.replace(marker)
    except OSError:  # an unwritable cache only costs the tiny forward at the next start
        pass
