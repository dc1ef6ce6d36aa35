"""Rope.cos_sin_at, the decode token's angles from a table of ROPE_BLOCK positions, against
Rope.cos_sin on the one position (what a decode token computed before, and what prefill
computes for a run of positions)."""
import numpy as np

from colibri.models.rope import ROPE_BLOCK, ROPE_BLOCKS_KEPT, Rope


def test_rows_equal_one_position_calls_across_blocks():
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64)).astype(np.float32)
    rope = Rope(inv_freq, 1.25, 64)
    positions = [0, 1, ROPE_BLOCK - 1, ROPE_BLOCK, 3 * ROPE_BLOCK + 7, 70_000, 5, 70_001]  # back and forth
    for p in positions:
        cos, sin = rope.cos_sin_at(p)
        ref_cos, ref_sin = rope.cos_sin(np.arange(p, p + 1))
        assert cos.shape == sin.shape == (1, 64) and cos.dtype == sin.dtype == np.float32
        assert cos.flags.c_contiguous and sin.flags.c_contiguous
        np.testing.assert_array_equal(cos, ref_cos)
        np.testing.assert_array_equal(sin, ref_sin)


def test_blocks_kept_are_bounded():
    """A batch's sequences at far-apart positions each keep their block; no more than
    ROPE_BLOCKS_KEPT are held."""
    rope = Rope(np.ones(4, np.float32), 1.0, 8)
    for k in range(3 * ROPE_BLOCKS_KEPT):
        rope.cos_sin_at(k * ROPE_BLOCK + 1)
        assert len(rope._blocks) <= ROPE_BLOCKS_KEPT
    np.testing.assert_array_equal(rope.cos_sin_at(5)[0], rope.cos_sin(np.arange(5, 6))[0])
