"""Where the fused MoE kernel finds each projection inside one layer's expert blobs: numpy
only, so the expert sources in io/ describe their memory without importing a kernel. The
kernel itself, and the calls that take these, are colibri/kernels/moe.py (fused_experts,
stacked_experts, one_expert)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.formats.ggml_blocks import BLOCK_SCHEMES
from colibri.formats.qtensor import GROUP_SIZE, chunk_shift, interleave_width_of

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FusedExperts:
    """The fused kernel for one MoE layer's blob format: where each projection's arrays sit
    inside an expert blob."""

    layout: np.ndarray   # int64 [3 projections, 5]: q offset, scales offset, rows, cols, interleave
    half: int            # bytes per int4 group (group / 2); 0 for block experts
    cshift: int
    # GGUF block experts (formats/ggml_blocks.py): int64 [3], each projection's block type as
    # its index in BLOCK_SCHEMES (the kernels' type code: kernels/cpu/blocks.py, TYPE_CODE);
    # their layout rows have no scales (offset 0) and are never interleaved. None: int4.
    blocks: np.ndarray | None = None

    @classmethod
    def of(cls, projections: dict, interleaved: bool = False) -> "FusedExperts | None":
        """The kernel for a layer whose blob layout is `projections` (ExpertLayout.projections),
        its q arrays interleaved (ExpertLayout.interleave) or as stored; None unless all three
        are symmetric int4 with one group size, or all three GGUF block schemes (of any types:
        GGUF mixes Q4_K gate/up with a Q6_K down), the formats it takes."""
        schemes = {projections[p]["scheme"] for p in PROJECTIONS}
        if schemes <= set(BLOCK_SCHEMES):
            layout = np.array([[projections[p]["parts"]["q"][0], 0, *projections[p]["shape"], 1]
                               for p in PROJECTIONS], dtype=np.int64)
            codes = np.array([BLOCK_SCHEMES.index(projections[p]["scheme"]) for p in PROJECTIONS], np.int64)
            return cls(layout, 0, 0, codes)
        if len(schemes) != 1 or not schemes <= {"int4_g64", "q4_0"}:
            return None
        if any("mins" in projections[p]["parts"] or projections[p]["shape"][0] % 8 for p in PROJECTIONS):
            return None  # (every row count is a multiple of 32 for int4 experts: their rows are
            #             the other projections' inputs, so the 8-row blocks cover them all)
        def width(spec):
            return interleave_width_of(spec["scheme"], spec["shape"]) if interleaved else 1

        layout = np.array([[projections[p]["parts"]["q"][0], projections[p]["parts"]["scales"][0],
                            *projections[p]["shape"], width(projections[p])] for p in PROJECTIONS], dtype=np.int64)
        half = GROUP_SIZE[schemes.pop()] // 2
        return cls(layout, half, chunk_shift(half))


@dataclass(frozen=True)
class StackedExperts:
    """One MoE layer's expert blobs in place: `memory` [slots, stride] uint8 (slot s holds one
    expert's blob from byte 0) and the layer's kernel."""

    memory: np.ndarray
    kernel: FusedExperts

    @classmethod
    def view(cls, memory: np.ndarray, stride: int, slots: int, projections: dict,
             interleaved: bool = False) -> "StackedExperts | None":
        """`memory` (uint8, `slots` blobs of `stride` bytes each) for a layer whose blob layout
        is `projections` (q arrays interleaved or not); None when there are no slots or the
        kernel does not take the format."""
        kernel = FusedExperts.of(projections, interleaved)
        if kernel is None or slots == 0:
            return None
        return cls(memory.reshape(-1)[: slots * stride].reshape(slots, stride), kernel)
