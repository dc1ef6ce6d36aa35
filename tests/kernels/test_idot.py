"""int4 and q8_0 weights x int8 activations (colibri/kernels/idot.py, `--activations int8`): the integer
dot equals the dot of the weights with the int8-rounded activations (a float64 reference)
within float32 rounding; a row's bits never depend on the caller (matvec, matmul, the fused
MoE kernel), the thread split or the instruction set (VNNI, AVX2 pairs, the portable IR)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.io.container import pack_expert
from colibri.kernels import idot
from colibri.kernels.cpu import matvec as exact_matvec
from colibri.formats.expert_blob import StackedExperts
from colibri.kernels.moe import one_expert, stacked_experts
from colibri.formats.qtensor import GROUP_SIZE, dequantize, interleaved, quantize

from compiled_forms import run_in_forms

SHAPES = [(64, 576), (37, 576), (24, 2048), (130, 768), (8, 224)]  # 576: 64-byte chunks + a 16-byte tail


def _rounded(x: np.ndarray, half: int) -> np.ndarray:
    """x as the kernel sees it: each group of 2*half rounded to int8 with scale max|x| / 127."""
    g = 2 * half
    xg = x.reshape(-1, g).astype(np.float32)
    s = np.abs(xg).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(s > 0, np.float32(127) / np.abs(xg).max(axis=1, keepdims=True), 0).astype(np.float32)
    return (np.round(xg * inv).astype(np.float64) * s).reshape(-1)


def _case(scheme, out, n, seed=0):
    rng = np.random.default_rng(seed)
    t = quantize(rng.standard_normal((out, n)).astype(np.float32), scheme)
    return t, rng.standard_normal(n).astype(np.float32) * 3


@pytest.mark.parametrize("scheme", ["int4_g64", "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("out, n", SHAPES)
def test_matvec_is_the_dot_with_rounded_activations(scheme, out, n):
    if n % GROUP_SIZE[scheme]:
        pytest.skip("not a whole number of groups")
    t, x = _case(scheme, out, n)
    got = idot.matvec_q(t, x)
    ref = dequantize(t).astype(np.float64) @ _rounded(x, GROUP_SIZE[scheme] // 2)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
    # and what rounding x costs against the exact path: small, not zero
    exact = exact_matvec(t, x)
    rel = np.abs(got - exact).max() / np.abs(exact).max()
    assert 1e-6 < rel < 0.03
    if out % 8 == 0:  # rows interleaved as the engine loads them: the same bits
        np.testing.assert_array_equal(idot.matvec_q(interleaved(t), x), got)


def test_q8_weights_of_minus_128():
    """q8_0 bytes of -128 (colibri's quantizer never writes them; another tool's file may) go
    through the AVX2 sign trick as |w| = 128 on the unsigned side: exact, no int16 overflow
    even where a pair of products is 2 * 128 * 127."""
    rng = np.random.default_rng(7)
    t = quantize(rng.standard_normal((16, 256)).astype(np.float32), "q8_0")
    t.q[:, :] = -128
    t.q[3, ::3] = 127
    x = np.full(256, 5.0, np.float32)
    x[1::2] = -5.0
    x[:4] = 5.0
    got = idot.matvec_q(t, x)
    ref = dequantize(t).astype(np.float64) @ _rounded(x, 16)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("scheme", ["int4_g64", "q4_1", "q8_0"])
def test_rows_do_not_depend_on_caller_or_threads(scheme):
    t, _ = _case(scheme, 77, 576 if scheme == "q4_1" else 640, seed=3)
    rng = np.random.default_rng(4)
    X = rng.standard_normal((5, t.shape[1])).astype(np.float32)
    q, scales, offs, coef, half, _, ilv = idot.weight_of(t)
    for nthreads in (1, 2):
        Y = np.empty((5, t.shape[0]), np.float32)
        idot.matmul(q, scales, offs, coef, half, ilv, X, Y, nthreads)
        for r in range(5):
            y = np.empty(t.shape[0], np.float32)
            idot.matvec(q, scales, offs, coef, half, ilv, X[r], y, 3 - nthreads)
            np.testing.assert_array_equal(Y[r], y)


def test_zero_and_non_finite_activations():
    t, x = _case("int4_g64", 16, 256)
    assert not idot.matvec_q(t, np.zeros(256, np.float32)).any()
    x[70] = np.nan
    assert np.isnan(idot.matvec_q(t, x)).all()  # the engine's non-finite guard must still see it


def test_fused_experts_one_call_equals_one_per_expert():
    """Placement never changes tokens under int8 activations either: the K experts of a token
    in one call equal one call per expert summed in expert-id order, bit for bit."""
    rng = np.random.default_rng(0)
    D, I, E, K = 256, 192, 8, 3
    experts = [{p: quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, "int4_g64")
                for p, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I)))}
               for _ in range(E)]
    blobs = [pack_expert(e) for e in experts]
    memory = np.stack([b for b, _ in blobs])
    stacked = StackedExperts.view(memory, memory.shape[1], E, blobs[0][1])
    x = rng.standard_normal(D).astype(np.float32)
    ids = np.array([1, 4, 6])
    w = rng.random(K).astype(np.float32)
    got = stacked_experts(stacked, x, ids, w, 2, "int8")
    one = np.zeros(D, np.float32)
    for e, wk in zip(ids, w):
        one += one_expert(stacked.kernel, x, memory[e].copy(), wk, 1, "int8")
    np.testing.assert_array_equal(got, one)
    exact = stacked_experts(stacked, x, ids, w, 2, "f32")
    assert 0 < np.abs(got - exact).max() < 0.05 * np.abs(exact).max()


_SCRIPT = """
import numpy as np
from colibri.kernels import idot
from colibri.formats.qtensor import quantize
rng = np.random.default_rng(5)
out = []
for scheme, n in (("int4_g64", 640), ("q4_0", 576), ("q4_1", 576), ("q8_0", 576)):
    t = quantize(rng.standard_normal((45, n)).astype(np.float32), scheme)
    out.append(idot.matvec_q(t, rng.standard_normal(n).astype(np.float32)))
