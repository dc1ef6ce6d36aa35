"""Numba CPU kernels against the numpy reference dequantize(t) in float64, odd shapes included."""
import numpy as np
import pytest

from colibri.kernels.cpu import embedding, matvec
from colibri.kernels.gemm import matmul
from colibri.formats.ggml_blocks import BLOCK_TYPES
from colibri.formats.qtensor import SCHEMES, QTensor, dequantize, quantize

# (out, in): single row, row counts that are not a multiple of 8-row blocks or 2 threads, a very
# wide row, a tall matrix with several matmul tiles, and 8-row blocks of rows long enough to be
# taken two rows at a time (cpu.PAIR_ROW_BYTES).
SHAPES = [(1, 64), (7, 128), (13, 192), (37, 128), (3, 16384), (4096, 256), (21, 4096)]


def make(scheme, shape, seed):
    if scheme in BLOCK_TYPES and shape[1] % BLOCK_TYPES[scheme].elements:
        pytest.skip(f"{scheme} rows hold whole blocks of {BLOCK_TYPES[scheme].elements} inputs, not {shape[1]}")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, : min(64, shape[1])] *= 50.0  # groups of very different scale
    return quantize(w, scheme)


def assert_close(y, ref):
    ref = np.asarray(ref, np.float64)
    atol = 1e-5 * np.abs(ref).max() + 1e-6
    np.testing.assert_allclose(y, ref, rtol=0, atol=atol)


@pytest.fixture(scope="module", params=SCHEMES)
def scheme(request):
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matvec(scheme, shape):
    t = make(scheme, shape, 1)
    x = np.random.default_rng(2).standard_normal(shape[1]).astype(np.float32)
    y = matvec(t, x)
    assert y.dtype == np.float32 and y.shape == (shape[0],)
    assert_close(y, dequantize(t).astype(np.float64) @ x)


MATMUL_CASES = [(s, L) for s in [(7, 128), (13, 192), (3, 16384)] for L in (1, 3, 17)] + [((4096, 256), 17), ((4096, 256), 130), ((37, 128), 200)]


def case_id(c):
    return f"{c[0]}x{c[1]}" if isinstance(c, tuple) else f"L{c}"


@pytest.mark.parametrize("shape,L", MATMUL_CASES, ids=case_id)
def test_matmul(scheme, shape, L):
    t = make(scheme, shape, 3)
    x = np.random.default_rng(4).standard_normal((L, shape[1])).astype(np.float32)
    y = matmul(t, x)
    assert y.dtype == np.float32 and y.shape == (L, shape[0])
    assert_close(y, x.astype(np.float64) @ dequantize(t).astype(np.float64).T)


