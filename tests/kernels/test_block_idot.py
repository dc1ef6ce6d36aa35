"""GGUF block rows (every type but Q5_1) x int8 activations (colibri/kernels/block_idot.py,
`--activations int8`): the result is the float64 dot of gguf-py's dequantized weights with the int8-rounded x
within float32 rounding; a row's bits never depend on the caller (matvec, the several-rows
kernel, the fused MoE kernel), the thread count or the integer form (VNNI, AVX2 pairs, portable
IR); block types without an int8 tile run exactly in int8 mode."""
from __future__ import annotations

import inspect

import os

import numpy as np
import pytest
from numba import get_num_threads, set_num_threads, types

from colibri.kernels import block_idot, idot
from colibri.kernels.cpu import matvec as exact_matvec
from colibri.kernels.cpu import matvec_rows as exact_rows

from test_blocks import _block_layer, make, reference, shapes
from test_idot import assert_same_bits_in_every_form

SCHEMES = block_idot.INT8_SCHEMES
# test_blocks' shapes: rows not a multiple of 8, fewer than 8, whole blocks of rows; MXFP4's rows
# also ending inside the tile's four blocks
CASES = [(scheme, out, n) for scheme in SCHEMES for out, n in shapes(scheme)]


def rounded(x: np.ndarray) -> np.ndarray:
    """x as the kernel sees it, float64: each 32 rounded to int8 with scale max|x| / 127."""
    xg = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xg).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.round(xg * inv).astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(-1)


@pytest.fixture
def threads():
    saved = get_num_threads()
    yield lambda n: set_num_threads(min(n, saved))
    set_num_threads(saved)


@pytest.mark.parametrize("scheme, out, n", CASES)
def test_matvec_is_the_dot_with_rounded_activations(scheme, out, n):
    t = make(scheme, (out, n), seed=out)
    w = reference(t).astype(np.float64)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3
    x[:32] *= 1e-3  # blocks of very different scales in one row
    got = block_idot.matvec_q(t, x)
    xr = rounded(x)
    ref = w @ xr
    scale = np.abs(w) @ np.abs(xr)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * scale.max())
    # and what rounding x costs against the exact path: small, not zero
    exact = exact_matvec(t, x)
    rel = np.abs(got - exact).max() / np.abs(exact).max()
    assert 1e-6 < rel < 0.03


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_do_not_depend_on_caller_or_threads(scheme, threads):
    width = 768 if scheme != "mxfp4" else 736  # MXFP4: the last of the tile's four blocks missing
    t = make(scheme, (37, width), seed=5)
    X = np.random.default_rng(6).standard_normal((5, width)).astype(np.float32)
    X[0] *= 1e3
    results = []
    for n in (1, 2):
        threads(n)
        Y = block_idot.matmul_q(t, X)
        for r in range(5):
            np.testing.assert_array_equal(Y[r], block_idot.matvec_q(t, X[r]))
        results.append(Y)
    np.testing.assert_array_equal(results[0], results[1])


def test_zero_and_non_finite_activations():
    t = make("q4_k", (16, 512), seed=2)
    assert not block_idot.matvec_q(t, np.zeros(512, np.float32)).any()
    x = np.ones(512, np.float32)
    x[300] = np.inf
    assert np.isnan(block_idot.matvec_q(t, x)).all()  # the engine's non-finite guard must still see it


def test_other_block_types_run_exactly_in_int8_mode():
    from colibri.models.layers import linear

    rng = np.random.default_rng(3)
    for scheme in ("q5_1",):
        t = make(scheme, (11, 512), seed=4)
        X = rng.standard_normal((3, 512)).astype(np.float32)
        np.testing.assert_array_equal(block_idot.matvec_q(t, X[0]), exact_matvec(t, X[0]))
        np.testing.assert_array_equal(block_idot.matmul_q(t, X), exact_rows(t, X))
        with idot.activations("int8"):
            np.testing.assert_array_equal(linear(X[:1], t)[0], exact_matvec(t, X[0]))
    t = make("q4_k", (11, 512), seed=4)
    with idot.activations("int8"):  # linear() routes Q4_K (Q6_K, Q5_K) to the int8 tiles
        np.testing.assert_array_equal(linear(X[:1], t)[0], block_idot.matvec_q(t, X[0]))
        np.testing.assert_array_equal(linear(X, t), block_idot.matmul_q(t, X))
    assert not np.array_equal(linear(X[:1], t)[0], block_idot.matvec_q(t, X[0]))  # f32 mode: exact


