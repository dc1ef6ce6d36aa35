"""Compute kernels: numba CPU kernels (cpu/, decode, moe, gemm, idot, ops, attention, team) and
@cuda.jit kernels (cuda/) over the QTensor format of colibri/formats/qtensor.py.

numba caches the compiled kernels on disk (every kernel is `@njit(cache=True)`) in the user's
cache directory, never inside the package: files that pip did not install there make
`pip uninstall` leave the package directory behind, and that stale directory then shadows a
later editable install (`pip install .` then `pip install -e .` in one virtualenv ended in
"No module named 'colibri.kernels.quant'")."""
import os
from contextlib import contextmanager
from pathlib import Path


def numba_cache_dir() -> Path:
    """Where the compiled kernels are cached: under numba's cache directory when the user set
    one, else $XDG_CACHE_HOME/colibri/numba (~/.cache/colibri/numba). Not under $COLIBRI_HOME:
    compiled code depends only on colibri's source and this machine, and runs that keep their
    models apart (tests, servers with their own state) should not each compile again.

    The last part of the path is a digest of the kernel sources: numba checks a cached
    function against its own file only, so after a change to cpu/matvec.py the cached decode.py
    kernels, which have its row code compiled into them, would still load, stale (seen:
    results that differ in the last bits, and a segfault). A new digest is a fresh cache."""
    from numba.core import config

    if os.environ.get("NUMBA_CACHE_DIR") or config.CACHE_DIR:  # the environment, or .numba_config.yaml
        base = Path(os.environ.get("NUMBA_CACHE_DIR") or config.CACHE_DIR)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri" / "numba"
    return base / _sources_digest()


def _sources_digest() -> str:
    import hashlib

    import numba

    h = hashlib.sha1(numba.__version__.encode())
    # Every kernel source, and the format module whose constants the kernels compile in.
    here = Path(__file__).parent
    formats = here.parent / "formats"
    for f in [*sorted(here.rglob("*.py")), formats / "qtensor.py", formats / "ggml_blocks.py"]:
        h.update(str(f.relative_to(here.parent)).encode() + f.read_bytes())
    # A forced integer-dot or tile form or a named target CPU (cpu/target.py reads them)
    # compiles different code from the same sources.
    # (An empty NUMBA_CPU_FEATURES, the named CPU's own features, differs from an unset one, the host's.)
    for var in ("COLIBRI_IDOT", "COLIBRI_TILES", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        h.update(repr(os.environ.get(var)).encode())
    return f"kernels-{h.hexdigest()[:12]}"


_LOADED_CACHE_DIR = ""


def loaded_cache_dir() -> str:
    """The numba cache directory the kernels were loaded with (a process compiling for this one,
    colibri.compile_worker, must use exactly it: numba_cache_dir() after a source edit names
    another)."""
    return _LOADED_CACHE_DIR


@contextmanager
def _cache_in_user_dir():
    """numba picks a function's cache directory when its decorator runs, from
    numba.config.CACHE_DIR (read from $NUMBA_CACHE_DIR when numba was imported, which may have
    been before colibri). So set it while the kernel modules are imported, then put it back:
    the user's own cached functions keep numba's default place."""
    from numba.core import config

    from .cache_lock import install

    saved = config.CACHE_DIR
    if not saved:  # an explicit NUMBA_CACHE_DIR (environment or .numba_config.yaml) wins
        config.CACHE_DIR = str(numba_cache_dir())
    install(Path(config.CACHE_DIR))  # two processes may compile into it at once (cache_lock.py)
    global _LOADED_CACHE_DIR
    _LOADED_CACHE_DIR = config.CACHE_DIR
    try:
        yield
    finally:
        config.CACHE_DIR = saved


# Every module holding kernels is imported here, inside the block (tests/test_warmup.py checks).
with _cache_in_user_dir():
    from . import attention, block_idot, decode, delta_rule, idot, moe, ops, team
    from .cpu import embedding, matvec
    from .gemm import matmul
from colibri.formats.qtensor import (
    FLOAT_SCHEMES,
    GROUP_SIZE,
    INT4_SCHEMES,
    SCHEMES,
    QTensor,
    bf16_to_f32,
    dequantize,
    f32_to_bf16,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)


def set_threads(n: int) -> None:
    """Threads the parallel kernels called from this thread use (at most numba's pool, the
    cores numba started with). The engine's default adapts to the other processes on the
    machine: colibri/threads.py, where every thread count is decided."""
    from colibri.threads import ThreadPolicy

    ThreadPolicy(n).apply()


__all__ = [
    "QTensor", "SCHEMES", "GROUP_SIZE", "FLOAT_SCHEMES", "INT4_SCHEMES",
    "quantize", "dequantize", "pack_nibbles", "unpack_nibbles", "bf16_to_f32", "f32_to_bf16",
    "matvec", "matmul", "embedding", "ops", "decode", "moe", "set_threads", "numba_cache_dir",
]