@pytest.mark.parametrize("shape", [(13, 192), (4096, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_embedding_equals_reference_rows(scheme, shape):
    t = make(scheme, shape, 5)
    ids = np.array([0, shape[0] - 1, 5, 5, 2, 11], dtype=np.int32)
    e = embedding(t, ids)
    assert e.dtype == np.float32 and e.shape == (6, shape[1])
    np.testing.assert_array_equal(e, dequantize(t)[ids])  # exact: no reduction involved


def test_embedding_of_one_id_equals_reference_row(scheme):
    """A decode token's single id takes a serial path of its own (no parallel region)."""
    t = make(scheme, (13, 192), 5)
    for i in (0, 6, 12):
        e = embedding(t, np.array([i]))
        assert e.dtype == np.float32 and e.shape == (1, 192)
        np.testing.assert_array_equal(e, dequantize(t)[[i]])


@pytest.mark.parametrize("scheme_name", ["f16", "bf16"])
def test_half_decoding_exhaustive(scheme_name):
    """Every one of the 65536 bit patterns (subnormals, inf, NaN payloads) decodes exactly."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(1, -1)
    if scheme_name == "f16":
        t = QTensor("f16", bits.shape, bits.view(np.float16))
        ref = bits.view(np.float16).astype(np.float32)
    else:
        t = QTensor("bf16", bits.shape, bits)
        ref = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(embedding(t, np.array([0])).view(np.uint32), ref.view(np.uint32))


def test_out_argument_is_filled_and_returned():
    t = make("int4_g64", (13, 192), 6)
    x = np.random.default_rng(7).standard_normal(192).astype(np.float32)
    out = np.full(13, np.nan, np.float32)
    assert matvec(t, x, out) is out
    assert_close(out, dequantize(t).astype(np.float64) @ x)
    X = np.random.default_rng(8).standard_normal((3, 192)).astype(np.float32)
    out2 = np.full((3, 13), np.nan, np.float32)
    assert matmul(t, X, out2) is out2
    assert_close(out2, X.astype(np.float64) @ dequantize(t).astype(np.float64).T)


def test_noncontiguous_inputs_are_handled():
    t = make("q4_1", (7, 128), 9)
    rng = np.random.default_rng(10)
    x = rng.standard_normal(256).astype(np.float32)[::2]
    assert_close(matvec(t, x), dequantize(t).astype(np.float64) @ x)
    X = rng.standard_normal((128, 5)).astype(np.float32).T  # Fortran order
    assert_close(matmul(t, X), X.astype(np.float64) @ dequantize(t).astype(np.float64).T)
    assert_close(matvec(t.rows(2, 6), x), dequantize(t)[2:6].astype(np.float64) @ x)


def test_bad_inputs_raise_clear_errors():
    t = make("int4_g64", (7, 128), 11)
    x = np.zeros(128, np.float32)
    with pytest.raises(ValueError, match="float32"):
        matvec(t, x.astype(np.float64))
    with pytest.raises(ValueError, match=r"shape \[128\]"):
        matvec(t, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match=r"\[L, 128\]"):
        matmul(t, x)
    with pytest.raises(ValueError, match="out must be"):
        matvec(t, x, out=np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        matvec(t, x, out=np.zeros(7, np.float64))
    with pytest.raises(ValueError, match="out of range"):
        embedding(t, np.array([0, 7]))
    with pytest.raises(ValueError, match="out of range"):
        embedding(t, np.array([-1]))
    with pytest.raises(ValueError, match="token id 7 is out of range"):
        embedding(t, np.array([7]))
    with pytest.raises(ValueError, match="integer"):
        embedding(t, np.array([0.0, 1.0]))
    broken = QTensor("int4_g64", (7, 128), t.q.astype(np.int8), t.scales)
    with pytest.raises(ValueError, match="uint8"):
        matvec(broken, x)


def test_empty_batches():
    t = make("q8_0", (7, 128), 12)
    assert matmul(t, np.zeros((0, 128), np.float32)).shape == (0, 7)
    assert embedding(t, np.zeros(0, np.int64)).shape == (0, 128)


def test_blas_matmul_same_bits_with_any_thread_count():
    """Tiles are dealt to threads, not cut by them: the thread count never changes a bit."""
    import numba

    from colibri.kernels import gemm

    t = make("q4_1", (4096, 256), 11)
    x = np.random.default_rng(12).standard_normal((gemm.BLAS_MIN_ROWS + 5, 256)).astype(np.float32)
    saved = numba.get_num_threads()
    try:
        outs = []
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            outs.append(matmul(t, x))
    finally:
        numba.set_num_threads(saved)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    assert_close(outs[0], x.astype(np.float64) @ dequantize(t).astype(np.float64).T)


def test_blas_tiles_are_even_bounded_and_from_the_shape_only():
    from colibri.kernels import gemm

    for out, n_in in ((576, 576), (1536, 576), (576, 1536), (49152, 576), (100, 4096), (16, 64), (5120, 2048)):
        rows = gemm._tile_rows(out, n_in)
        tiles = -(-out // rows)
        assert rows % 16 == 0
        assert rows * n_in * 4 <= max(gemm.TILE_BYTES, 16 * n_in * 4)
        assert tiles == 1 or tiles % 2 == 0 or rows == 16, (out, n_in, rows)


@pytest.mark.parametrize("group", [128, 256])
def test_int4_row_kernel_with_groups_wider_than_a_block(group):
    """No scheme has groups past 64 yet, but the row kernel takes any power-of-two number of
    16-byte chunks per group: a 64-byte block then lies in one group (its scale is spread
    over all lanes), checked here against the layout's definition (byte k of a group holds
    element k in its low nibble and k + group/2 in its high one; w = (nibble - 8) * s)."""
    from colibri.kernels.cpu.matvec import chunk_shift, matvec_int4

    rng = np.random.default_rng(7)
    rows, n, half = 19, 4 * group + 64 if group == 128 else 2 * group, group // 2
    n -= n % group
    q = rng.integers(0, 256, (rows, n // 2), dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, (rows, n // group)).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    nib = np.empty((rows, n), np.float64)
    for g in range(n // group):
        b = q[:, g * half:(g + 1) * half]
        nib[:, g * group:g * group + half] = b & 15
        nib[:, g * group + half:(g + 1) * group] = b >> 4
    w = (nib - 8.0) * np.repeat(scales, group, axis=1)
    y = np.empty(rows, np.float32)
    matvec_int4(q, scales, scales, np.float32(-8.0), half, chunk_shift(half), 1, x, y, 2)
    assert_close(y, w @ x)
