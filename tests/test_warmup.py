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

    def new_cache(self, n):
        return None

    def forward(self, ids, cache):
        self.forwards += 1
        return self.kernel(np.asarray(ids, dtype=np.float32))

    def forward_rows(self, ids, caches):
        self.row_passes = getattr(self, "row_passes", 0) + 1
        return self.kernel(np.asarray(ids, dtype=np.float32))


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
    assert not hasattr(model, "row_passes")
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir, rows=True)
    assert model.row_passes == 2  # a batch of two sequences, and drafted tokens of one
    assert warmup._marker_path(model_dir, rows=True).exists() and warmup._marker_path(model_dir).exists()
    warmup.compile_kernels(model, Pipe(), model_dir=model_dir, rows=True)
    assert model.row_passes == 2  # now cached: skipped


FIRST_START = textwrap.dedent("""
    import sys, time
    from colibri.engine import Engine
    from colibri.warmup import compile_kernels

    import numpy as np
    from numba.core.event import install_recorder
    from colibri.kernels.gemm import BLAS_MIN_ROWS

    engine = Engine.load(sys.argv[1], progress=False)
    seconds = compile_kernels(engine.model, sys.stderr, model_dir=engine.container.dir, rows=True)
    t = time.perf_counter()
    engine.generate("What is the capital of France?", max_tokens=8)
    elapsed = time.perf_counter() - t
    engine.reset()
    with install_recorder("numba:compile") as compiled:
        engine.generate(list(range(100, 100 + BLAS_MIN_ROWS + 8)), max_tokens=2)  # the BLAS tiles' kernels
        m = engine.model                                                         # several rows a pass
        a, b = m.new_cache(8), m.new_cache(8)
        m.forward(np.array([1, 2]), a)
        m.forward(np.array([3]), b)
        m.forward_rows([4, 5], [a, b])
    print(seconds, elapsed, len(compiled.buffer))
""")


def test_first_start_with_an_empty_cache(smollm2_container, tmp_path):
    """The real model from an empty numba cache: one progress line naming the model and the
    measured time, after which neither a short nor a long prompt nor drafted tokens (a warmup
    with rows=True, as a drafting or batching engine runs) compile anything; the next start
    compiles nothing and prints nothing."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cmd = [sys.executable, "-c", FIRST_START, str(smollm2_container)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    seconds, _, compiled_after = first.stdout.split()
    seconds = float(seconds)
    assert compiled_after == "0"  # the warmup compiled every kernel a first answer needs, long prompts' too
    assert f"compiling kernels for {Path(smollm2_container).name} (first start only)... done in {seconds:.1f} s" \
        in first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split()[0] == "None" and "compiling" not in second.stderr
    assert list((tmp_path / "numba").rglob("*.nbi"))  # the cache went where it was told
