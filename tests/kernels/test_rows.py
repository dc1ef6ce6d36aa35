"""matvec_rows, the multi-row decode kernel: each row equals matvec of that row bit for bit (the
promise that batching and speculation never change a token rests on it), with any number of
rows and threads, and stays within float32 rounding of the float64 reference."""
from pathlib import Path

import numpy as np
import pytest
from numba import get_num_threads, set_num_threads

from colibri.kernels.cpu import TILE_A, matvec, matvec_rows
from colibri.formats.ggml_blocks import BLOCK_TYPES
from colibri.formats.qtensor import SCHEMES, dequantize, quantize
from colibri.kernels.cpu.target import narrow_tiles

from compiled_forms import run_in_forms


def make(scheme, shape, seed):
    if scheme in BLOCK_TYPES and shape[1] % BLOCK_TYPES[scheme].elements:
        pytest.skip(f"{scheme} rows hold whole blocks of {BLOCK_TYPES[scheme].elements} inputs, not {shape[1]}")
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    w[0, :32] *= 50.0  # groups of very different scale in one row
    return quantize(w, scheme)

# Row counts that are whole blocks of eight, blocks plus a tail (the one-row kernel's tail
# code), fewer than a tile, a q8/int4 width with many groups per row, and int4 rows long
# enough for the one-row kernel to take its blocks two rows at a time (cpu.PAIR_ROW_BYTES).
SHAPES = [(64, 128), (13, 192), (37, 576), (8, 1536), (3, 64), (19, 2048)]
# Token counts: one, each partial tile, whole tiles, and tiles plus a remainder.
ROWS = [1, 2, 3, TILE_A, TILE_A + 1, 2 * TILE_A + 3]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_is_the_one_row_kernel_bit_for_bit(scheme, shape):
    t = make(scheme, shape, 5)
    rng = np.random.default_rng(6)
    for B in ROWS:
        x = rng.standard_normal((B, shape[1])).astype(np.float32)
        x[0] *= 1e3  # rows of very different magnitude share the tiles
        y = matvec_rows(t, x)
        assert y.shape == (B, shape[0]) and y.dtype == np.float32
        for a in range(B):
            assert np.array_equal(y[a], matvec(t, x[a])), f"row {a} of {B}"
        w = dequantize(t).astype(np.float64)  # float32 rounding of the terms' magnitudes
        np.testing.assert_allclose(y[-1], w @ x[-1], rtol=0, atol=1e-5 * (np.abs(w) @ np.abs(x[-1])).max())


def test_rows_do_not_depend_on_the_thread_count():
    t = make("q4_1", (40, 256), 7)
    x = np.random.default_rng(8).standard_normal((6, 256)).astype(np.float32)
    saved = get_num_threads()
    try:
        set_num_threads(1)
        one = matvec_rows(t, x)
        set_num_threads(saved)
        many = matvec_rows(t, x)
    finally:
        set_num_threads(saved)
    assert np.array_equal(one, many)


def test_a_row_does_not_depend_on_its_neighbours():
    """The same token gives the same bits whichever rows share its tile."""
    t = make("int4_g64", (24, 320), 9)
    rng = np.random.default_rng(10)
    mine = rng.standard_normal(320).astype(np.float32)
    for B, at in [(1, 0), (4, 2), (7, 6)]:
        x = rng.standard_normal((B, 320)).astype(np.float32)
        x[at] = mine
        assert np.array_equal(matvec_rows(t, x)[at], matvec(t, mine))


def test_out_argument_and_bad_inputs():
    t = make("q4_0", (16, 64), 11)
    x = np.ones((3, 64), np.float32)
    out = np.empty((3, 16), np.float32)
    assert matvec_rows(t, x, out=out) is out
    with pytest.raises(ValueError, match=r"shape \[L, 64\]"):
        matvec_rows(t, np.ones(64, np.float32))
    with pytest.raises(ValueError, match="float32"):
        matvec_rows(t, np.ones((2, 64)))
    with pytest.raises(ValueError, match="out must be"):
        matvec_rows(t, x, out=np.empty((2, 16), np.float32))
    assert matvec_rows(t, np.ones((0, 64), np.float32)).shape == (0, 16)


