"""colibri/formats/qtensor.py against independent computations and llama.cpp's gguf-py reference quantizers."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from colibri.formats.qtensor import (
    GROUP_SIZE,
    SCHEMES,
    QTensor,
    bf16_to_f32,
    dequantize,
    f32_to_bf16,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)

GGUF_TYPE = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0}


def weights(seed, shape=(24, 256)):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[3] *= 100.0  # rows and groups of very different magnitude
    w[5, :32] = 0.0
    w[6, 7] = 30.0  # an outlier in one group
    return w


def to_gguf_blocks(t: QTensor) -> np.ndarray:
    """QTensor -> GGUF block bytes [out, n_blocks * block_bytes]: f16 d, [f16 m], then qs."""
    out, n = t.shape
    nb = n // GROUP_SIZE[t.scheme]
    f16 = lambda a: a.astype(np.float16).view(np.uint8).reshape(out, nb, 2)  # noqa: E731
    parts = [f16(t.scales)] + ([f16(t.mins)] if t.mins is not None else [])
    parts.append(t.q.view(np.uint8).reshape(out, nb, -1))
    return np.concatenate(parts, axis=2).reshape(out, -1)


@pytest.mark.parametrize("group", [32, 64])
def test_pack_unpack_roundtrip_and_layout(group):
    rng = np.random.default_rng(0)
    nib = rng.integers(0, 16, size=(5, 4 * group), dtype=np.uint8)
    packed = pack_nibbles(nib, group)
    assert packed.shape == (5, 2 * group) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_nibbles(packed, group), nib)
    # byte k of group j: low nibble = element k, high nibble = element k + group/2
    half = group // 2
    for j in range(4):
        for k in (0, 1, half - 1):
            b = packed[2, j * half + k]
            assert b & 15 == nib[2, j * group + k]
            assert b >> 4 == nib[2, j * group + half + k]


def test_int4_g64_rule_matches_independent_computation():
    w = weights(1, (8, 192))
    t = quantize(w, "int4_g64")
    nib = unpack_nibbles(t.q, 64)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // 64):
            block = [float(v) for v in w[r, 64 * g: 64 * (g + 1)]]
            s = np.float32(max(abs(v) for v in block)) / np.float32(7)
            assert t.scales[r, g] == s
            for k, v in enumerate(block):
                q = 0 if s == 0 else min(7, max(-8, round(v / float(s))))  # Python round: half to even
                assert int(nib[r, 64 * g + k]) - 8 == q


def test_int4_g64_rounds_halves_to_even():
    w = np.zeros((1, 64), np.float32)
    w[0, :6] = [7.0, 2.5, -3.5, 0.5, -0.5, 1.5]  # s = 1 exactly
    t = quantize(w, "int4_g64")
    assert t.scales[0, 0] == 1.0
    np.testing.assert_array_equal(dequantize(t)[0, :6], [7.0, 2.0, -4.0, 0.0, -0.0, 2.0])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_rows_give_zeros(scheme):
    w = np.zeros((3, 256), np.float32)  # 256: the K-quants' block
    t = quantize(w, scheme)
    d = dequantize(t)
    assert d.dtype == np.float32 and d.shape == (3, 256)
    np.testing.assert_array_equal(d, 0.0)


def test_int4_g64_error_bound():
    w = weights(2, (32, 512))
    t = quantize(w, "int4_g64")
    err = np.abs(w - dequantize(t)).reshape(32, 8, 64)
    bound = t.scales[:, :, None] / 2
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("scheme", ["q4_0", "q4_1", "q8_0"])
def test_gguf_quantizers_bit_exact(scheme):
    w = weights(3)
    ours = to_gguf_blocks(quantize(w, scheme))
    ref = gq.quantize(w, GGUF_TYPE[scheme])
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("scheme", ["q4_0", "q4_1", "q8_0"])
def test_dequantize_matches_gguf(scheme):
    t = quantize(weights(4), scheme)
    ref = gq.dequantize(to_gguf_blocks(t), GGUF_TYPE[scheme])
    np.testing.assert_array_equal(dequantize(t), ref)


def test_q8_0_rounds_halves_away_from_zero():
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [127.0, 2.5, -2.5, 0.5]  # d = 1 exactly
    np.testing.assert_array_equal(quantize(w, "q8_0").q[0, :4], [127, 3, -3, 1])


def test_bf16_matches_gguf_and_rounds_to_nearest_even():
    w = weights(5)
    bits = f32_to_bf16(w)
    np.testing.assert_array_equal(bits, gq.quantize(w, GT.BF16).view(np.uint16))
    back = bf16_to_f32(bits)
    # nearest bf16: 8 significant bits, so the error is at most half a unit: <= 2^-8 relative
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-8)
    exact = back.copy()
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(exact)), exact)  # representable: unchanged
    ulp = 2.0**-7
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 + 2.0**-20], np.float32)
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(x)), [1.0, 1 + 2 * ulp, -1.0, 1 + ulp])


@pytest.mark.parametrize("scheme", ["f32", "f16"])
def test_float_schemes_roundtrip(scheme):
    w = weights(6)
    t = quantize(w, scheme)
    expect = w.astype(np.float16).astype(np.float32) if scheme == "f16" else w
    np.testing.assert_array_equal(dequantize(t), expect)


def test_rows_view_and_nbytes():
    t = quantize(weights(7), "q4_1")
    sub = t.rows(4, 9)
    assert sub.shape == (5, 256) and np.shares_memory(sub.q, t.q)
    np.testing.assert_array_equal(dequantize(sub), dequantize(t)[4:9])
    assert t.nbytes == 24 * 128 + 2 * 24 * 8 * 4


def test_bad_group_multiple_raises():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize(np.zeros((2, 48), np.float32), "int4_g64")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quantize(np.zeros((2, 64), np.float32), "q7_k")
