"""The CUDA kernels (colibri/kernels/cuda) against their numpy references and the CPU kernels.

Without a GPU they run under numba's CUDA simulator, which must be switched on before numba is
imported: the rest of the suite has imported numba already, so test_under_the_simulator runs
this file again in a fresh process with NUMBA_ENABLE_CUDASIM=1, where the checks below run
(they skip in a process that has neither a GPU nor the simulator). Shapes are small and odd
(rows past the last whole block, token rows past the last whole tile): the simulator runs each
GPU thread as a Python thread.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda_simulator import rerun_under_simulator

from colibri import ColibriError
from colibri.generate import SamplingParams, candidates
from colibri.kernels import cuda as C
from colibri.kernels import idot, matmul, matvec, ops
from colibri.kernels.attention import reference_attention
from colibri.formats.qtensor import dequantize, quantize

ROOT = Path(__file__).resolve().parents[2]
on_device = pytest.mark.skipif(not C.available(), reason="no CUDA GPU and not under the simulator")


def test_under_the_simulator():
    if C.simulated():
        pytest.skip("this process is the simulator run")
    rerun_under_simulator(__file__, ROOT, timeout=600)


def test_the_simulators_device_memory_is_the_hosts_available_memory():
    """Sized by free pages, the simulator's "device" had almost nothing left once the page cache
    filled (after writing a large model): no layer fit and the device tests failed. MemAvailable
    counts the cache the kernel would drop."""
    probe = ("from colibri.kernels import cuda; from colibri.memory import available_memory; import os; "
             "print(cuda.free_bytes(), available_memory(), os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    device, available, free_pages = map(int, r.stdout.split())
    print(f"\nsimulated device memory {device / 2**30:.2f} GiB; available {available / 2**30:.2f} GiB; "
          f"free pages {free_pages / 2**30:.2f} GiB")
    assert abs(device - available) <= 0.01 * available


def test_cuda_device_without_a_gpu_is_a_clear_error():
    if C.available():
        pytest.skip("a CUDA device (or the simulator) is present")
    with pytest.raises(ColibriError, match="no CUDA GPU found.*--device cpu|needs NVIDIA's numba-cuda"):
        C.require()


def test_every_kernel_compiles_for_the_gpu_target(monkeypatch):
    """Typing and lowering to LLVM IR for compute capability 9.0 with numba-cuda (no GPU and no
    NVVM needed): what the simulator, which runs the kernels as Python, cannot check. Skipped
    where numba-cuda is not installed (it is the gpu extra, not a test dependency)."""
    if C.cuda is None or C.simulated() or getattr(C.cuda, "implementation", "") != "NVIDIA":
        pytest.skip("numba-cuda is not installed (pip install numba-cuda)")
    from types import SimpleNamespace

    from numba import types as T
    from numba.cuda import dispatcher
    from numba.cuda.compiler import compile_cuda
    from numba.cuda.random import xoroshiro128p_dtype
    from numba.np.numpy_support import from_dtype

    if not C.available():  # device functions ask the current device for its compute capability
        monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    k, sampling = C.k, C.sampling
    f1, f2, f3, i64 = T.float32[::1], T.float32[:, ::1], T.float32[:, :, ::1], T.int64
    i8, u32, u16 = T.int8[:, ::1], T.uint32[:, ::1], T.uint16[:, ::1]
    signatures = [
        (k.int4_rows, (u32, f2, f2, T.float32, i64, f2, f2)), (k.f32_rows, (f2, f2, i64, f2, f2)),
        (k.u16_rows, (u16, f1, i64, f2, f2)), (k.q8_rows, (i8, f2, i64, f2, f2)),
        (k.quantize_groups, (f2, i64, i8, f2)), (k.int4_idot_rows, (u32, f2, f2, T.boolean, i64, i8, f2, f2)),
        (k.rms_norm, (f2, f1, T.float32, f2)), (k.rope, (f2, i64, i64, i64, f2, f2, i64)),
        (k.silu_mul, (f2, i64, f2)), (k.add_into, (f2, f2)), (k.add_bias, (f2, f1)),
        (k.head_rms_norm, (f2, i64, i64, f1, T.float32)), (k.fill, (f2, T.float32)),
        (k.gather_rows, (f2, T.int64[::1], f2)), (k.scatter_add_scaled, (f2, f2, T.int64[::1], f1)),
        (k.sigmoid_scale_rows, (f2, f2)),
        (k.rope_copy, (f2, i64, i64, i64, f2, f2, i64, T.boolean, T.float32, f3)),
        (k.head_matmul, (f2, i64, i64, f3, T.float32, f3)),
        (k.kv_store, (f3, f2, i64, i64)), (k.copy_positions, (f3, f3, i64)),
        (k.attend, (f2, i64, f3, f3, i64, T.float32, f3, f2)), (k.mla_attend, (f3, f3, f2, f2, i64, f3, f3)),
        (sampling.argmax, (f1, T.int64[::1])),
        (sampling.sample, (f1, T.int32[::1], T.float32, i64, T.float64, T.float64, T.int64[::1])),
        (sampling.uniform, (from_dtype(xoroshiro128p_dtype)[::1], T.float64[::1])),
    ]
    for kernel, sig in signatures:
        compile_cuda(kernel.py_func, T.void, sig, cc=(9, 0))


# --- matrix products ----------------------------------------------------------------------

SHAPES = {  # scheme -> (out, in): in a whole number of groups, out not a multiple of ROWS
    "int4_g64": (13, 192), "q4_0": (7, 96), "q4_1": (9, 160),
    "q8_0": (5, 96), "f32": (7, 40), "f16": (6, 72), "bf16": (5, 56),
}


@on_device
@pytest.mark.parametrize("scheme", sorted(SHAPES))
@pytest.mark.parametrize("L", [1, 5])
def test_linear_matches_reference_and_cpu(scheme, L):
    rng = np.random.default_rng(len(scheme) * 7 + L)
    out, n = SHAPES[scheme]
    t = quantize(rng.standard_normal((out, n)).astype(np.float32), scheme)
    x = rng.standard_normal((L, n)).astype(np.float32)
    got = C.matmul(t, x)
    ref = (x.astype(np.float64) @ dequantize(t).astype(np.float64).T)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    cpu = matvec(t, x[0])[None, :] if L == 1 else matmul(t, x)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _int8_reference(t, x):
    """x rounded to int8 per weight group (idot.quantize_into's rule) times the dequantized
    weights, in float64."""
    g = {"int4_g64": 64, "q4_0": 32, "q4_1": 32, "q8_0": 32}[t.scheme]
    xg = x.reshape(x.shape[0], -1, g)
    amax = np.abs(xg).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.round(xg * inv)
    xhat = (xq * (amax / np.float32(127.0))).reshape(x.shape)
    return xhat.astype(np.float64) @ dequantize(t).astype(np.float64).T


@on_device
@pytest.mark.parametrize("scheme", ["int4_g64", "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("L", [1, 6])
def test_int8_activations_match_reference_and_cpu(scheme, L):
    rng = np.random.default_rng(L + len(scheme))
    out, n = SHAPES[scheme]
    t = quantize(rng.standard_normal((out, n)).astype(np.float32), scheme)
    x = rng.standard_normal((L, n)).astype(np.float32)
    x[0, :5] *= 40.0  # one group with a wide range: its small entries round to 0
    got = C.matmul(t, x, activations="int8")
    ref = _int8_reference(t, x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    cpu = idot.matvec_q(t, x[0])[None, :] if L == 1 else idot.matmul_q(t, x)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = C.matmul(t, x)
    assert np.abs(got - exact).max() > 0  # the rounding of x is really there


@on_device
def test_int8_activations_non_finite_input_gives_nan():
    t = quantize(np.ones((3, 64), np.float32), "int4_g64")
    x = np.ones((1, 64), np.float32)
    x[0, 3] = np.inf
    assert np.isnan(C.matmul(t, x, activations="int8")).all()


@on_device
def test_linear_adds_bias_in_place_of_the_output():
    rng = np.random.default_rng(3)
    t = quantize(rng.standard_normal((6, 64)).astype(np.float32), "int4_g64")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    y = C.to_host(C.linear(C.upload(t), C.to_device(x), bias=C.upload_vector(b)))
    np.testing.assert_allclose(y, matmul(t, x) + b, rtol=1e-5, atol=1e-5)


# --- glue ---------------------------------------------------------------------------------


@on_device
def test_rms_norm_matches_cpu():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 40)).astype(np.float32) * 3
    w = rng.standard_normal(40).astype(np.float32)
    got = C.to_host(C.rms_norm(C.to_device(x), C.to_device(w), 1e-5))
    np.testing.assert_allclose(got, ops.rms_norm(x, w, np.float32(1e-5)), rtol=2e-7, atol=0)


@on_device
@pytest.mark.parametrize("heads, dh", [(3, 16), (1, 40)])
def test_head_norm_matches_cpu_per_head(heads, dh):
    """q/k norms in place: each head of dh columns from column 8 (Qwen3's per-head norm, and
    OLMoE's over all heads as one head), the other columns untouched."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 8 + heads * dh + 5)).astype(np.float32) * 3
    w = rng.standard_normal(dh).astype(np.float32)
    d = C.to_device(x)
    C.head_norm(d, 8, heads, dh, C.to_device(w), 1e-6)
    got = C.to_host(d)
    part = x[:, 8:8 + heads * dh].reshape(2 * heads, dh)
    want = ops.rms_norm(np.ascontiguousarray(part), w, np.float32(1e-6)).reshape(2, heads * dh)
    np.testing.assert_allclose(got[:, 8:8 + heads * dh], want, rtol=2e-7, atol=0)
    assert np.array_equal(got[:, :8], x[:, :8]) and np.array_equal(got[:, 8 + heads * dh:], x[:, 8 + heads * dh:])


@on_device
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_copy_matches_the_mla_cpu_rotation(interleaved):
    """MLA's q_rope: the rope dims of each head (after its 6 nope dims) rotated out of place and
    scaled, as models/mla.py rotates them (rope_interleaved or apply_rope)."""
    from colibri.models.rope import apply_rope
    from colibri.models.mla import rope_interleaved

    rng = np.random.default_rng(16)
    L, H, dn, R = 3, 2, 6, 8
    q = rng.standard_normal((L, H * (dn + R))).astype(np.float32)
    ang = np.arange(L, dtype=np.float32)[:, None] * (1.0 / 100 ** (np.arange(0, R, 2) / R)).astype(np.float32)
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
    got = C.to_host(C.rope_copy(C.to_device(q), dn, H, dn + R, C.to_device(cos), C.to_device(sin), R, interleaved,
                                0.5))
    x = q.reshape(L, H, dn + R)[..., dn:]
    want = (rope_interleaved(x, cos, sin) if interleaved else apply_rope(x, cos, sin, R)) * np.float32(0.5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@on_device
def test_head_matmul_is_numpy_per_head():
    rng = np.random.default_rng(17)
    L, H, K, N, da = 2, 3, 5, 4, 7
    a = rng.standard_normal((L, 1 + H * da)).astype(np.float32)
    w = rng.standard_normal((H, K, N)).astype(np.float32)
    got = C.to_host(C.head_matmul(C.to_device(a), 1, da, C.to_device(w), 0.25))
    heads = a[:, 1:].reshape(L, H, da)[..., :K].transpose(1, 0, 2)  # [H, L, K]
    np.testing.assert_allclose(got, (np.matmul(heads, w) * np.float32(0.25)).transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


@on_device
def test_gather_and_weighted_scatter_rows():
    """One expert's rows out of the layer's tokens, and its weighted output added back into
    them: numpy's x[rows] and out[rows] += w[:, None] * y."""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    rows = np.array([4, 0, 3], np.int64)
    got = C.to_host(C.gather_rows(C.to_device(x), C.to_device(rows)))
    assert np.array_equal(got, x[rows])
    y, w = rng.standard_normal((3, 12)).astype(np.float32), rng.random(3).astype(np.float32)
    out = C.zeros((6, 12))
    assert not C.to_host(out).any()
    C.add_into(out, C.to_device(x))
    C.scatter_add_scaled(out, C.to_device(y), C.to_device(rows), C.to_device(w))
    want = x.copy()
    want[rows] += y * w[:, None]
    assert np.array_equal(C.to_host(out), want)
    g = rng.standard_normal((6, 1)).astype(np.float32)  # a shared expert's gate
    d = C.to_device(x)
    C.sigmoid_scale_rows(d, C.to_device(g))
    np.testing.assert_allclose(C.to_host(d), (np.float32(1) / (np.float32(1) + np.exp(-g))) * x, rtol=1e-6, atol=0)


@on_device
def test_rope_matches_cpu():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)  # [L, H, Dh], behind 8 other columns
    pos = np.array([0.0, 7.0], np.float32)[:, None] * (1.0 / 10000 ** (np.arange(0, 12, 2) / 12)).astype(np.float32)
    emb = np.concatenate([pos, pos], axis=1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    wide = np.concatenate([np.ones((2, 8), np.float32), x.reshape(2, 48)], axis=1)
    d = C.to_device(wide)
    C.rope(d, 8, 3, 16, C.to_device(cos), C.to_device(sin), 12)
    ref = x.copy()
    ops.rope(ref, cos, sin, 12)
    got = C.to_host(d)
    np.testing.assert_allclose(got[:, 8:].reshape(2, 3, 16), ref, rtol=1e-6, atol=1e-6)
    assert (got[:, :8] == 1).all()


@on_device
def test_silu_mul_and_adds_match_numpy():
    rng = np.random.default_rng(6)
    gu = (rng.standard_normal((2, 2 * 9)) * 4).astype(np.float32)
    got = C.to_host(C.silu_mul(C.to_device(gu), 9))
    g, u = gu[:, :9].astype(np.float64), gu[:, 9:]
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, ops.silu_mul(gu, 9), rtol=1e-6, atol=1e-6)
    x, y = gu[:, :9].copy(), gu[:, 9:].copy()
    dx = C.to_device(x)
    C.add_into(dx, C.to_device(y))
    assert np.array_equal(C.to_host(dx), x + y)


@on_device
def test_kv_store_writes_heads_at_their_positions():
    cache = C.to_device(np.zeros((2, 8, 4), np.float32))
    src = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)  # [L, q(4) | k(2 heads x 4)]
    C.kv_store(cache, C.to_device(src), 4, 3)
    got = C.to_host(cache)
    np.testing.assert_array_equal(got[:, 3:5], src[:, 4:].reshape(2, 2, 4).transpose(1, 0, 2))
    assert not got[:, :3].any() and not got[:, 5:].any()
    grown = C.to_device(np.zeros((2, 12, 4), np.float32))
    C.copy_positions(grown, cache, 5)
    np.testing.assert_array_equal(C.to_host(grown)[:, :5], got[:, :5])


# --- attention ----------------------------------------------------------------------------


@on_device
@pytest.mark.parametrize("L, pos0, Dh", [(1, 36, 8), (3, 5, 8), (1, 29, 3), (2, 9, 20)])
def test_attention_matches_reference(L, pos0, Dh):
    """GQA (4 query heads on 2 KV heads), more cached positions than a block has threads; head
    dims below, at and above the block's thread count (the value sum splits positions among
    thread groups when a head is narrower than the block)."""
    rng = np.random.default_rng(L + pos0)
    H, KV, cap = 4, 2, 48
    q = rng.standard_normal((L, H, Dh)).astype(np.float32)
    kc = rng.standard_normal((KV, cap, Dh)).astype(np.float32)
    vc = rng.standard_normal((KV, cap, Dh)).astype(np.float32)
    scale = np.float32(Dh ** -0.5)
    got = C.to_host(C.attend(C.to_device(q.reshape(L, H * Dh)), H, C.to_device(kc), C.to_device(vc), pos0, scale))
    n = pos0 + L
    G = H // KV
    visible = np.arange(n)[None, :] <= pos0 + np.arange(L)[:, None]
    ref = reference_attention(q.transpose(1, 0, 2), np.repeat(kc[:, :n], G, axis=0),
                              np.repeat(vc[:, :n], G, axis=0), visible, scale)  # [H, L, Dh]
    np.testing.assert_allclose(got, ref.transpose(1, 0, 2).reshape(L, H * Dh), rtol=1e-5, atol=1e-6)
    if L == 1:
        np.testing.assert_allclose(got[0], ops.attend_one(q[0], kc, vc, n, scale), rtol=1e-5, atol=1e-6)


@on_device
@pytest.mark.parametrize("L, pos0", [(1, 20), (2, 3)])
def test_mla_absorbed_attention_matches_numpy(L, pos0):
    """Latent rank 24, rope dim 8, 3 heads sharing one latent cache."""
    rng = np.random.default_rng(11 + L)
    H, r, R, cap = 3, 24, 8, 32
    q_lat = rng.standard_normal((L, H, r)).astype(np.float32) * 0.3
    q_rope = rng.standard_normal((L, H, R)).astype(np.float32) * 0.3
    c = rng.standard_normal((cap, r)).astype(np.float32)
    k_rope = rng.standard_normal((cap, R)).astype(np.float32)
    got = C.to_host(C.mla_attend(*(C.to_device(a) for a in (q_lat, q_rope, c, k_rope)), pos0))
    n = pos0 + L
    s = (np.einsum("lhr,nr->hln", q_lat, c[:n]) + np.einsum("lhr,nr->hln", q_rope, k_rope[:n])).astype(np.float64)
    s[:, np.arange(n)[None, :] > pos0 + np.arange(L)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("hln,nr->lhr", p / p.sum(axis=-1, keepdims=True), c[:n])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# --- sampling -----------------------------------------------------------------------------


@on_device
def test_argmax_equals_numpy():
    rng = np.random.default_rng(8)
    cases = [rng.standard_normal(53).astype(np.float32),
             np.array([1, 5, 2, 5, 5, -1] * 7, np.float32),         # ties: the first one
             np.full(40, -np.inf, np.float32),
             np.array([0, 3, np.nan, 9, np.nan], np.float32)]       # NaN wins, as in numpy
    for z in cases:
        assert C.argmax(C.to_device(z)) == int(np.argmax(z))


def _host_pick(z, temperature, top_k, top_p, u):
    """generate.sample's pick for the uniform number u."""
    ids, w = candidates(z, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    c = np.cumsum(w)
    return int(ids[min(int(np.searchsorted(c, u * c[-1], side="right")), ids.size - 1)])


@on_device
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                        (0.9, 7, 0.6)])
def test_sampling_picks_what_the_cpu_sampler_picks(temperature, top_k, top_p):
    rng = np.random.default_rng(9)
    z = np.round(rng.standard_normal(45) * 2, 1).astype(np.float32)  # rounded: ties in value
    d = C.to_device(z)
    for u in (0.0, 0.31, 0.77, 0.999):
        assert C.sample(d, temperature, top_k, top_p, u) == _host_pick(z, temperature, top_k, top_p, u), u


@on_device
def test_seeded_sampler_repeats_and_greedy_is_argmax():
    rng = np.random.default_rng(10)
    d = C.to_device(rng.standard_normal(30).astype(np.float32))
    a, b = C.Sampler(seed=5), C.Sampler(seed=5)
    draws = [a(d, 1.0) for _ in range(4)]
    assert draws == [b(d, 1.0) for _ in range(4)]
    u = C.Sampler(seed=6).uniform()
    assert 0.0 <= u < 1.0
    assert a(d, 0.0) == int(np.argmax(C.to_host(d)))
