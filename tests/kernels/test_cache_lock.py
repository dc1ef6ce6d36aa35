"""numba's cache index written by two processes at once (colibri/kernels/cache_lock.py): a first
start compiles in the engine's process and in a compile process of its own (colibri.warmup),
both saving into one cache directory."""
import multiprocessing
import threading
import time

import colibri.kernels  # noqa: F401  (installs the lock)
from colibri.kernels import cache_lock


def cache_file(path):
    from numba.core.caching import IndexDataCacheFile

    return IndexDataCacheFile(str(path), "f-1.py38", ("stamp", 1))


def save_many(path, who, n):
    cache_lock.install(path)
    f = cache_file(path)
    for i in range(n):
        f.save((who, i), f"{who}-{i}".encode())


def test_saves_from_two_processes_keep_every_entry_with_its_own_data(tmp_path):
    """Each process saves entries of its own under one function's index, at the same time:
    every entry is kept and names the data saved for it (numba alone picks data file numbers
    from an index read before the other process's save, and one entry could name another's)."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=save_many, args=(tmp_path, who, 40)) for who in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    cache_lock.install(tmp_path)
    f = cache_file(tmp_path)
    for who in ("a", "b"):
        for i in range(40):
            assert f.load((who, i)) == f"{who}-{i}".encode(), (who, i)


def test_a_save_waits_for_the_directory_lock(tmp_path):
    import fcntl
    import os

    cache_lock.install(tmp_path)
    f = cache_file(tmp_path)
    fd = os.open(tmp_path / cache_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = threading.Event()
    t = threading.Thread(target=lambda: (f.save("k", b"v"), done.set()))
    t.start()
    time.sleep(0.3)
    assert not done.is_set()  # held by "another process"
    os.close(fd)
    t.join(10)
    assert done.is_set() and f.load("k") == b"v"


def test_other_numba_caches_are_left_alone(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    f = cache_file(tmp_path / "elsewhere")
    f.save("k", b"v")
    assert f.load("k") == b"v"
    assert not (tmp_path / "elsewhere" / cache_lock.LOCK_NAME).exists()
