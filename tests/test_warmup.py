"""First start: where numba caches the kernels (never inside the package), and the warmup that
compiles them before the first answer with visible progress (colibri/warmup.py)."""
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from numba import njit
from rich.console import Console

import colibri
from colibri import warmup

PACKAGE = Path(colibri.__file__).parent

WHERE = textwrap.dedent("""
    import json, sys
    {first}
    import colibri.kernels
    from numba import njit
    from colibri.warmup import kernel_dispatchers

    @njit(cache=True)
    def users_own(x):
        return x + 1

    paths = {{name: d._cache._cache_path for name, d in kernel_dispatchers().items()}}
    print(json.dumps({{"kernels": paths, "users_own": users_own._cache._cache_path}}))
""")


def cache_paths(tmp_path, first="", **env):
    """Where each kernel (and a function of the user's own, defined after colibri) would cache,
    asked in a fresh interpreter; nothing is compiled."""
    base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    script = tmp_path / "user_script.py"
    script.write_text(WHERE.format(first=first))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**base, **env})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("first", ["", "import numba", "import numba.core.config; from numba import njit"])
def test_kernels_cache_in_the_user_cache_directory(tmp_path, first):
    """Whatever imported numba first: every kernel module caches under
    $XDG_CACHE_HOME/colibri/numba, never in the package (files pip did not install there made
    `pip install .` then `pip install -e .` leave a stale package that shadows the editable one)."""
    where = cache_paths(tmp_path, first, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert len(where["kernels"]) > 20  # cpu, ops and decode kernels
    for name, path in where["kernels"].items():
        assert Path(path).is_relative_to(tmp_path / "xdg" / "colibri" / "numba"), (name, path)
        assert not Path(path).is_relative_to(PACKAGE), (name, path)
    # the user's own cached functions keep numba's default place (beside their source)
    assert Path(where["users_own"]).is_relative_to(tmp_path), where["users_own"]
    assert not Path(where["users_own"]).is_relative_to(tmp_path / "xdg")


def test_an_explicit_numba_cache_dir_wins(tmp_path):
    where = cache_paths(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "mine"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert all(Path(p).is_relative_to(tmp_path / "mine") for p in where["kernels"].values())


# ----------------------------------------------------------------------------- progress

class FakeModel:
    """Just enough model for compile_kernels: its forward calls `kernel`."""

    def __init__(self, kernel):
        self.args = SimpleNamespace(model_type="tiny")
        self.kernel = kernel
        self.forwards = 0
        self.row_calls = []  # (shared with the shallow copy the several-rows warmup runs on)

    def new_cache(self, n):
        return None

    def forward(self, ids, cache):
        self.forwards += 1
        return self.kernel(np.asarray(ids, dtype=np.float32))

    def forward_rows(self, ids, caches):
        self.row_calls.append(ids)
        return self.kernel(np.asarray(ids, dtype=np.float32))

    @property
    def row_passes(self):
        return len(self.row_calls)


def fresh_kernel():
    """A kernel never compiled before in this process (and not cached on disk)."""
    @njit
    def twice(x):
        return x * 2
    return twice


class Pipe(io.StringIO):
    def isatty(self):
        return False


def test_progress_is_a_plain_line_when_not_a_terminal():
    out = Pipe()
    model = FakeModel(fresh_kernel())
    seconds = warmup.compile_kernels(model, out)
    assert seconds is not None and seconds > 0
    assert out.getvalue() == f"compiling kernels for tiny (first start only)... done in {seconds:.1f} s\n"
    # compiled now: a second warmup shows nothing and says nothing was compiled
    again = Pipe()
    assert warmup.compile_kernels(model, again) is None
    assert again.getvalue() == "" and model.forwards == 4


def test_progress_is_a_spinner_on_a_terminal():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    seconds = warmup.compile_kernels(FakeModel(fresh_kernel()), console)
    text = screen.getvalue()
    assert "compiling kernels for tiny (first start only)" in text  # the spinner's line
    assert f"compiled kernels for tiny in {seconds:.1f} s (first start only)" in text


def test_nothing_is_shown_when_nothing_compiles():
    kernel = fresh_kernel()
    kernel(np.zeros(2, np.float32))  # compiled before the warmup
    out = Pipe()
    assert warmup.compile_kernels(FakeModel(kernel), out) is None
    assert out.getvalue() == ""


def test_a_cached_model_skips_the_warmup_forward(tmp_path, monkeypatch):
    """After a warmup the kernels the model called are listed beside numba's cache; a later
    start whose kernels are all still cached does not even run the tiny forward (a large
    model's forward reads experts from disk), while a missing kernel sends it back through."""
    from colibri.kernels import ops

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    model_dir = tmp_path / "model"
    x = np.ones((1, 8), np.float32)
    model = FakeModel(lambda ids: ops.rms_norm(x, x[0], 1e-6))
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir)
    assert model.forwards == 2
    assert warmup.finish(60)  # the marker is written once the background work is over
    marker = warmup._marker_path(model_dir)
    assert "colibri.kernels.ops.rms_norm" in json.loads(marker.read_text())["kernels"]
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir)
    assert model.forwards == 2  # skipped: every listed kernel's cache index is current
    marker.write_text(json.dumps({"kernels": ["colibri.kernels.ops.rms_norm", "colibri.kernels.ops.gone"]}))
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir)
    assert model.forwards == 4  # a kernel not known to be cached: the warmup runs again


