"""The floating-point environment a kernel runs in: subnormals flushed to zero (x86's MXCSR
flush-to-zero and denormals-are-zero bits) for the span of a kernel's loop body, then the
caller's setting back.

Why: an operation on a subnormal float (|x| < 2^-126) takes a microcode assist, ~100 cycles
instead of one, on Intel and AMD alike. The recurrent layers' decays make them by the million.
A Gated DeltaNet or KDA channel that forgets fast multiplies its state by e^-3 a token, and a
chunk's pair factors e^(c_i - c_m) reach e^-190, so their products sweep through the subnormal
range. One 64-token chunk of one 128 x 128 head took 12-27 ms with decays of -3 to -10 x |N(0, 1)|
a token, against 0.4-0.8 ms with mild ones (`python -m bench.kernels.delta_rule`). Flushed, those
values become 0. A value below 2^-126 is summed with terms near 1, so dropping it is far below
float32's rounding.

The setting belongs to a thread, so it is set and restored inside each parallel iteration:
numba's worker threads run other kernels afterwards. Every iteration flushes alike, so any
thread count gives the same bits.

Elsewhere than x86 both calls compile to nothing.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_FTZ_DAZ = 0x8040  # MXCSR bit 15 flush-to-zero, bit 6 denormals-are-zero
_I8P, _I32 = ir.IntType(8).as_pointer(), ir.IntType(32)


def _mxcsr(builder, op: str, slot):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8P]), f"llvm.x86.sse.{op}")
    builder.call(fn, [builder.bitcast(slot, _I8P)])


def _read(builder):
    """(a stack slot, this thread's MXCSR read into it)."""
    slot = cgutils.alloca_once(builder, _I32)
    _mxcsr(builder, "stmxcsr", slot)
    return slot, builder.load(slot)


@intrinsic
def flush_subnormals(typingctx):
    """Set flush-to-zero and denormals-are-zero on this thread; returns the setting to restore."""
    def codegen(context, builder, sig, args):
        if not X86:
            return ir.Constant(_I32, 0)
        slot, old = _read(builder)
        builder.store(builder.or_(old, ir.Constant(_I32, _FTZ_DAZ)), slot)
        _mxcsr(builder, "ldmxcsr", slot)
        return old
    return types.int32(), codegen


@intrinsic
def restore_fp(typingctx, old):
    """Put back the setting flush_subnormals returned."""
    def codegen(context, builder, sig, args):
        if X86:
            slot = cgutils.alloca_once(builder, _I32)
            builder.store(args[0], slot)
            _mxcsr(builder, "ldmxcsr", slot)
        return context.get_dummy_value()
    return types.void(types.int32), codegen


@intrinsic
def fp_setting(typingctx):
    """This thread's MXCSR (0 elsewhere than x86): for tests."""
    def codegen(context, builder, sig, args):
        return _read(builder)[1] if X86 else ir.Constant(_I32, 0)
    return types.int32(), codegen
