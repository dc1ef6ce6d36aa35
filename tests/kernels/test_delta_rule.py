"""Gated DeltaNet kernels (colibri/kernels/delta_rule.py) against numpy references written from
transformers' torch_recurrent_gated_delta_rule / causal_conv1d / RMSNormGated formulas: the
recurrent step and the chunked form give the reference's outputs and final state, chunk
boundaries and call boundaries change nothing but rounding, and the thread count changes no bit."""
import numba
import numpy as np
import pytest

from colibri.kernels import delta_rule
from colibri.kernels.cpu.fpenv import fp_setting


def l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def reference(state, q, k, v, g, beta):
    """Token by token, as transformers' torch_recurrent_gated_delta_rule (float64 here)."""
    L, Hk, Dk = q.shape
    Hv = v.shape[1]
    r = Hv // Hk
    S = state.astype(np.float64).copy()
    q = np.repeat(l2(q.astype(np.float64)), r, axis=1) * Dk ** -0.5
    k = np.repeat(l2(k.astype(np.float64)), r, axis=1)
    out = np.zeros(v.shape)
    for t in range(L):
        S *= np.exp(g[t])[:, None, None]
        mem = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - mem) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def inputs(L, Hk=2, Hv=4, Dk=16, Dv=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((L, Hk, Dk)).astype(np.float32)
    v = rng.standard_normal((L, Hv, Dv)).astype(np.float32)
    g = (-np.exp(rng.standard_normal(Hv)) * np.log1p(np.exp(rng.standard_normal((L, Hv))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((L, Hv))))).astype(np.float32)
    state = (0.1 * rng.standard_normal((Hv, Dk, Dv))).astype(np.float32)
    return state, q, k, v, g, beta


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 16, 8), (1, 1, 32, 32), (3, 6, 8, 24)])
def test_step_and_chunked_forms_give_the_reference(Hk, Hv, Dk, Dv):
    L = 150  # more than two chunks of 64, the last one partial
    state, q, k, v, g, beta = inputs(L, Hk, Hv, Dk, Dv)
    want, want_state = reference(state, q, k, v, g, beta)
    s = state.copy()
    steps = np.stack([delta_rule.delta_step(s, q[t], k[t], v[t], g[t], beta[t]) for t in range(L)])
    close(steps, want)
    close(s, want_state)
    s = state.copy()
    close(delta_rule.delta_chunked(s, q, k, v, g, beta), want)
    close(s, want_state)


def test_chunked_form_split_anywhere_continues_the_state():
    state, q, k, v, g, beta = inputs(130, seed=3)
    whole = state.copy()
    out = delta_rule.delta_chunked(whole, q, k, v, g, beta)
    parts = state.copy()
    pieces = [delta_rule.delta_chunked(parts, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b])
              for a, b in ((0, 7), (7, 71), (71, 72), (72, 130))]
    close(np.concatenate(pieces), out)
    close(parts, whole)


def test_thread_count_changes_no_bit():
    state, q, k, v, g, beta = inputs(100, Hk=2, Hv=8, seed=5)
    saved = numba.get_num_threads()
    runs = []
    try:
        for n in (1, saved):
            numba.set_num_threads(n)
            s1, s2 = state.copy(), state.copy()
            runs.append((delta_rule.delta_chunked(s1, q, k, v, g, beta), s1,
                         delta_rule.delta_step(s2, q[0], k[0], v[0], g[0], beta[0]), s2))
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def silu(x):
    return x / (1 + np.exp(-x))


