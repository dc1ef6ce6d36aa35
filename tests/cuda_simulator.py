"""pytest plugin for the runs under numba's CUDA simulator (`-p cuda_simulator`, see
tests/kernels/test_cuda.py): a faster block runner, the same semantics.

The simulator runs each GPU thread of a block as a Python thread, and its BlockManager polls
every thread in a busy loop to see which ones wait in syncthreads(); under the GIL that loop
took most of the time (a tiny model's decode step: ~13 s). Here a block's threads share a
barrier on a condition variable instead: syncthreads() returns once every thread of the block
that has not returned has reached it, which is what the polling loop decided too. Only the
runner changes; kernels, arrays and the thread API are numba's own.
"""
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from numba.core import config

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

    def _release(self):
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()


def _run_block(self, grid_point, *args):
    from numba.cuda.simulator.kernel import BlockThread

    barrier = _Barrier(int(np.prod(self._block_dim)))

    def target():
        try:
            self._f(*args)
        finally:
            barrier.leave()

    threads = []
    for block_point in np.ndindex(*self._block_dim):
        t = BlockThread(target, self, grid_point, block_point, self._debug)
        t.syncthreads = barrier.wait  # syncthreads_count/and/or call it too
        threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in threads:
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


if config.ENABLE_CUDASIM:
    from numba.cuda.simulator import kernel as _kernel

    if hasattr(_kernel, "BlockManager") and hasattr(_kernel, "BlockThread"):
        _kernel.BlockManager.run = _run_block
