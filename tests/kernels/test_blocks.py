"""The GGUF block schemes' CPU kernels (colibri/kernels/cpu/blocks.py) on random valid blocks:
the exact dequantizer (embedding, prefill's tiles) equals gguf-py's dequantize bit for bit;
matvec, matvec_rows and matmul are within float32 rounding of the float64 reference; every
row of matvec_rows (and of the fused MoE kernel) is matvec's bits, with any thread count."""
import inspect

import gguf
import numpy as np
import pytest
from numba import get_num_threads, set_num_threads
from numba import types as numba_types

from colibri.formats.ggml_blocks import BLOCK_SCHEMES, BLOCK_TYPES
from colibri.formats.qtensor import QTensor
from colibri.kernels.cpu import embedding, matvec, matvec_rows
from colibri.kernels.gemm import BLAS_MIN_ROWS, matmul

# The f16 fields of each block (byte offsets): d, and dmin / m where the type has one.
F16_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
              "iq4_nl": (0,), "iq4_xs": (0,), "q5_0": (0,), "q5_1": (0, 2), "mxfp4": ()}


def random_blocks(scheme, out, n, seed):
    """uint8 [out, row bytes]: random payload bytes, sane f16 scales (both signs, 1e-3..0.1),
    MXFP4's E8M0 exponent in [118, 132]."""
    bt = BLOCK_TYPES[scheme]
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (out, n // bt.elements, bt.nbytes), dtype=np.uint8)
    for off in F16_FIELDS[scheme]:
        v = rng.uniform(1e-3, 0.1, q.shape[:2]) * rng.choice([-1.0, 1.0], q.shape[:2])
        q[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(*q.shape[:2], 2)
    if scheme == "mxfp4":
        q[:, :, 0] = rng.integers(118, 133, q.shape[:2])
    return q.reshape(out, -1)


def make(scheme, shape, seed=0):
    return QTensor(scheme, shape, random_blocks(scheme, *shape, seed))


def reference(t):
    """gguf-py's dequantize: float32 [out, in]."""
    return gguf.quants.dequantize(t.q, gguf.GGMLQuantizationType[BLOCK_TYPES[t.scheme].gguf_name])


def shapes(scheme):
    """In: one block, several, a wide row; out: not a multiple of 8, fewer than 8, whole blocks."""
    e = BLOCK_TYPES[scheme].elements
    return [(13, 2 * e if e == 256 else 3 * e), (3, e), (24, 1024)]


def assert_close(y, w, x):
    w = w.astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * scale.max() + 1e-30)


@pytest.fixture
def one_and_two_threads():
    saved = get_num_threads()

    def run(fn):
        set_num_threads(1)
        a = fn()
        set_num_threads(min(2, saved))
        return a, fn()
    yield run
    set_num_threads(saved)


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_embedding_equals_gguf_py_bit_for_bit(scheme):
    for shape in shapes(scheme):
        t = make(scheme, shape, 1)
        ref = reference(t)
        ids = np.array([shape[0] - 1, 0, *range(shape[0])])
        assert np.array_equal(embedding(t, ids).view(np.uint32), ref[ids].view(np.uint32))
        assert np.array_equal(embedding(t, ids[:1]).view(np.uint32), ref[ids[:1]].view(np.uint32))


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_matvec_and_rows(scheme, one_and_two_threads):
    rng = np.random.default_rng(2)
    for shape in shapes(scheme):
        t = make(scheme, shape, 3)
        w = reference(t)
        x = rng.standard_normal((6, shape[1])).astype(np.float32)
        x[0] *= 1e3  # tokens of very different magnitude in one tile
        y1, y2 = one_and_two_threads(lambda: matvec(t, x[1]))
        assert np.array_equal(y1, y2)
        assert_close(y2, w, x[1])
        for B in (1, 2, 5, 6):
            r1, r2 = one_and_two_threads(lambda: matvec_rows(t, x[:B]))
            assert np.array_equal(r1, r2)
            for a in range(B):
                assert np.array_equal(r2[a], matvec(t, x[a])), f"{shape} row {a} of {B}"
        assert_close(r2, w, x)


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_matmul_small_and_blas(scheme, one_and_two_threads):
    rng = np.random.default_rng(4)
    t = make(scheme, shapes(scheme)[0], 5)
    w = reference(t)
    for L in (3, BLAS_MIN_ROWS):
        x = rng.standard_normal((L, t.shape[1])).astype(np.float32)
        y1, y2 = one_and_two_threads(lambda: matmul(t, x))
        assert np.array_equal(y1, y2)
        assert_close(y2, w, x)


def test_paths_without_block_kernels_say_so():
    from colibri.kernels import cuda, idot

    t = make("q4_k", (8, 256))
    with pytest.raises(ValueError, match="int8 activations take int4 or q8_0 weights"):
        idot.matvec_q(t, np.ones(256, np.float32))
    with pytest.raises(ValueError, match="no CUDA kernel for GGUF Q4_K"):
        cuda.upload(t)


# --- the fused MoE kernel over block experts (kernels/moe.py, routed_block_experts) -------

MOE_CASES = [  # (gate, up, down types), D, I, E, K
    (("q4_k", "q4_k", "q6_k"), 512, 256, 6, 3),   # GGUF's usual mix
    (("q2_k", "q3_k", "q5_1"), 256, 96, 4, 4),
    (("q5_0", "mxfp4", "iq4_nl"), 96, 64, 5, 2),
    (("iq4_xs", "q5_k", "q5_k"), 256, 256, 3, 1),
]


def _block_layer(types, D, I, E, seed):
    from colibri.io.container import pack_expert

    experts = [{p: make(s, shape, seed + 3 * e + i) for i, (p, s, shape) in
                enumerate(zip(("gate_proj", "up_proj", "down_proj"), types, ((I, D), (I, D), (D, I))))}
               for e in range(E)]
    blobs = [pack_expert(e) for e in experts]
    return experts, np.stack([b for b, _ in blobs]), blobs[0][1]


def _swiglu64(e, x):
    g, u, d = (reference(e[p]).astype(np.float64) for p in ("gate_proj", "up_proj", "down_proj"))
    gx = g @ x
    return d @ (gx / (1 + np.exp(-gx)) * (u @ x))


@pytest.mark.parametrize("types, D, I, E, K", MOE_CASES, ids=lambda c: "-".join(c) if isinstance(c, tuple) else None)
def test_fused_block_experts(types, D, I, E, K):
    from colibri.formats.expert_blob import FusedExperts, StackedExperts
    from colibri.kernels.moe import one_expert, routed_block_experts, stacked_experts

    experts, memory, layout = _block_layer(types, D, I, E, 7)
    stacked = StackedExperts.view(memory, memory.shape[1], E, layout)
    assert stacked is not None and stacked.kernel.blocks is not None
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(D) * 0.1).astype(np.float32)
    for _ in range(2):
        ids = np.sort(rng.choice(E, size=K, replace=False)).astype(np.int64)
        w = rng.random(K).astype(np.float32)
        got = stacked_experts(stacked, x, ids, w, 2)
        for nthreads in (1, 2):
            one = np.zeros(D, np.float32)
            for e, wk in zip(ids, w):  # one call per expert on its own blob, summed in id order
                one += one_expert(stacked.kernel, x, memory[e].copy(), wk, nthreads)
            np.testing.assert_array_equal(got, one)
        assert np.array_equal(got, stacked_experts(stacked, x, ids, w, 1))
        ref = sum(float(wk) * _swiglu64(experts[e], x) for e, wk in zip(ids, w))
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    act = list(inspect.signature(routed_block_experts.py_func).parameters).index("act")
    exact = [s for s in routed_block_experts.nopython_signatures if s.args[act] == numba_types.float32]
    assert len(exact) == 1  # one compiled kernel for every call (of this mode: int8 is another)
    assert FusedExperts.of({**layout, "down_proj": {**layout["down_proj"], "scheme": "int4_g64"}}) is None