def test_causal_conv_is_transformers_depthwise_conv_and_carries_its_state():
    rng = np.random.default_rng(1)
    L, C, K = 11, 24, 4
    x = rng.standard_normal((L, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    padded = np.concatenate([np.zeros((K - 1, C), np.float32), x])  # F.conv1d(padding=K-1)[:L]
    want = silu(np.stack([np.sum(padded[t:t + K] * w.T, axis=0) for t in range(L)]))
    state = np.zeros((K - 1, C), np.float32)
    close(delta_rule.causal_conv(x, state, w), want, 1e-6)
    assert np.array_equal(state, x[-(K - 1):])
    state = np.zeros((K - 1, C), np.float32)  # token by token (decode) gives the same bits
    steps = np.concatenate([delta_rule.causal_conv(x[t:t + 1], state, w) for t in range(L)])
    assert np.array_equal(steps, delta_rule.causal_conv(x, np.zeros((K - 1, C), np.float32), w))


def test_gated_rms_norm_normalizes_then_gates():
    rng = np.random.default_rng(2)
    x, z = rng.standard_normal((2, 6, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    want = w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * silu(z)
    close(delta_rule.gated_rms_norm(x, z, w, np.float32(1e-6)), want, 1e-6)


# ----------------------------------------------------------------------------- Kimi Delta Attention

def kda_reference(state, q, k, v, g, beta):
    """Token by token, as transformers' recurrent_kimi_delta_attention (float64 here): the decay
    g [L, H, Dk] scales each key channel's row of the state."""
    Dk = q.shape[-1]
    S = state.astype(np.float64).copy()
    q = l2(q.astype(np.float64)) * Dk ** -0.5
    k = l2(k.astype(np.float64))
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        S *= np.exp(g[t].astype(np.float64))[:, :, None]
        mem = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - mem) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def kda_inputs(L, H=2, Dk=16, Dv=16, seed=0, strength=1.0):
    """Kimi Linear's gate: g = -exp(A) softplus(f + dt_bias) per channel; `strength` scales A."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, H, Dk)).astype(np.float32)
    k = rng.standard_normal((L, H, Dk)).astype(np.float32)
    v = rng.standard_normal((L, H, Dv)).astype(np.float32)
    a = strength * np.exp(rng.standard_normal(H))[None, :, None]
    g = (-a * np.log1p(np.exp(rng.standard_normal((L, H, Dk))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((L, H))))).astype(np.float32)
    state = (0.1 * rng.standard_normal((H, Dk, Dv))).astype(np.float32)
    return state, q, k, v, g, beta


@pytest.mark.parametrize("H,Dk,Dv", [(2, 16, 16), (1, 32, 8), (3, 8, 24)])
def test_kda_step_and_chunked_forms_give_the_reference(H, Dk, Dv):
    L = 150  # more than two chunks of 64, the last one partial
    state, q, k, v, g, beta = kda_inputs(L, H, Dk, Dv)
    want, want_state = kda_reference(state, q, k, v, g, beta)
    s = state.copy()
    steps = np.stack([delta_rule.kda_step(s, q[t], k[t], v[t], g[t], beta[t]) for t in range(L)])
    close(steps, want)
    close(s, want_state)
    s = state.copy()
    close(delta_rule.kda_chunked(s, q, k, v, g, beta), want)
    close(s, want_state)


def test_kda_chunked_form_is_sound_under_strong_decay():
    """Decays of e^-30 per token and channel: a factored chunk form (e^c_i * e^-c_m) overflows
    float32 within a few tokens; the kernel's pairwise differences stay finite and exact."""
    state, q, k, v, g, beta = kda_inputs(100, seed=4, strength=30.0)
    assert g.min() < -30 * 64 / 88  # e^-c of a chunk's cumulative decay would pass float32's range
    want, want_state = kda_reference(state, q, k, v, g, beta)
    s = state.copy()
    out = delta_rule.kda_chunked(s, q, k, v, g, beta)
    assert np.isfinite(out).all() and np.isfinite(s).all()
    close(out, want)
    close(s, want_state)


def test_kda_chunked_form_split_anywhere_continues_the_state():
    state, q, k, v, g, beta = kda_inputs(130, seed=3)
    whole = state.copy()
    out = delta_rule.kda_chunked(whole, q, k, v, g, beta)
    parts = state.copy()
    pieces = [delta_rule.kda_chunked(parts, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b])
              for a, b in ((0, 7), (7, 71), (71, 72), (72, 130))]
    close(np.concatenate(pieces), out)
    close(parts, whole)


def test_kda_thread_count_changes_no_bit():
    state, q, k, v, g, beta = kda_inputs(100, H=8, seed=5)
    saved = numba.get_num_threads()
    runs = []
    try:
        for n in (1, saved):
            numba.set_num_threads(n)
            s1, s2 = state.copy(), state.copy()
            runs.append((delta_rule.kda_chunked(s1, q, k, v, g, beta), s1,
                         delta_rule.kda_step(s2, q[0], k[0], v[0], g[0], beta[0]), s2))
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_sigmoid_gated_rms_norm_normalizes_then_gates():
    rng = np.random.default_rng(6)
    x, z = rng.standard_normal((2, 6, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    want = w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) / (1 + np.exp(-z))
    close(delta_rule.sigmoid_gated_rms_norm(x, z, w, np.float32(1e-5)), want, 1e-6)


@numba.njit(parallel=True, cache=True)
def _settings_of_threads(n):
    """Each parallel iteration's floating-point setting (the threads the kernels' prange uses)."""
    out = np.empty(n, np.int32)
    for i in numba.prange(n):
        out[i] = fp_setting()
    return out


def test_kernels_flush_subnormals_and_leave_every_thread_as_it_was():
    """Under strong decays (-3 to -90 a token) the states and the chunk's pair factors fall into
    float32's subnormal range, where every operation costs a microcode assist: the kernels flush
    them to zero (cpu/fpenv.py) inside each parallel iteration and put the setting back, so the
    calling thread and numba's workers run every other kernel as before. The results still
    follow the float64 token loop."""
    from colibri.kernels.cpu import fpenv

    before = _settings_of_threads(64)
    here = numba.njit(lambda: fp_setting())
    caller = here()
    state, q, k, v, g, beta = inputs(130, Hk=2, Hv=4, seed=8)
    cases = [(delta_rule.kda_chunked, delta_rule.kda_step, kda_reference,
              kda_inputs(130, H=4, seed=7, strength=30.0)),
             (delta_rule.delta_chunked, delta_rule.delta_step, reference,  # per head: e^-1 .. e^-90 a token
              (state, q, k, v, 20 * g, beta))]
    for chunked, step, ref, (state, q, k, v, g, beta) in cases:
        want, want_state = ref(state, q, k, v, g, beta)
        s = state.copy()
        close(chunked(s, q, k, v, g, beta), want)
        close(s, want_state)
        s = state.copy()
        close(np.stack([step(s, q[t], k[t], v[t], g[t], beta[t]) for t in range(130)]), want)
        close(s, want_state)
    # a state decayed by e^-90 with nothing written (beta 0) falls below 2^-126: flushed, it is 0
    state, q, k, v, g, beta = kda_inputs(1, H=4, seed=9)
    s = np.full_like(state, 0.1)
    delta_rule.kda_step(s, q[0], k[0], v[0], np.full_like(g[0], -90.0), np.zeros_like(beta[0]))
    if fpenv.X86:
        assert not ((s != 0) & (np.abs(s) < np.finfo(np.float32).tiny)).any()
    assert here() == caller and np.array_equal(_settings_of_threads(64), before)
    if fpenv.X86:
        assert not caller & 0x8040 and not (before & 0x8040).any()  # the default: subnormals kept