def test_a_warmup_for_several_rows_has_its_own_marker(tmp_path, monkeypatch):
    """An engine that batches or drafts (rows=True) also runs forward_rows in its warmup, and
    keeps its own marker: a cached plain warmup does not let it skip the several-rows kernels."""
    from colibri.kernels import ops

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    model_dir = tmp_path / "model"
    x = np.ones((1, 8), np.float32)
    model = FakeModel(lambda ids: ops.rms_norm(x, x[0], 1e-6))
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir)
    assert warmup.finish(60)
    assert model.row_passes == 0
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir, rows=True)
    assert warmup.finish(60)  # after the first answer's kernels, on a thread of its own
    assert model.row_passes == 2  # a batch of two sequences, and drafted tokens of one
    assert warmup._marker_path(model_dir, rows=True).exists() and warmup._marker_path(model_dir).exists()
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir, rows=True)
    assert model.row_passes == 2  # now cached: skipped


FIRST_START = textwrap.dedent("""
    import json, sys, threading, time
    from contextlib import contextmanager
    from colibri.engine import Engine
    from colibri import warmup

    import numpy as np
    from numba.core import event
    from colibri.kernels.gemm import BLAS_MIN_ROWS

    @contextmanager
    def install_recorder(kind):  # numba's, for this thread's compiles only (others run in the background)
        seen, me = [], threading.get_ident()

        class Recorder(event.Listener):
            def on_start(self, ev):
                if threading.get_ident() == me:
                    d = ev.data["dispatcher"]
                    seen.append(f"{d.py_func.__module__}.{d.py_func.__qualname__}")

            def on_end(self, ev):
                pass

        with event.install_listener(kind, Recorder()):
            yield seen

    def names(seen):
        return sorted(set(seen))

    engine = Engine.load(sys.argv[1], progress=False)
    with install_recorder("numba:compile") as here:
        seconds = warmup.compile_kernels(engine.model, sys.stderr, model_dir=engine.container.dir, rows=True)
    wait = engine.model.program_wait
    with install_recorder("numba:compile") as answer:
        engine.generate("What is the capital of France?", max_tokens=8)   # the first answer, at once
    assert warmup.finish(600)
    engine.reset()
    with install_recorder("numba:compile") as compiled:
        engine.generate("What is the capital of France?", max_tokens=4)   # now the whole-token kernel
        engine.generate(list(range(100, 100 + BLAS_MIN_ROWS + 8)), max_tokens=2)  # the BLAS tiles' kernels
        m = engine.model                                                         # several rows a pass
        a, b = m.new_cache(8), m.new_cache(8)
        m.forward(np.array([1, 2]), a)
        m.forward(np.array([3]), b)
        m.forward_rows([4, 5], [a, b])
    print(json.dumps({"seconds": seconds, "here": names(here), "answer": names(answer), "after": names(compiled),
                      "waited": wait is not None and wait.is_set()}))
""")


