"""The interleaved int4 layout (formats/qtensor.py, Layout): every kernel gives the same bits on an
interleaved matrix as on the row-major one, and the repacking round-trips."""
import numpy as np
import pytest

from colibri.kernels import cpu, gemm, idot
from colibri.formats.qtensor import (PAIR_ROW_BYTES, QTensor, dequantize, interleave_width, interleaved, quantize,
                                   row_major)
from colibri.models.layers import fuse_rows

# (scheme, rows, inputs): rows of 288 B (a 32-byte tail past 4 whole blocks, SmolLM2's 576),
# 320 B (5 whole blocks), 768 B, 1 KB (read two rows at a time) and 1.5 KB with a tail.
CASES = [("q4_1", 64, 576), ("int4_g64", 48, 640), ("q4_0", 32, 1536), ("int4_g64", 40, 2048),
         ("q4_1", 16, 3104)]
# q8_0 (one byte a weight): rows of 576 B (a 0-byte tail), 608 B (a 32-byte tail), 2 KB.
Q8_CASES = [("q8_0", 64, 576), ("q8_0", 24, 608), ("q8_0", 16, 2048)]


def _matrix(scheme, rows, n, seed=0):
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((rows, n)).astype(np.float32), scheme)


@pytest.mark.parametrize("scheme,rows,n", CASES + Q8_CASES)
def test_repacking_round_trips(scheme, rows, n):
    t = _matrix(scheme, rows, n)
    for width in (2, 8):
        it = interleaved(t, width)
        assert it.interleave == width and it.q.shape == t.q.shape
        assert not np.array_equal(it.q, t.q)  # the bytes did move
        np.testing.assert_array_equal(row_major(it).q, t.q)
        np.testing.assert_array_equal(dequantize(it), dequantize(t))
    assert interleaved(t).interleave == (2 if t.q.shape[1] >= PAIR_ROW_BYTES else 8)


@pytest.mark.parametrize("scheme,rows,n,width", [("q4_1", 64, 576, 8), ("q4_1", 16, 3104, 2),
                                                  ("q8_0", 24, 608, 8)])
def test_in_place_repacking_matches_the_reference(scheme, rows, n, width):
    t = _matrix(scheme, rows, n)
    want = interleaved(t, width).q.copy()  # numpy
    q = t.q
    it = interleaved(t, width, in_place=True)  # numba, in the array itself
    assert it.q is q
    np.testing.assert_array_equal(q, want)


def test_width_follows_the_rows():
    assert interleave_width(_matrix("q4_1", 12, 576)) == 1  # rows past a block of eight: left row-major
    assert interleave_width(_matrix("f32", 64, 576)) == 1
    assert interleave_width(_matrix("q8_0", 64, 576)) == 8
    assert interleave_width(_matrix("q8_0", 64, 1024)) == 2  # q8_0 rows are 1 KB at 1024 inputs
    assert interleave_width(_matrix("int4_g64", 64, 2048)) == 2
    with pytest.raises(ValueError, match="cannot be interleaved"):
        interleaved(_matrix("q4_1", 12, 576), 8)


@pytest.mark.parametrize("scheme,rows,n", CASES + Q8_CASES)
@pytest.mark.parametrize("width", [2, 8])
def test_kernels_give_the_same_bits(scheme, rows, n, width):
    t = _matrix(scheme, rows, n, seed=1)
    it = interleaved(t, width)
    rng = np.random.default_rng(2)
    x = rng.standard_normal(n).astype(np.float32)
    X = rng.standard_normal((5, n)).astype(np.float32)
    np.testing.assert_array_equal(cpu.matvec(it, x), cpu.matvec(t, x))
    np.testing.assert_array_equal(cpu.matvec_rows(it, X), cpu.matvec_rows(t, X))
    if scheme != "q8_0":  # int4 x int8 integer dots
        np.testing.assert_array_equal(idot.matvec_q(it, x), idot.matvec_q(t, x))
        np.testing.assert_array_equal(idot.matmul_q(it, X), idot.matmul_q(t, X))
    ids = np.array([0, rows - 1, 3, 7, 3])
    np.testing.assert_array_equal(cpu.embedding(it, ids), cpu.embedding(t, ids))
    np.testing.assert_array_equal(gemm.matmul(it, X), gemm.matmul(t, X))  # numba tiles
    L = rng.standard_normal((gemm.BLAS_MIN_ROWS, n)).astype(np.float32)
    np.testing.assert_array_equal(gemm.matmul(it, L), gemm.matmul(t, L))  # dequantized tiles + BLAS


def test_stacking_and_slicing_keep_whole_blocks():
    a, b = _matrix("q4_1", 16, 576, seed=3), _matrix("q4_1", 32, 576, seed=4)
    fused = fuse_rows(interleaved(a, 8), interleaved(b, 8))
    assert fused.interleave == 8
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(a), dequantize(b)]))
    np.testing.assert_array_equal(dequantize(fused.rows(16, 48)), dequantize(b))
    with pytest.raises(ValueError, match="cut blocks"):
        fused.rows(4, 16)
    assert fuse_rows(interleaved(a, 8), b) is None  # layouts differ: not stacked


def test_a_bad_width_is_refused_by_the_kernels():
    t = _matrix("q4_1", 64, 576)
    bad = QTensor(t.scheme, t.shape, t.q, t.scales, t.mins, interleave=3)
    with pytest.raises(ValueError, match="interleaved in blocks of 3"):
        cpu.matvec(bad, np.zeros(576, np.float32))


def test_engine_layouts_give_the_same_bits(smollm2_container):
    """SmolLM2 (q4_1 layers, a tied q8_0 head) loaded interleaved and row-major: the same
    logits over a prompt (prefill) and the same greedy tokens (the one-call decode)."""
    from colibri.engine import Engine

    engines = {layout: Engine.load(smollm2_container, weight_layout=layout, max_context=128)
               for layout in ("interleaved", "rows")}
    assert engines["interleaved"].model.layers[0].attn.qkv.interleave == 8
    assert engines["rows"].model.layers[0].attn.qkv.interleave == 1
    ids = engines["rows"].encode_prompt("The quick brown fox jumps over the lazy dog.", raw=True)
    np.testing.assert_array_equal(engines["interleaved"].logits(ids), engines["rows"].logits(ids))
    a, b = (e.generate("Name three fruits.", max_tokens=16, stop_at_eos=False).token_ids for e in engines.values())
    assert a == b


def test_engine_refuses_an_unknown_layout(smollm2_container):
    from colibri.engine import Engine
    from colibri.errors import ColibriError

    with pytest.raises(ColibriError, match="weight_layout must be one of interleaved, rows"):
        Engine.load(smollm2_container, weight_layout="columns")