np.save(__import__("sys").argv[1], np.concatenate(out))
print(idot.ISA)
"""


@pytest.mark.skipif(idot.ISA == "generic", reason="this CPU has neither AVX2 nor AVX-512 VNNI: only the portable IR runs here")
def test_every_integer_form_gives_the_same_bits(tmp_path):
    """The target's integer dot instructions (VNNI, AVX2 pairs) against the portable IR, and on a
    VNNI CPU its AVX2 form too: each compiled in its own process and cache."""
    assert_same_bits_in_every_form(tmp_path, _SCRIPT)


def assert_same_bits_in_every_form(tmp_path, script: str, *args: str) -> None:
    """Run `script` (python -c; argv[1]: the .npy to save its result to, then `args`; it prints
    idot.ISA) once per integer-dot form this CPU can run, each in its own process and numba
    cache (COLIBRI_IDOT; compiled_forms.py), and check the forms' results are the same bits."""
    forms = {"vnni": ("vnni", "avx2", "generic"), "avx2": ("avx2", "generic")}[idot.ISA]
    results = run_in_forms(tmp_path, script, args, "COLIBRI_IDOT", forms, own=idot.ISA, timeout=600)
    for mode in forms:
        assert results[mode][0] == mode
        np.testing.assert_array_equal(results[forms[0]][1], results[mode][1])


def test_mode_is_scoped_and_checked():
    assert idot.current() == "f32"
    with idot.activations("int8"):
        assert idot.current() == "int8"
    assert idot.current() == "f32"
    with pytest.raises(ValueError, match="activations must be one of"):
        with idot.activations("int4"):
            pass


@pytest.mark.parametrize("name, features, form", [
    ("haswell", "", "avx2"), ("znver3", "", "avx2"), ("skylake-avx512", "", "avx2"), ("znver4", "", "vnni"),
    ("icelake-server", "", "vnni"), ("x86-64", "", "generic"), ("znver4", "-avx512vnni", "avx2"),
    ("x86-64", "+avx2", "avx2"), ("sapphirerapids", "", "vnni")])
def test_a_named_target_gets_the_integer_form_it_has(monkeypatch, name, features, form):
    """A cache compiled for another CPU (bench --cpu, NUMBA_CPU_NAME) uses what that CPU has,
    never the host's instructions; COLIBRI_IDOT only narrows."""
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    monkeypatch.delenv("COLIBRI_IDOT", raising=False)
    assert idot._isa() == form
    monkeypatch.setenv("COLIBRI_IDOT", "generic")
    assert idot._isa() == "generic"
    monkeypatch.setenv("COLIBRI_IDOT", "vnni")  # cannot widen past the target
    assert idot._isa() == form