MOE_CASES = [  # (gate, up, down types), D, I, E, K
    (("q4_k", "q4_k", "q6_k"), 512, 256, 6, 3),  # GGUF's usual mix: every projection int8
    (("q6_k", "q5_1", "q5_k"), 256, 256, 4, 2),  # an exact projection among int8 ones
    (("q2_k", "q3_k", "q2_k"), 512, 256, 4, 2),  # the 2- and 3-bit K-quants of the dynamic mixes
    (("mxfp4", "mxfp4", "mxfp4"), 288, 160, 5, 3),  # gpt-oss's experts, rows ending inside four blocks
    (("iq4_xs", "iq4_nl", "q5_0"), 512, 256, 4, 2),  # the IQ4 types (signed codes on AVX2) and Q5_0
]


@pytest.mark.parametrize("types_, D, I, E, K", MOE_CASES, ids=lambda c: "-".join(c) if isinstance(c, tuple) else None)
def test_fused_block_experts_int8(types_, D, I, E, K):
    """Placement never changes tokens in int8 mode: the K experts of a token in one call equal
    one call per expert summed in expert-id order, with 1 or 2 threads, bit for bit; and the
    result is the experts' float64 SwiGLU on the int8-rounded inputs (x, each activation)."""
    from colibri.formats.expert_blob import StackedExperts
    from colibri.kernels.moe import one_expert, routed_block_experts, stacked_experts

    experts, memory, layout = _block_layer(types_, D, I, E, 11)
    stacked = StackedExperts.view(memory, memory.shape[1], E, layout)
    rng = np.random.default_rng(12)
    x = (rng.standard_normal(D) * 0.1).astype(np.float32)
    ids = np.sort(rng.choice(E, size=K, replace=False)).astype(np.int64)
    w = rng.random(K).astype(np.float32)
    got = stacked_experts(stacked, x, ids, w, 2, "int8")
    for nthreads in (1, 2):
        one = np.zeros(D, np.float32)
        for e, wk in zip(ids, w):
            one += one_expert(stacked.kernel, x, memory[e].copy(), wk, nthreads, "int8")
        np.testing.assert_array_equal(got, one)

    def rows(t, v):  # a projection as the kernel computes it: int8-rounded v for the int8 types
        return reference(t).astype(np.float64) @ (rounded(v) if t.scheme in SCHEMES else v.astype(np.float64))

    ref = np.zeros(D)
    for e, wk in zip(ids, w):
        gx, ux = rows(experts[e]["gate_proj"], x), rows(experts[e]["up_proj"], x)
        a = (gx / (1 + np.exp(-gx)) * ux).astype(np.float32)  # the kernel's activation, float32
        ref += float(wk) * rows(experts[e]["down_proj"], a)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    exact = stacked_experts(stacked, x, ids, w, 2, "f32")
    assert 0 < np.abs(got - exact).max() < 0.05 * np.abs(exact).max()
    act = list(inspect.signature(routed_block_experts.py_func).parameters).index("act")
    modes = {s.args[act] for s in routed_block_experts.nopython_signatures}
    assert modes <= {types.float32, types.int8}


def test_fused_block_experts_without_int8_tiles_are_exact():
    from colibri.formats.expert_blob import StackedExperts
    from colibri.kernels.moe import stacked_experts

    _, memory, layout = _block_layer(("q5_1", "q5_1", "q5_1"), 256, 256, 3, 13)
    stacked = StackedExperts.view(memory, memory.shape[1], 3, layout)
    x = np.random.default_rng(14).standard_normal(256).astype(np.float32)
    ids, w = np.array([0, 2]), np.array([0.25, 0.75], np.float32)
    np.testing.assert_array_equal(stacked_experts(stacked, x, ids, w, 2, "int8"),
                                  stacked_experts(stacked, x, ids, w, 2, "f32"))


_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from colibri.kernels import block_idot, idot
from test_blocks import make
rng = np.random.default_rng(5)
out = []
for scheme in block_idot.INT8_SCHEMES:
    t = make(scheme, (21, 768), 6)
    out.append(block_idot.matvec_q(t, rng.standard_normal(768).astype(np.float32)))
np.save(sys.argv[1], np.concatenate(out))
print(idot.ISA)
"""


@pytest.mark.skipif(idot.ISA == "generic", reason="this CPU has neither AVX2 nor AVX-512 VNNI: only the portable IR runs here")
def test_every_integer_form_gives_the_same_bits(tmp_path):
    """The target's integer dot instructions against the narrower forms, each compiled in its
    own process and cache (COLIBRI_IDOT)."""
    assert_same_bits_in_every_form(tmp_path, _SCRIPT, os.path.dirname(__file__))
