"""pytest plugin for the runs under numba's CUDA simulator (`-p cuda_simulator`, see
tests/kernels/test_cuda.py): a faster simulator, the same semantics.

The simulator runs each GPU thread of a block as a Python thread. These costs dominated a tiny
model's decode step, and each is replaced here without changing what a kernel sees:
- numba's BlockManager polls every thread in a busy loop to see which ones wait in
  syncthreads(); under the GIL that loop took most of the time (~13 s a step). A block's
  threads share a barrier on a condition variable instead: syncthreads() returns once every
  thread of the block that has not returned has reached it, which is what the polling decided.
- a new OS thread per GPU thread per block (~150 us each on a VM: most of an elementwise
  kernel's time). A pool of threads is reused; each takes on the thread identity
  (threadIdx, blockIdx, thread_id) the API reads from threading.current_thread().
- cuda.shared.array() finding its allocation by the caller's file and line through
  traceback.extract_stack(), which walks (and reads the source of) the whole stack on every
  call in every thread: the caller's frame gives the same key.
- numba's scalar types called as casts (`float32(0.0)`, all through the kernels) import the
  signature machinery on every call before casting: the cast comes first here.
- kernel array arguments wrapped for recarray-style field access, whose every index and
  `.shape` went through extra Python calls (`.shape` through dir()): plain-dtype arrays reach
  the kernel as the ndarray the wrapper held, the same memory.
Kernels, arrays and the thread API are numba's own.
"""
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from numba.core import config, types as _types
from numba.np import numpy_support as _numpy_support

ROOT = Path(__file__).resolve().parents[1]


def rerun_under_simulator(test_file: str, cwd: Path, timeout: float) -> None:
    """Run `test_file` again in a fresh pytest process with NUMBA_ENABLE_CUDASIM=1 (it must be
    set before numba is imported, and the suite's process has imported it) and this plugin;
    fail with its output unless its tests ran and passed."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                        "-p", "cuda_simulator", test_file],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert re.search(r"\b\d+ passed", r.stdout) and not re.search(r"\b\d+ failed", r.stdout), r.stdout[-3000:]


class _Barrier:
    """syncthreads for one block: releases when all its live threads wait; a thread that
    returns stops counting (and may complete the others' barrier)."""

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.live = n
        self.waiting = 0
        self.generation = 0

    def wait(self):
        with self.cond:
            self.waiting += 1
            if self.waiting == self.live:
                self._release()
            else:
                generation = self.generation
                while generation == self.generation:
                    self.cond.wait()

    def leave(self):
        with self.cond:
            self.live -= 1
            if self.waiting and self.waiting == self.live:
                self._release()
            if not self.live:
                self.cond.notify_all()

    def join(self):
        """Wait until every thread of the block has returned."""
        with self.cond:
            while self.live:
                self.cond.wait()

    def _release(self):
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()


class _PoolThread(threading.Thread):
    """A simulator thread that runs one GPU thread after another: the attributes numba's
    kernel API and BlockThread's syncthreads_* read are set for each job."""

    def __init__(self):
        from numba.cuda.simulator.kernel import BlockThread

        super().__init__(daemon=True)
        self.ready = threading.Semaphore(0)
        self.job = None
        for name in ("syncthreads_count", "syncthreads_and", "syncthreads_or"):  # they call self.syncthreads
            setattr(self, name, getattr(BlockThread, name).__get__(self))
        self.start()

    def run(self):
        while True:
            self.ready.acquire()
            f, args, barrier = self.job
            try:
                f(*args)
            except Exception as e:  # reported by the block's runner, as BlockThread.run words it
                where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                self.exception = (type(e)(f"{where}: {e}" if str(e) else where), sys.exc_info()[2])
            finally:
                barrier.leave()


_idle: list[_PoolThread] = []
_idle_lock = threading.Lock()


def _run_block(self, grid_point, *args):
    from numba.cuda.simulator.kernelapi import Dim3

    points = list(np.ndindex(*self._block_dim))
    with _idle_lock:
        workers = [_idle.pop() if _idle else None for _ in points]
    workers = [w or _PoolThread() for w in workers]
    barrier = _Barrier(len(points))
    block_dim = Dim3(*self._block_dim)
    block_idx = Dim3(*grid_point)
    for w, point in zip(workers, points):
        w.blockIdx, w.threadIdx = block_idx, Dim3(*point)
        w.thread_id = point[0] + block_dim.x * (point[1] + block_dim.y * point[2])
        w._manager, w.exception = self, None  # _manager: the syncthreads_* block state
        w.syncthreads = barrier.wait
        w.job = (self._f, args, barrier)
        w.ready.release()
    barrier.join()
    with _idle_lock:
        _idle.extend(workers)
    for w in workers:
        if w.exception:
            raise w.exception[0].with_traceback(w.exception[1])


if config.ENABLE_CUDASIM:
    from numba.cuda.simulator import kernel as _kernel

    if hasattr(_kernel, "BlockManager") and hasattr(_kernel, "BlockThread"):
        _kernel.BlockManager.run = _run_block
    if hasattr(_kernel, "FakeWithinKernelCUDAArray"):
        _wrap_array = _kernel.FakeWithinKernelCUDAArray

        def _plain_array(item):
            """A kernel's array argument as the ndarray it wraps: the wrapper only adds
            recarray-style field access (kept for structured dtypes), and each index or
            `.shape` through it cost microseconds (`.shape` calls dir() on the array)."""
            ary = getattr(item, "_ary", None)
            if isinstance(ary, np.ndarray) and ary.dtype.fields is None:
                return ary
            return _wrap_array(item)

        _kernel.FakeWithinKernelCUDAArray = _plain_array

    _type_call = _types.Type.__call__

    def _cast_first(self, *args):
        """numba's Type.__call__ with its cast case (one non-type argument) before the import it
        needs only for signatures."""
        if len(args) == 1 and isinstance(args[0], (int, float, np.generic)):  # not a Type: a cast
            return self.cast_python_value(args[0])
        return _type_call(self, *args)

    _types.Type.__call__ = _cast_first

    from numba.cuda.simulator import kernelapi as _kernelapi

    if hasattr(_kernelapi, "FakeCUDAShared"):
        _shared_array = _kernelapi.FakeCUDAShared.array

        def _shared_array_by_caller(self, shape, dtype):
            """numba's FakeCUDAShared.array, keyed by the caller's (file, line) as it is there."""
            if shape == 0 or not isinstance(getattr(self, "_allocations", None), dict):
                return _shared_array(self, shape, dtype)  # dynamic shared memory
            caller = sys._getframe(1)
            key = (caller.f_code.co_filename, caller.f_lineno)
            res = self._allocations.get(key)
            if res is None:
                if isinstance(dtype, _types.Type):
                    dtype = _numpy_support.as_dtype(dtype)
                res = self._allocations[key] = np.empty(shape, dtype)
            return res

        _kernelapi.FakeCUDAShared.array = _shared_array_by_caller
