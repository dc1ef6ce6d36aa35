"""The fused routed-experts decode kernel (colibri/kernels/moe.py): K experts in one call equal
the same experts one call each summed in expert-id order bit for bit (what makes placement
invisible), whatever the threads and slot layout, and the float64 dequantized reference within
float32 rounding."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from colibri.io.container import pack_expert
from colibri.formats.expert_blob import FusedExperts, StackedExperts
from colibri.kernels import ops
from colibri.kernels.moe import ExpertActivation, fused_experts, one_expert, routed_experts, stacked_experts
from colibri.formats.qtensor import dequantize, quantize


def _layer(rng, E, D, I, scheme):
    experts = [{"gate_proj": quantize(rng.standard_normal((I, D)).astype(np.float32) * 0.05, scheme),
                "up_proj": quantize(rng.standard_normal((I, D)).astype(np.float32) * 0.05, scheme),
                "down_proj": quantize(rng.standard_normal((D, I)).astype(np.float32) * 0.05, scheme)}
               for _ in range(E)]
    blobs = [pack_expert(e) for e in experts]
    memory = np.stack([b for b, _ in blobs])                    # [E, blob]: ResidentExperts' layout
    return experts, memory, blobs[0][1]


def _one_at_a_time(kernel, x, memory, ids, weights, nthreads):
    """run_experts' decode arithmetic when the experts are not all in RAM: one call per expert
    on its own blob (a copy, as a staging buffer would hold it), out += y in ascending id."""
    out = np.zeros(x.shape[0], np.float32)
    for e, w in sorted(zip(ids, weights)):
        out += one_expert(kernel, x, memory[e].copy(), w, nthreads)
    return out


@pytest.mark.parametrize("scheme, D, I, E, K", [
    ("int4_g64", 256, 192, 16, 8),    # Qwen3-30B's structure, reduced
    ("int4_g64", 512, 128, 8, 2),
    ("q4_0", 224, 96, 6, 3),
])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_one_call_equals_one_call_per_expert(scheme, D, I, E, K, nthreads):
    rng = np.random.default_rng(0)
    experts, memory, layout = _layer(rng, E, D, I, scheme)
    stacked = StackedExperts.view(memory, memory.shape[1], E, layout)
    assert stacked is not None
    x = rng.standard_normal(D).astype(np.float32)
    for _ in range(3):
        ids = np.sort(rng.choice(E, size=K, replace=False))
        w = rng.random(K).astype(np.float32)
        got = stacked_experts(stacked, x, ids.astype(np.int64), w, nthreads)
        np.testing.assert_array_equal(got, _one_at_a_time(stacked.kernel, x, memory, ids, w, 3 - nthreads))
        ref = sum(float(wk) * _swiglu64(experts[e], x) for e, wk in zip(ids, w))
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def _swiglu64(e, x):
    g, u, d = (dequantize(e[p]).astype(np.float64) for p in ("gate_proj", "up_proj", "down_proj"))
    gx = g @ x
    return d @ (gx / (1 + np.exp(-gx)) * (u @ x))


def test_slots_at_a_stride_larger_than_the_blob():
    """The expert store's pool: slots sized for the largest blob, experts in any slot order."""
    rng = np.random.default_rng(1)
    experts, memory, layout = _layer(rng, 4, 128, 64, "int4_g64")
    stride = memory.shape[1] + 8192
    pool = np.zeros((6, stride), np.uint8)
    where = [5, 0, 3, 1]                       # expert e lives in slot where[e]
    for e, s in enumerate(where):
        pool[s, : memory.shape[1]] = memory[e]
    stacked = StackedExperts.view(pool, stride, 6, layout)
    x = rng.standard_normal(128).astype(np.float32)
    ids = np.array([0, 2, 3])
    w = np.array([0.5, 0.25, 0.125], np.float32)
    got = stacked_experts(stacked, x, np.array([where[e] for e in ids], np.int64), w, 2)
    np.testing.assert_array_equal(got, _one_at_a_time(stacked.kernel, x, memory, ids, w, 2))
    ref = sum(float(wk) * _swiglu64(experts[e], x) for e, wk in zip(ids, w))
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def test_formats_the_kernel_does_not_take():
    rng = np.random.default_rng(2)
    for scheme in ("q4_1", "q8_0"):
        _, memory, layout = _layer(rng, 2, 128, 64, scheme)
        assert FusedExperts.of(layout) is None
        assert StackedExperts.view(memory, memory.shape[1], 2, layout) is None


