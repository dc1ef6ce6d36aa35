"""colibri/formats/ggml_blocks.py against llama.cpp's gguf-py: the numpy dequantizers give
gguf.quants.dequantize's float32 bits exactly on random valid blocks of every block scheme; the
quantizers' bytes decode the same through both, reach the quality of ggml's reference
quantizers on Gaussian weights, and for Q5_0 / Q5_1 / MXFP4 equal gguf.quants.quantize's bytes."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from colibri.formats.ggml_blocks import (
    BLOCK_SCHEMES,
    BLOCK_TYPES,
    dequantize_blocks,
    get_scale_min_k4,
    pack_scale_min_k4,
    quantize_blocks,
    row_bytes,
)
from colibri.formats.qtensor import QTensor, dequantize, quantize

GGUF_TYPE = {s: GT[bt.gguf_name] for s, bt in BLOCK_TYPES.items()}

# Byte offsets of each block's f16 fields (ggml-common.h), which random payload bytes must not
# fill with NaN / inf / huge values.
F16_FIELDS = {
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
    "iq4_nl": (0,), "iq4_xs": (0,), "q5_0": (0,), "q5_1": (0, 2), "mxfp4": (),
}

# Relative RMS error of dequantize(quantize(w)) on standard Gaussian weights: measured
# (64 x 2048, three seeds; llama.cpp's own reference quantizers, called from libggml-base,
# give the same to 3 digits) and set a little above.
#            measured
RMS_BOUND = {
    "q2_k": 0.31,     # 0.297
    "q3_k": 0.16,     # 0.151
    "q4_k": 0.075,    # 0.0715
    "q5_k": 0.038,    # 0.0362
    "q6_k": 0.019,    # 0.0178
    "iq4_nl": 0.080,  # 0.0762
    "iq4_xs": 0.080,  # 0.0768
    "q5_0": 0.045,    # 0.0429
    "q5_1": 0.040,    # 0.0380
    "mxfp4": 0.12,    # 0.1155
}
assert set(RMS_BOUND) == set(BLOCK_SCHEMES) == set(F16_FIELDS)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def random_blocks(scheme: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random payload bytes with sane f16 scale fields (a few zero, a few negative, one
    subnormal) and MXFP4 exponents in 2^-27..2^22."""
    bt = BLOCK_TYPES[scheme]
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (rows, blocks, bt.nbytes), dtype=np.uint8)
    for off in F16_FIELDS[scheme]:
        v = (rng.standard_normal((rows, blocks)) * 0.05).astype(np.float16)
        v[0, 0] = 0.0
        v[-1, -1] = np.float16(3e-6)  # subnormal
        q[:, :, off:off + 2] = v.view(np.uint8).reshape(rows, blocks, 2)
    if scheme == "mxfp4":
        q[:, :, 0] = rng.integers(100, 150, (rows, blocks))
    return q.reshape(rows, blocks * bt.nbytes)


