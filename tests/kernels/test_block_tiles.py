"""The fused block tiles (colibri/kernels/cpu/block_tiles.py) beyond what the block tests
(test_blocks.py: every entry point's bits, thread counts, the fused MoE kernel) reach: every
block type has a tile; each tile's rows are within float32 rounding of gguf-py on blocks at the
ends of their scales and codes, compiled for this CPU and for an AVX2-only one; the two half ->
float forms a target may compile (F16C or integer IR) give the same bits for every half; and
the prepared x of each tile is a permutation of x scaled by powers of two."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from bench.common import named_cpu_env
from colibri.formats.ggml_blocks import BLOCK_SCHEMES, BLOCK_TYPES
from colibri.formats.qtensor import QTensor
from colibri.kernels.cpu import matvec
from colibri.kernels.cpu.block_tiles import FUSED, halves_f32, prepare_x_fused
from colibri.kernels.cpu.blocks import FUSED_KIND
from colibri.kernels.cpu.target import PSHUFB, native_isa

from test_blocks import F16_FIELDS, random_blocks, reference, shapes

# d, dmin and m at float16's ends (largest, smallest subnormal and normal, zero) and in between
EXTREME_F16 = np.array([65504, -65504, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14, 0, 1, -0.5], np.float16)


def extreme_blocks(scheme, out, n, seed):
    """random_blocks, then row 0's bytes all zero and row 1's all ones (every code and sub-block
    scale at an end of its range), and the f16 fields of row r all EXTREME_F16[r] (the rows past
    them: drawn from it block by block); MXFP4's exponent likewise from its ends (0: a
    subnormal scale) and 127, 200."""
    rng = np.random.default_rng(seed)
    blocks = random_blocks(scheme, out, n, seed).reshape(out, n // BLOCK_TYPES[scheme].elements, -1)
    blocks[0], blocks[1] = 0, 255

    def pick(values):
        v = rng.choice(values, blocks.shape[:2])
        v[:len(values)] = values[:min(out, len(values)), None]
        return v
    for off in F16_FIELDS[scheme]:
        blocks[:, :, off:off + 2] = pick(EXTREME_F16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    if scheme == "mxfp4":
        blocks[:, :, 0] = pick(np.array([0, 1, 2, 127, 200], np.uint8))
    return blocks.reshape(out, -1)


def assert_rows_close(y, t, x):
    """Every row within float32 rounding of float64 gguf-py dequantize @ x: relative to that
    row's sum |w| |x| (rows of very different scales in one matrix), plus a float32 subnormal
    step per weight (MXFP4's smallest scales make subnormal products, and a lookup type's bias
    need not cancel to exactly 0 there)."""
    w = reference(t).astype(np.float64)
    scale = np.abs(w) @ np.abs(x.astype(np.float64))
    err = np.abs(y - w @ x.astype(np.float64))
    bound = 2e-6 * scale + x.shape[0] * 2.0 ** -149
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max():.3g}"


def test_every_block_type_has_a_fused_tile():
    """So test_blocks.py's bit-for-bit and thread-count tests (matvec, matvec_rows, the fused MoE
    kernel) run every tile; the lookup types fall back to decode-then-dot only without pshufb."""
    assert sorted(FUSED) == sorted(BLOCK_SCHEMES)
    if PSHUFB:
        assert (FUSED_KIND >= 0).all()


@pytest.mark.parametrize("kind", FUSED)
def test_tile_rows_at_the_ends_of_scales_and_codes(kind):
    """This CPU's tiles through matvec (test_blocks.py: the other entry points give its bits)."""
    rng = np.random.default_rng(11)
    for i, shape in enumerate(shapes(kind)):
        t = QTensor(kind, shape, extreme_blocks(kind, *shape, 12 + i))
        x = rng.standard_normal(shape[1]).astype(np.float32)
        assert_rows_close(matvec(t, x), t, x)


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


_TARGET_SCRIPT = """
import sys
import numpy as np
from numba import njit
from colibri.kernels.cpu.block_tiles import DOT8, FUSED, prepare_x_fused, prepared_len

def tile_rows(dot8):  # matvec_blocks' loop on one thread, the tile called directly
    @njit
    def run(kind, q, x, y):
        p = prepared_len(kind, x.shape[0])
        xp, xs = np.empty(p, np.float32), np.empty(p // 16 + 16, np.float32)
        prepare_x_fused(kind, x, xp, xs)
        d = np.empty(8, np.float32)
        for r in range(0, q.shape[0], 8):
            dot8(q, r, r + 8, xp, xs, d)
            for j in range(min(8, q.shape[0] - r)):
                y[r + j] = d[j]
    return run

data = np.load(sys.argv[1])
out, asm = {}, ""
for kind, name in enumerate(FUSED):
    run = tile_rows(DOT8[kind])
    q, x = data[name + ".q"], data[name + ".x"]
    y = np.empty(q.shape[0], np.float32)
    run(kind, q, x, y)
    out[name] = y
    asm += run.inspect_asm(run.signatures[0])
np.savez(sys.argv[2], **out)
print("zmm" in asm, "ymm" in asm)
"""


@pytest.mark.skipif(native_isa() == "generic" or not PSHUFB, reason="runs AVX2 code: an x86 CPU with AVX2")
def test_tiles_compiled_for_avx2_are_within_rounding(tmp_path):
    """Every tile compiled for haswell (AVX2, F16C; <16 x float> split in two registers) in a
    child process, NUMBA_CPU_FEATURES empty so LLVM takes haswell's own features (numba keeps
    the host's with a CPU name alone, AVX-512 included): no AVX-512 register in their code, and
    every row within float32 rounding of gguf-py, as this CPU's tiles are (above)."""
    rng = np.random.default_rng(13)
    tensors, data = {}, {}
    for kind in FUSED:
        shape = shapes(kind)[0]
        tensors[kind] = QTensor(kind, shape, extreme_blocks(kind, *shape, 14))
        data[kind + ".q"] = tensors[kind].q
        data[kind + ".x"] = rng.standard_normal(shape[1]).astype(np.float32)
    np.savez(tmp_path / "in.npz", **data)
    env = {**os.environ, **named_cpu_env("haswell"), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}  # (as bench --cpu)
    p = subprocess.run([sys.executable, "-c", _TARGET_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                       env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "True"]  # AVX2's ymm registers, no AVX-512 zmm
    got = np.load(tmp_path / "out.npz")
    for kind in FUSED:
        assert_rows_close(got[kind], tensors[kind], data[kind + ".x"])
