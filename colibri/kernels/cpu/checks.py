"""The checks every CPU kernel entry point runs before numba sees an array: scheme, dtype,
shape and contiguity of a QTensor (once per tensor), of the activations and of an output
buffer, so numba only ever compiles for contiguous arrays of the expected types.
"""
from __future__ import annotations

import numpy as np

from colibri.formats.ggml_blocks import BLOCK_TYPES, row_bytes
from colibri.formats.qtensor import GROUP_SIZE, INTERLEAVED_SCHEMES, SCHEMES, QTensor

# --- Python-level dispatch and checks -----------------------------------------------------


def check_tensor(t: QTensor) -> None:
    # A tensor is checked once: the engine calls the kernels ~100 times per token on the same
    # weights, and QTensor arrays are not swapped after construction.
    if t.__dict__.get("_checked"):
        return
    _check_tensor_once(t)
    t.__dict__["_checked"] = True


def _check_tensor_once(t: QTensor) -> None:
    if t.scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {t.scheme!r}; known: {', '.join(SCHEMES)}")
    out, n = t.shape
    if t.scheme in BLOCK_TYPES:
        bt = BLOCK_TYPES[t.scheme]
        if n % bt.elements:
            raise ValueError(f"{t.scheme} tensor of shape {t.shape}: inputs must be a multiple of {bt.elements}")
        rb = row_bytes(t.scheme, n)
        if t.q.dtype != np.uint8 or t.q.shape != (out, rb) or not t.q.flags.c_contiguous or t.interleave != 1:
            raise ValueError(f"{t.scheme} tensor of shape {t.shape} needs q as row-major C-contiguous uint8 "
                             f"[{out}, {rb}] (GGUF blocks), got {t.q.dtype.name} {t.q.shape}")
        return
    want = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "q8_0": np.int8}.get(t.scheme, np.uint8)
    qcols = n // 2 if t.scheme in GROUP_SIZE and t.scheme != "q8_0" else n
    if t.q.dtype != want or t.q.shape != (out, qcols) or not t.q.flags.c_contiguous:
        raise ValueError(
            f"{t.scheme} tensor of shape {t.shape} needs q as C-contiguous {np.dtype(want).name} "
            f"[{out}, {qcols}], got {t.q.dtype.name} {t.q.shape}"
            + ("" if t.q.flags.c_contiguous else " (not contiguous)")
        )
    ilv = t.interleave
    if ilv != 1 and (t.scheme not in INTERLEAVED_SCHEMES or ilv < 1 or ilv & (ilv - 1) or out % 8 or out % ilv):
        raise ValueError(f"{t.scheme} tensor of shape {t.shape} cannot have its rows interleaved in blocks of "
                         f"{ilv} (int4 and q8_0 only, a power of two dividing the rows, rows a multiple of 8)")
    if t.scheme in GROUP_SIZE:
        g = GROUP_SIZE[t.scheme]
        for name in ("scales", "mins") if t.scheme == "q4_1" else ("scales",):
            a = getattr(t, name)
            if a is None or a.dtype != np.float32 or a.shape != (out, n // g) or not a.flags.c_contiguous:
                raise ValueError(f"{t.scheme} tensor needs {name} as C-contiguous float32 [{out}, {n // g}]")


def checked_x(x: np.ndarray, ndim: int, n: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"{what}: x must be float32, got {x.dtype}; cast it with x.astype(np.float32)")
    if x.ndim != ndim or x.shape[-1] != n:
        want = f"[{n}]" if ndim == 1 else f"[L, {n}]"
        raise ValueError(f"{what}: x must have shape {want} for a weight with {n} inputs, got {x.shape}")
    return np.ascontiguousarray(x)


def result_array(out: np.ndarray | None, shape: tuple[int, ...], what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            f"{what}: out must be a writeable C-contiguous float32 array of shape {shape}, "
            f"got {out.dtype} {out.shape}"
        )
    return out


def int4_args(t: QTensor) -> tuple:
    """The dequantizers' arguments (q, scales, mins, half, has_min, ilv)."""
    has_min = t.scheme == "q4_1"
    # Symmetric schemes have no mins; scales stands in so numba sees one signature.
    return t.q, t.scales, t.mins if has_min else t.scales, GROUP_SIZE[t.scheme] // 2, has_min, t.interleave