_FORMS_SCRIPT = """
import sys
from pathlib import Path

import numpy as np
from colibri.kernels.cpu import codegen, matvec, matvec_rows
from colibri.formats.qtensor import interleaved, quantize
rng = np.random.default_rng(11)
out = []
for scheme in ("int4_g64", "q4_0", "q4_1", "q8_0"):
    for rows, n in ((37, 576), (16, 1536), (19, 2048), (9, 192)):
        t = quantize(rng.standard_normal((rows, n)).astype(np.float32), scheme)
        x = rng.standard_normal((6, n)).astype(np.float32)
        out += [matvec(t, x[0]), matvec_rows(t, x).ravel()]
        if scheme != "q8_0" and rows % 8 == 0:
            out.append(matvec(interleaved(t), x[1]))
        from colibri.kernels import idot  # int8 activations: 8 rows, or 4 (or 2) by halves
        out += [idot.matvec_q(t, x[2]), idot.matmul_q(t, x).ravel()]
        if rows % 8 == 0:
            out.append(idot.matvec_q(interleaved(t), x[3]))
sys.path.insert(0, sys.argv[2])
from test_blocks import random_blocks
from colibri.formats.ggml_blocks import BLOCK_TYPES
from colibri.formats.qtensor import QTensor
from colibri.kernels import block_idot
from colibri.kernels.cpu.block_tiles import FUSED, ROWS_SIDE_BY_SIDE
for scheme in FUSED:  # the block tiles, exact and (where a type has one) int8
    e = BLOCK_TYPES[scheme].elements
    for rows, n in ((13, 2 * e if e == 256 else 3 * e), (16, 2048 if e == 256 else 1024)):
        t = QTensor(scheme, (rows, n), random_blocks(scheme, rows, n, rows + n))
        x = rng.standard_normal((6, n)).astype(np.float32)  # int8: one tile of four x rows, two alone
        out += [matvec(t, x[0]), matvec_rows(t, x).ravel()]
        if scheme in block_idot.INT8_SCHEMES:
            out += [block_idot.matvec_q(t, x[1]), block_idot.matmul_q(t, x).ravel()]
np.save(sys.argv[1], np.concatenate(out))
print(codegen.PARTS, ROWS_SIDE_BY_SIDE)
"""


def test_narrow_and_wide_tiles_give_the_same_bits(tmp_path):
    """The decode tiles' two forms (cpu/codegen.py: 16-lane vectors, or 8-lane halves for
    16-register targets such as AVX2; cpu/block_tiles.py and block_idot.py: eight rows side by
    side, or one at a time), each compiled in its own process and numba cache (COLIBRI_TILES;
    compiled_forms.py), on int4, q4_1 and q8_0 rows with and without tails (also times int8
    activations: kernels/idot.py) and on every block type's tile, exact and int8, one token and
    several: the same bits, so a model gives the same tokens on every CPU class."""
    results = run_in_forms(tmp_path, _FORMS_SCRIPT, (str(Path(__file__).parent),), "COLIBRI_TILES",
                           ("wide", "narrow"), own="narrow" if narrow_tiles() else "wide")
    assert results["wide"][0] == "1 8" and results["narrow"][0] == "2 1"  # (codegen.PARTS, block rows side by side)
    assert results["wide"][1].size > 2000
    np.testing.assert_array_equal(results["wide"][1], results["narrow"][1])


@pytest.mark.parametrize("name, features, narrow", [
    ("haswell", "", True), ("znver3", "", True), ("alderlake", "", True), ("skylake-avx512", "", False),
    ("znver4", "", False), ("znver4", "-avx512f", True), ("x86-64", "", True)])
def test_the_tile_form_follows_the_target(monkeypatch, name, features, narrow):
    """Read from the named target's registers, never the host's; COLIBRI_TILES forces a form."""
    from numba.core import config

    monkeypatch.delenv("COLIBRI_TILES", raising=False)
    monkeypatch.setattr(config, "CPU_NAME", name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    assert narrow_tiles() is narrow
    monkeypatch.setenv("COLIBRI_TILES", "wide" if narrow else "narrow")
    assert narrow_tiles() is not narrow