def gaussian(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def rel_rms(a, w):
    return float(np.sqrt(np.mean((a - w) ** 2) / np.mean(w ** 2)))


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_dequantize_matches_gguf_py_bit_for_bit(scheme):
    bt = BLOCK_TYPES[scheme]
    rows, blocks = 16, max(2, 2048 // bt.elements)
    q = random_blocks(scheme, rows, blocks, seed=BLOCK_SCHEMES.index(scheme))
    ours = dequantize_blocks(q, scheme, blocks * bt.elements)
    assert same_bits(ours, gq.dequantize(q, GGUF_TYPE[scheme]))
    assert np.isfinite(ours).all()


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_quantize_round_trip(scheme):
    w = gaussian((64, 2048), seed=7)
    q = quantize_blocks(w, scheme)
    assert q.dtype == np.uint8 and q.shape == (64, row_bytes(scheme, 2048))
    ours = dequantize_blocks(q, scheme, 2048)
    assert same_bits(ours, gq.dequantize(q, GGUF_TYPE[scheme]))
    err = rel_rms(ours, w)
    assert err < RMS_BOUND[scheme], f"{scheme}: relative RMS error {err:.4f}"
    # the same through the QTensor API
    t = quantize(w, scheme)
    assert t.scheme == scheme and t.shape == w.shape and t.scales is None and t.mins is None and t.interleave == 1
    assert np.array_equal(t.q, q)
    assert same_bits(dequantize(t), ours)


@pytest.mark.parametrize("scheme", ["q5_0", "q5_1", "mxfp4"])
def test_quantize_equals_gguf_py_bytes(scheme):
    w = gaussian((32, 1024), seed=3)
    w[1] *= 1000.0   # rows of very different magnitude
    w[2] *= 1e-3
    w[3, :64] = 0.0  # zero blocks
    w[4, 5] = 40.0   # an outlier
    w[5, :32] = 0.75  # a constant block
    assert np.array_equal(quantize_blocks(w, scheme), gq.quantize(w, GGUF_TYPE[scheme]))


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_zero_rows_and_outliers_stay_finite(scheme):
    w = gaussian((6, 512), seed=11)
    w[0] = 0.0
    w[1, :256] = 0.0
    w[2, 100] = 1000.0   # one huge outlier
    w[3, 7] = -1000.0
    w[4] = 0.5           # constant row
    w[5, :300] *= 1e-6   # tiny blocks next to normal ones
    d = dequantize_blocks(quantize_blocks(w, scheme), scheme, 512)
    assert np.isfinite(d).all()
    assert np.all(d[0] == 0) and np.all(d[1, :256] == 0)
    # the outlier itself survives, roughly: MXFP4's power-of-two scale can leave the top level
    # up to 25% under a block's largest value (1000 -> 768)
    assert abs(d[2, 100] - 1000.0) < 0.3 * 1000.0 and abs(d[3, 7] + 1000.0) < 0.3 * 1000.0


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_inputs_not_a_multiple_of_the_block(scheme):
    bt = BLOCK_TYPES[scheme]
    bad = bt.elements + 16
    with pytest.raises(ValueError, match=f"multiple of {bt.elements}"):
        quantize_blocks(np.zeros((2, bad), np.float32), scheme)
    with pytest.raises(ValueError, match=f"multiple of {bt.elements}"):
        dequantize_blocks(np.zeros((2, 10 * bt.nbytes), np.uint8), scheme, bad)
    with pytest.raises(ValueError, match=f"multiple of {bt.elements}"):
        quantize(np.zeros((2, bad), np.float32), scheme)


def test_bad_arguments():
    with pytest.raises(ValueError, match="not a block scheme"):
        quantize_blocks(np.zeros((2, 256), np.float32), "q4_0")
    with pytest.raises(ValueError, match=r"uint8 \[out, 144\]"):
        dequantize_blocks(np.zeros((2, 143), np.uint8), "q4_k", 256)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_blocks(np.zeros((2, 144), np.int8), "q4_k", 256)
    with pytest.raises(ValueError, match="2-D"):
        quantize_blocks(np.zeros(256, np.float32), "q4_k")


def test_scale_min_k4_packing_round_trips():
    rng = np.random.default_rng(5)
    sc, mn = rng.integers(0, 64, (2, 100, 8), dtype=np.uint8)
    packed = pack_scale_min_k4(sc, mn)
    assert packed.shape == (100, 12)
    back_sc, back_mn = get_scale_min_k4(packed)
    assert np.array_equal(back_sc, sc) and np.array_equal(back_mn, mn)
    # and every 12-byte pattern is what get_scale_min_k4 reads back into the same bytes
    raw = rng.integers(0, 256, (100, 12), dtype=np.uint8)
    assert np.array_equal(pack_scale_min_k4(*get_scale_min_k4(raw)), raw)


def test_qtensor_dequantize_of_gguf_bytes():
    # a QTensor holding GGUF bytes as read from a file decodes like gguf-py
    q = random_blocks("q6_k", 4, 2, seed=9)
    t = QTensor("q6_k", (4, 512), q)
    assert same_bits(dequantize(t), gq.dequantize(q, GT.Q6_K))
