"""numba's on-disk cache written by two processes at once, safely.

A first start compiles in two processes together (colibri.warmup): the engine's own and a
compile process of its own, both saving to the same cache directory. numba saves an entry by
reading the function's index, picking the first free data file number, writing the index and
then the data file, with nothing held between: two processes saving two signatures of one
function (a kernel both call, typed differently) could both pick number 1, and the index of
one would then point at the other's machine code, loaded for the wrong argument types. So
every save, and every load (which reads the index, then the file it names), holds a lock on
the cache directory here: a save takes milliseconds, and the processes rarely meet.

Only directories under colibri's kernel cache are locked; other numba caches are left as they
are."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".colibri-cache.lock"

_roots: set[str] = set()


def install(root: Path) -> None:
    """Lock numba's cache saves and loads under `root` (called once per cache directory)."""
    try:
        import fcntl  # noqa: F401  (POSIX only: elsewhere the cache stays numba's own)
    except ImportError:
        return
    from numba.core.caching import IndexDataCacheFile

    _roots.add(os.path.realpath(root))
    if getattr(IndexDataCacheFile, "_colibri_locked", False):
        return
    save, load = IndexDataCacheFile.save, IndexDataCacheFile.load

    def locked_save(self, key, data):
        with _locked(self._cache_path, exclusive=True):
            return save(self, key, data)

    def locked_load(self, key):
        with _locked(self._cache_path, exclusive=False):
            return load(self, key)

    IndexDataCacheFile.save, IndexDataCacheFile.load = locked_save, locked_load
    IndexDataCacheFile._colibri_locked = True


@contextmanager
def _locked(cache_path: str, exclusive: bool):
    import fcntl

    real = os.path.realpath(cache_path)
    if not any(real == r or real.startswith(r + os.sep) for r in _roots):
        yield
        return
    try:
        os.makedirs(real, exist_ok=True)
        fd = os.open(os.path.join(real, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # an unwritable cache: numba's own behaviour (it cannot save there either)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