def test_every_call_shares_one_compiled_kernel():
    """Bit-equality between a stacked call and per-blob calls holds because both run the same
    machine code; a second specialization (a read-only or non-contiguous blob, another index
    type) would be compiled apart and could round differently."""
    rng = np.random.default_rng(3)
    experts, memory, layout = _layer(rng, 3, 128, 64, "int4_g64")
    kernel = FusedExperts.of(layout)
    x = rng.standard_normal(128).astype(np.float32)
    fused_experts(kernel, x, memory, np.array([0, 2]), np.array([0.5, 0.5], np.float32), 2)
    one_expert(kernel, x, memory[1], 0.25, 2)
    # one per activation mode (the `act` argument's type: float32 exact, int8 for int8 activations)
    act = list(inspect.signature(routed_experts.py_func).parameters).index("act")
    exact = [sig for sig in routed_experts.nopython_signatures if str(sig.args[act]) == "float32"]
    assert len(exact) == 1


def _glu64(kind, g, u, alpha, limit):
    if kind == ops.SILU:
        return g / (1 + np.exp(-g)) * u
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    if kind == ops.CLIPPED_SILU:
        return g / (1 + np.exp(-g)) * u
    return (u + 1) * g / (1 + np.exp(-alpha * g))


@pytest.mark.parametrize("scheme", ["int4_g64", "mxfp4"])
@pytest.mark.parametrize("kind, biased", [(ops.GPT_OSS, True), (ops.CLIPPED_SILU, False), (ops.SILU, True)])
def test_activations_and_biases(scheme, kind, biased):
    """gpt-oss's clamped SwiGLU with per-expert biases, and the clipped SwiGLU of DeepSeek V4 and
    GLM-5.3-Flash, inside the fused kernel: one call equals one call per expert (each with its
    own bias rows) summed in id order, bit for bit, and the float64 reference within float32
    rounding; a limit low enough that the clamps bite."""
    rng = np.random.default_rng(4)
    E, D, I, K = 5, 128, 64, 3
    experts, memory, layout = _layer(rng, E, D, I, scheme)
    stacked = StackedExperts.view(memory, memory.shape[1], E, layout)
    biases = tuple(rng.standard_normal((E, n)).astype(np.float32) * 0.3 for n in (I, I, D)) if biased else None
    activation = ExpertActivation(kind, 1.702, 0.35, biases)
    x = rng.standard_normal(D).astype(np.float32) * 2
    ids = np.array([0, 2, 4])
    w = rng.random(K).astype(np.float32)
    got = stacked_experts(stacked, x, ids, w, 2, "f32", activation.for_experts(ids))
    one = np.zeros(D, np.float32)
    for e, wk in zip(ids, w):
        one += one_expert(stacked.kernel, x, memory[e].copy(), wk, 1, "f32", activation.for_experts([e]))
    np.testing.assert_array_equal(got, one)
    ref = np.zeros(D)
    for e, wk in zip(ids, w):
        g, u, d = (dequantize(experts[e][p]).astype(np.float64) for p in ("gate_proj", "up_proj", "down_proj"))
        b = [np.zeros(n) for n in (I, I, D)] if biases is None else [bb[e].astype(np.float64) for bb in biases]
        a = _glu64(kind, g @ x + b[0], u @ x + b[1], 1.702, 0.35)
        ref += float(wk) * (d @ a + b[2])
    assert np.abs(np.minimum(g @ x, 9) - np.minimum(g @ x, 0.35)).max() > 0  # the clamp bites
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max() + 1e-6)
