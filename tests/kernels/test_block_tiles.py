"""The fused K-quant tiles' pieces that the block tests (test_blocks.py) cannot reach on one
CPU: the two half -> float forms a target may compile (F16C or integer IR) give the same bits
for every half, and the prepared x of each tile is a permutation of x scaled by powers of two."""
import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from colibri.kernels.cpu.block_tiles import FUSED, halves_f32, prepare_x_fused


def _converter(f16c: bool):
    @intrinsic
    def conv(typingctx, src, dst, i):
        def codegen(context, builder, sig, args):
            sa = context.make_array(sig.args[0])(context, builder, args[0])
            da = context.make_array(sig.args[1])(context, builder, args[1])
            at = builder.mul(args[2], ir.Constant(ir.IntType(64), 8))
            ptr = builder.gep(builder.bitcast(sa.data, ir.IntType(16).as_pointer()), [at])

            def load(p, ty, align):
                return builder.load(builder.bitcast(p, ty.as_pointer()), align=align)
            v = halves_f32(builder, ptr, 8, load, f16c)
            out = builder.gep(builder.bitcast(da.data, ir.FloatType().as_pointer()), [at])
            builder.store(v, builder.bitcast(out, ir.VectorType(ir.FloatType(), 8).as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(src, dst, types.intp), codegen

    @njit
    def run(src, dst):
        for i in range(src.shape[0] // 8):
            conv(src, dst, i)
    return run


@pytest.mark.parametrize("f16c", [True, False])
def test_every_half_converts_exactly(f16c):
    src = np.arange(65536, dtype=np.uint16)
    dst = np.empty(65536, np.float32)
    _converter(f16c)(src, dst)
    ref = src.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(dst.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.isnan(dst[nan]).all()


@pytest.mark.parametrize("kind", range(len(FUSED)), ids=FUSED)
def test_prepared_x_is_x_permuted_and_scaled_by_powers_of_two(kind):
    x = np.random.default_rng(kind).standard_normal(512).astype(np.float32)
    xp, xs = np.empty(512, np.float32), np.empty(32, np.float32)
    prepare_x_fused(kind, x, xp, xs)
    for b in range(0, 512, 128):
        ratio = np.abs(xp[b:b + 128])
        mant = np.frexp(ratio)[0]
        assert sorted(np.frexp(np.abs(x[b:b + 128]))[0].tolist()) == sorted(mant.tolist())
    np.testing.assert_allclose(xs, x.reshape(32, 16).sum(1), rtol=1e-5, atol=1e-6)
