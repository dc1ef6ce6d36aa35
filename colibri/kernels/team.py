"""A team of threads that works through a whole decode token together.

A small model's token is ~150 short parallel kernels (five per layer on SmolLM2), each a few
tens of microseconds: every one paid a parallel region's start and end, and the serial work
between them (norms, RoPE, the attention merge, SwiGLU) ran on one thread while the other
waited. colibri.kernels.decode.token_layers instead runs all layers in one compiled function
on every thread of a team (run_team: the caller and helper threads, the function compiled
nogil); each thread does the serial glue itself, on private buffers (the same arithmetic, so
the same bits), and the matrix rows and attention chunks of a phase are shared out here.

A phase's pieces are split into one contiguous range per thread; a thread takes pieces from
its own range first, then from the others', through one atomic counter per range (each on
its own cache line, so the common case touches no other core's line), and adds how many it
finished to the phase's done counter once. It then waits until every piece is done. Nothing
waits for a thread that has not arrived: if the members run one after another (a helper not
yet woken, fewer cores than threads), the first does every piece of every phase and the later
ones find nothing left, so the team cannot deadlock.

Plain threads rather than a numba parallel region: a `prange` around the token's function
compiled for 22 s more at the first start, and GNU OpenMP's worker pools (one per thread that
ever ran a parallel region) stop spinning once they outnumber the cores, which made every
region of a generation on a second thread cost ~70 us (threads.run_apart).

Each phase writes its own buffers (one per layer), never reused within the token, because a
thread that took the other's pieces can run a phase ahead of it: an output the slower thread
may still be reading is never overwritten.

A piece's result depends only on its index, never on which thread computed it (the row and
chunk kernels are the step-by-step path's), so the token's numbers are the same whatever the
thread count and scheduling.
"""
from __future__ import annotations

import platform
import threading

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
LINE = 8  # int64 counters per cache line: a counter per line keeps threads off each other's lines


class _Helper:
    """A daemon thread that runs fn(t, *args) each time it is handed one."""

    def __init__(self):
        self._go, self._done = threading.Event(), threading.Event()
        self._job = self._error = None
        threading.Thread(target=self._loop, name="colibri-team", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            fn, t, args = self._job
            try:
                fn(t, *args)
            except BaseException as e:  # handed back to the caller
                self._error = e
            self._job = None
            self._done.set()

    def start(self, fn, t: int, args: tuple) -> None:
        self._done.clear()
        self._job = (fn, t, args)
        self._go.set()

    def join(self) -> BaseException | None:
        """Wait for the job; its exception, if it raised one."""
        self._done.wait()
        error, self._error = self._error, None
        return error


_idle: list[list[_Helper]] = []  # helper sets not in use: as many sets as callers ever ran at once
_idle_lock = threading.Lock()


def run_team(fn, nthreads: int, *args) -> None:
    """fn(t, *args) for t in range(nthreads): t = 0 on the calling thread, the others on helper
    threads (a set taken from the idle ones or started, given back after: two engines decoding
    at once each have their own, and a caller that exits leaves none behind). fn is a nogil
    compiled function built on claim/finish, so the members run at once and the call returns
    when all have finished. Helpers that start late only find less left to do (a phase never
    waits for a member that has not arrived)."""
    with _idle_lock:
        helpers = _idle.pop() if _idle else []
    while len(helpers) < nthreads - 1:
        helpers.append(_Helper())
    try:
        for t in range(1, nthreads):
            helpers[t - 1].start(fn, t, args)
        try:
            fn(0, *args)
        finally:
            errors = [helpers[t - 1].join() for t in range(1, nthreads)]  # all of them, then raise
        for error in errors:
            if error is not None:
                raise error
    finally:
        with _idle_lock:
            _idle.append(helpers)


def _counter_ptr(context, builder, aryty, ary, index):
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [index])


@intrinsic
def atomic_add(typingctx, a, i, v):
    """a[i] += v atomically (sequentially consistent); returns the old value. a: int64 [n]."""
    if not (isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1):
        return None
    sig = types.int64(a, types.intp, types.int64)

    def codegen(context, builder, sig_, args):
        ptr = _counter_ptr(context, builder, sig_.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")
    return sig, codegen


@intrinsic
def atomic_load(typingctx, a, i):
    """a[i], read atomically (sequentially consistent): writes made before another thread's
    atomic_add of this counter are visible after reading its result."""
    if not (isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1):
        return None
    sig = types.int64(a, types.intp)

    def codegen(context, builder, sig_, args):
        ptr = _counter_ptr(context, builder, sig_.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)
    return sig, codegen


@intrinsic
def spin_pause(typingctx):
    """The x86 `pause` hint in a wait loop (a sibling hyperthread gets the core's resources);
    nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def unmanaged(typingctx, a):
    """The same array without its reference count: a view numba does not count, so passing
    it around costs no atomic operation. The team's threads share every weight: counting
    references to the same arrays from two threads made each count bounce between their
    caches (unpacking three shared arrays: 353 ns against 71 ns for private ones). Valid only
    while something else holds the array (the model holds its weights, the cache its arrays)."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):
        view = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()
    return a(a), codegen


@njit(cache=True)
def counters_size(phases, nthreads):
    """Counters for `phases` phases of a team of nthreads, to allocate zeroed: per phase a
    claim counter per thread's range and a done counter, a line each."""
    return phases * (nthreads + 1) * LINE


@njit(cache=True)
def range_of(n, nthreads, r):
    """Thread r's contiguous range of n pieces: [start, stop)."""
    per = (n + nthreads - 1) // nthreads
    return min(n, r * per), min(n, (r + 1) * per)


@njit(cache=True)
def claim(ctr, phase, n, nthreads, t, state):
    """The next piece for thread t of a phase of n pieces, or -1 when none is left. state is
    the thread's int64 [2] cursor for the phase ([range being taken from, pieces finished]),
    zeroed before its first claim; the ranges are taken in the order t, t + 1, ..."""
    base = phase * (nthreads + 1) * LINE
    while state[0] < nthreads:
        r = (t + state[0]) % nthreads
        start, stop = range_of(n, nthreads, r)
        k = start + atomic_add(ctr, base + r * LINE, 1)
        if k < stop:
            state[1] += 1
            return k
        state[0] += 1
    return -1


@njit(cache=True)
def finish(ctr, phase, n, nthreads, state):
    """Report this thread's finished pieces, then wait until all n of the phase are done."""
    done = phase * (nthreads + 1) * LINE + nthreads * LINE
    if state[1]:
        atomic_add(ctr, done, state[1])
    while atomic_load(ctr, done) < n:
        spin_pause()