def test_first_start_with_an_empty_cache(smollm2_container, tmp_path):
    """The real model from an empty numba cache: one progress line naming the model and the
    measured time. Before it returns, this process compiles the prefill's kernels only (the
    decode step's come from the compile process, the whole-token kernel is left to it), and
    the first answer compiles nothing; once the background work is over, the whole-token decode,
    a long prompt and several rows a pass (a warmup with rows=True, as a drafting or batching
    engine runs) compile nothing; the next start compiles nothing and prints nothing."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cmd = [sys.executable, "-c", FIRST_START, str(smollm2_container)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stderr
    got = json.loads(first.stdout.strip().splitlines()[-1])
    seconds = got["seconds"]
    assert f"compiling kernels for {Path(smollm2_container).name} (first start only)... done in {seconds:.1f} s" \
        in first.stderr
    assert "colibri.kernels.gemm.matmul_int4" in got["here"]  # the prefill's, here
    later = {"colibri.kernels.decode._token_thread", "colibri.kernels.decode.unmanaged_layer_list",
             "colibri.kernels.decode.rows_phase", "colibri.kernels.decode._attention_phase",
             "colibri.kernels.gemm._deq_int4_tile", "colibri.kernels.decode.attention_rows"}
    assert not later & set(got["here"]), got["here"]  # the compile process's, or after the first answer
    assert got["answer"] == [] and got["after"] == [] and got["waited"]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout.strip().splitlines()[-1])
    assert again["seconds"] is None and "compiling" not in second.stderr
    assert again["here"] == again["answer"] == again["after"] == []  # a cached start compiles nothing
    assert list((tmp_path / "numba").rglob("*.nbi"))  # the cache went where it was told


PLANNED = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    from numba import types
    from numba.core import event
    from colibri import warmup
    from colibri.kernels import decode, ops, team

    if sys.argv[2] == "no-process":
        warmup._Worker.spawn = classmethod(lambda cls: None)

    class Planned:
        '''A model whose first decode step runs decode._clip and whose later tokens run
        team.range_of (its "whole-token kernel"), as DecoderModel plans them.'''
        args = type("A", (), {"model_type": "planned"})
        program_wait = None

        def new_cache(self, n):
            return None

        def token_plans(self, cache, nthreads):
            return ([(decode._clip, (np.zeros(3, np.float32), np.float32(1))), (team.counters_size, (3, 2))],
                    [(team.range_of, (types.int64,) * 3)])

        def forward(self, ids, cache):
            if len(ids) > 1:
                x = np.ones((1, 8), np.float32)
                ops.rms_norm_into(x, x[0], np.float32(1e-6), x)
            elif self.program_wait is None or self.program_wait.is_set():
                team.range_of(10, 2, 0)
            else:
                decode._clip(np.zeros(3, np.float32), np.float32(1))
                team.counters_size(3, 2)

    seen = []
    class Recorder(event.Listener):
        def on_start(self, ev):
            if threading.current_thread() is threading.main_thread():
                seen.append(ev.data["dispatcher"].py_func.__name__)
        def on_end(self, ev):
            pass
    event.register("numba:compile", Recorder())

    model = Planned()
    warmup.compile_kernels(model, sys.stderr, model_dir=sys.argv[1])
    here = list(seen)
    assert warmup.finish(300)
    model.forward([2], None)
    print(json.dumps({"here": here, "after": seen[len(here):], "set": model.program_wait is not None
                      and model.program_wait.is_set(), "marker": warmup._marker_path(sys.argv[1]).exists()}))
""")


@pytest.mark.parametrize("mode", ["process", "no-process"])
def test_the_compile_process_compiles_the_decode_step_and_the_rest(tmp_path, mode):
    """From an empty cache: the first decode step's kernels are compiled by the compile process
    (colibri.compile_worker) while this one compiles the prefill's, then shared out (each
    compiled once, by one of the two; the other loads it); the later tokens' kernel is compiled
    there after the warm-up returns, a token switches to it once it
    is in the cache (program_wait), and the marker is written. Where the process cannot start,
    everything is compiled here, as before, with the same result."""
    log = tmp_path / "process.jsonl"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "COLIBRI_WARMUP_LOG": str(log)}
    r = subprocess.run([sys.executable, "-c", PLANNED, str(tmp_path / "model"), mode], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    there = [json.loads(line)["name"].rpartition(".")[2] for line in log.read_text().splitlines()] \
        if log.exists() else []
    assert "rms_norm_into" in got["here"] and got["marker"] and got["after"] == []
    step = {"_clip", "counters_size"}
    if mode == "process":
        # the step's kernels shared out, each compiled once; the later tokens' kernel there only
        assert sorted(n for n in got["here"] + there if n in step) == sorted(step)
        assert "range_of" in there and "range_of" not in got["here"] and got["set"]
    else:
        assert "range_of" in got["here"] and there == [] and not got["set"]  # the whole-token decode at once
