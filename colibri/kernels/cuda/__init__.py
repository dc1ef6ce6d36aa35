"""The GPU tier's kernels (numba @cuda.jit, kernels.py) and their host side: weights uploaded
once as DeviceMatrix, device arrays in, device arrays out, so a forward pass moves only the
tokens' embedding rows in and their logits out.

Import-guarded: importing this package never needs a GPU or the CUDA toolkit (numba compiles
a kernel at its first launch). available() says whether kernels can run: a CUDA GPU, or
numba's simulator (NUMBA_ENABLE_CUDASIM=1, set before numba is imported), which runs the same
kernels on the CPU for the tests. require() raises a ColibriError otherwise.

This package is not one of colibri.kernels' top-level modules on purpose: their numba cache is
keyed by a digest of those files (colibri/kernels/__init__.py), and a change here must not
recompile the CPU kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.ggml_blocks import BLOCK_TYPES
from colibri.formats.qtensor import GROUP_SIZE, INT4_SCHEMES, QTensor, row_major

try:  # numba's built-in CUDA target, or numba-cuda's (which replaces it when installed)
    from numba import config as _numba_config
    from numba import cuda

    from . import kernels as k
    from . import sampling
except ImportError as e:  # a numba without any CUDA target
    cuda = None
    k = sampling = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""


def simulated() -> bool:
    """True when numba's CUDA simulator stands in for a GPU."""
    return cuda is not None and bool(_numba_config.ENABLE_CUDASIM)


def _nvidia_target() -> bool:
    """numba-cuda (NVIDIA's maintained target) rather than numba's deprecated built-in one, which
    (numba 0.68) cannot type max() of two floats in device code, so these kernels do not
    compile with it. The simulator is the same in both."""
    return getattr(cuda, "implementation", "") == "NVIDIA"


def available() -> bool:
    """Whether the CUDA kernels can run here: a working CUDA GPU (driver, and numba-cuda with
    its toolkit libraries), or the simulator."""
    if cuda is None:
        return False
    if simulated():
        return True
    try:
        return _nvidia_target() and bool(cuda.is_available())
    except Exception:  # a broken driver install answers with an exception, not False
        return False


def require() -> None:
    """Raise a ColibriError saying why the CUDA device cannot be used, when it cannot."""
    if cuda is None:
        raise ColibriError(f"--device cuda needs numba's CUDA target ({_IMPORT_ERROR}); install it "
                           "with: pip install numba-cuda (colibri's gpu extra)")
    if simulated():
        return
    try:
        gpu = bool(cuda.is_available())
    except Exception:
        gpu = False
    if not gpu:
        raise ColibriError("--device cuda: no CUDA GPU found (numba.cuda.is_available() is False: no NVIDIA "
                           "driver, or no CUDA toolkit: pip install numba-cuda, colibri's gpu extra); "
                           "use --device cpu")
    if not _nvidia_target():
        raise ColibriError("--device cuda needs NVIDIA's numba-cuda (numba's built-in CUDA target cannot "
                           "compile colibri's kernels): pip install numba-cuda, colibri's gpu extra")


def device_name() -> str:
    if simulated():
        return "numba CUDA simulator"
    return cuda.get_current_device().name.decode() if available() else "none"


def free_bytes() -> int:
    """Device memory free now (the CUDA API's figure); under the simulator, whose "device
    memory" is host memory, the host's available memory: MemAvailable, which counts the page
    cache the kernel would drop (free pages alone can be near zero after a large write)."""
    if simulated():
        from colibri.memory import available_memory

        return available_memory()
    free, _total = cuda.current_context().get_memory_info()
    return int(free)


# --- arrays -------------------------------------------------------------------------------


def to_device(a: np.ndarray, stream=0):
    """A device copy of `a`; on `stream` (asynchronous to the default stream's kernels) when given."""
    return cuda.to_device(np.ascontiguousarray(a), stream=stream)


def empty(shape, dtype=np.float32):
    return cuda.device_array(shape, dtype)


def to_host(d) -> np.ndarray:
    return d.copy_to_host()


def _threads(n: int) -> tuple[int, int]:
    """(blocks, threads) for a kernel with one thread per item of n."""
    block = k.ELEMENTWISE
    return max(1, (n + block - 1) // block), block


_POW2 = None


def _pow2():
    global _POW2
    if _POW2 is None:
        _POW2 = to_device(k.POW2)
    return _POW2


# --- weights ------------------------------------------------------------------------------


@dataclass
class DeviceMatrix:
    """A QTensor's arrays on the device, in the layout its kernel reads. int4 schemes: the
    packed bytes as uint32 words [out, in / 8], scales, and offs = mins (q4_1) or scales."""

    scheme: str
    shape: tuple[int, int]
    q: object
    scales: object = None
    offs: object = None
    nbytes: int = 0


def upload(t: QTensor, stream=0) -> DeviceMatrix:
    """Copy a weight matrix to the device (dense weights: once, for the model's life; routed
    experts: into the VRAM tier, on its copy stream). The device kernels read rows
    row-major: a matrix interleaved for the CPU kernels is put back first."""
    if t.scheme in BLOCK_TYPES:
        raise ValueError(f"no CUDA kernel for GGUF {BLOCK_TYPES[t.scheme].gguf_name} weights yet; "
                         "run the layers holding them on the CPU (--device cpu)")
    t = row_major(t)
    out, n = t.shape

    def dev(a):
        return to_device(a, stream)

    if t.scheme in INT4_SCHEMES:
        words = np.ascontiguousarray(t.q).view(np.uint32)  # [out, in / 8], little-endian bytes
        offs = t.mins if t.scheme == "q4_1" else None
        dm = DeviceMatrix(t.scheme, (out, n), dev(words), dev(t.scales), dev(offs) if offs is not None else None)
    elif t.scheme == "q8_0":
        dm = DeviceMatrix(t.scheme, (out, n), dev(t.q), dev(t.scales))
    elif t.scheme == "f32":
        dm = DeviceMatrix(t.scheme, (out, n), dev(np.asarray(t.q, np.float32)))
    elif t.scheme in ("f16", "bf16"):
        dm = DeviceMatrix(t.scheme, (out, n), dev(np.ascontiguousarray(t.q).view(np.uint16)))
    else:
        raise ValueError(f"unknown quantization scheme {t.scheme!r}")
    dm.nbytes = t.nbytes
    return dm


def upload_stacked(ts: list[QTensor], stream=0) -> DeviceMatrix:
    """Matrices that read the same input (an expert's gate and up) stacked by rows into one
    device matrix: one kernel call for both, the same numbers (rows are independent)."""
    if len({t.scheme for t in ts}) != 1 or len({t.shape[1] for t in ts}) != 1:
        raise ValueError("stacked matrices need one scheme and one input width")

    def cat(arrays):
        return None if arrays[0] is None else np.concatenate(arrays, axis=0)

    ts = [row_major(t) for t in ts]
    return upload(QTensor(ts[0].scheme, (sum(t.shape[0] for t in ts), ts[0].shape[1]), cat([t.q for t in ts]),
                          cat([t.scales for t in ts]), cat([t.mins for t in ts])), stream)


def stream():
    """A CUDA stream of its own (the VRAM tier's copies), or the default stream (0) where the
    simulator has none to overlap."""
    return 0 if simulated() else cuda.stream()


def upload_vector(a: np.ndarray | None):
    """A float32 vector (norm weight, bias) on the device; None stays None."""
    return None if a is None else to_device(np.asarray(a, dtype=np.float32))


# --- kernels ------------------------------------------------------------------------------


def linear(w: DeviceMatrix, x, out=None, bias=None, activations: str = "f32"):
    """x [L, in] (device, float32) -> x @ W.T [L, out] (+ bias) on the device. activations
    "int8" takes the integer-dot kernel for int4 weights and x rounded to int8 per group for
    q8_0 ones (idot.py's opt-in path)."""
    L = x.shape[0]
    rows, n = w.shape
    y = empty((L, rows)) if out is None else out
    per_block = k.ROWS * k.RPW
    grid = ((rows + per_block - 1) // per_block, (L + k.TILE_L - 1) // k.TILE_L)
    block = k.ROWS * k.LANES
    s = w.scheme
    if s in INT4_SCHEMES:
        half = GROUP_SIZE[s] // 2
        if activations == "int8":
            xq = empty((L, n), np.int8)
            sx = empty((L, n // (2 * half)))
            k.quantize_groups[_threads(L * n // (2 * half))](x, 2 * half, xq, sx)
            offs = w.offs if w.offs is not None else w.scales
            k.int4_idot_rows[grid, block](w.q, w.scales, offs, s != "q4_1", half, xq, sx, y)
        else:
            offs, coef = (w.offs, 1.0) if s == "q4_1" else (w.scales, -8.0)
            k.int4_rows[grid, block](w.q, w.scales, offs, np.float32(coef), half, x, y)
    elif s == "q8_0":
        group = GROUP_SIZE[s]
        if activations == "int8":  # x rounded to int8 per group, as idot.quantize_q8_into does
            xq, sx, xr = empty((L, n), np.int8), empty((L, n // group)), empty((L, n))
            k.quantize_groups[_threads(L * n // group)](x, group, xq, sx)
            k.rounded_groups[_threads(L * n)](xq, sx, group, xr)
            x = xr
        k.q8_rows[grid, block](w.q, w.scales, group, x, y)
    elif s == "f32":
        k.f32_rows[grid, block](w.q, w.q, 0, x, y)
    else:
        k.u16_rows[grid, block](w.q, _pow2(), int(s == "bf16"), x, y)
    if bias is not None:
        add_bias(y, bias)
    return y


def rms_norm(x, w, eps: float, out=None):
    """x [L, D] -> w * x / sqrt(mean(x^2) + eps), as ops.rms_norm."""
    y = empty(x.shape) if out is None else out
    k.rms_norm[x.shape[0], k.BLOCK](x, w, np.float32(eps), y)
    return y


def rope(x, col0: int, heads: int, dh: int, cos, sin, rot: int) -> None:
    """The `heads` heads of dh columns from col0 of x [L, width] (device), rotated in place
    on their first rot dims; cos/sin [L, rot] (device)."""
    k.rope[_threads(x.shape[0] * heads * (rot // 2))](x, col0, heads, dh, cos, sin, rot)


def head_norm(x, col0: int, heads: int, dh: int, w, eps: float) -> None:
    """In place, rms_norm(w) of each of `heads` heads of dh columns from col0 of x [L, width]
    (the q/k norms; one head of H * Dh for a norm over all heads)."""
    k.head_rms_norm[(heads, x.shape[0]), k.BLOCK](x, col0, dh, w, np.float32(eps))


def rope_copy(src, col0: int, heads: int, dh: int, cos, sin, rot: int, interleaved: bool, scale: float = 1.0,
              out=None):
    """[L, heads, rot]: the rotated (and scaled) rope dims of each head of dh columns from col0
    of src [L, width], out of place (MLA's q_rope and k_rope)."""
    L = src.shape[0]
    out = empty((L, heads, rot)) if out is None else out
    k.rope_copy[_threads(L * heads * (rot // 2))](src, col0, heads, dh, cos, sin, rot, bool(interleaved),
                                                  np.float32(scale), out)
    return out


def head_matmul(a, col0: int, da: int, w, scale: float = 1.0, out=None):
    """[L, H, N] = scale * per head h: (the K columns from col0 + h * da of a [L, width]) @ w[h],
    for w [H, K, N] float32 on the device."""
    L, (H, _, N) = a.shape[0], w.shape
    out = empty((L, H, N)) if out is None else out
    k.head_matmul[_threads(L * H * N)](a, col0, da, w, np.float32(scale), out)
    return out


def silu_mul(gu, n: int, out=None):
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n]."""
    out = empty((gu.shape[0], n)) if out is None else out
    k.silu_mul[_threads(gu.shape[0] * n)](gu, n, out)
    return out


def add_into(x, y) -> None:
    """x += y, both [L, D]."""
    k.add_into[_threads(x.shape[0] * x.shape[1])](x, y)


def zeros(shape, out=None):
    """A float32 device array of zeros (`out`, when given, is zeroed and returned)."""
    out = empty(shape) if out is None else out
    k.fill[_threads(out.shape[0] * out.shape[1])](out, np.float32(0.0))
    return out


def sigmoid_scale_rows(y, g) -> None:
    """y [L, n] *= sigmoid(g [L, 1]) row by row, in place (device)."""
    k.sigmoid_scale_rows[_threads(y.shape[0] * y.shape[1])](y, g)


def gather_rows(x, rows, out=None):
    """x[rows] for x [L, D] (device) and rows (device int64 [n]) -> [n, D]."""
    n = rows.shape[0]
    out = empty((n, x.shape[1])) if out is None else out
    k.gather_rows[_threads(n * x.shape[1])](x, rows, out)
    return out


def scatter_add_scaled(out, y, rows, scales) -> None:
    """out[rows[t]] += scales[t] * y[t]: y [n, D], rows (int64) and scales (float32) [n], device."""
    k.scatter_add_scaled[_threads(y.shape[0] * y.shape[1])](out, y, rows, scales)


def add_bias(y, b) -> None:
    k.add_bias[_threads(y.shape[0] * y.shape[1])](y, b)


def kv_store(cache, src, col0: int, pos0: int) -> None:
    """cache [KV, cap, Dh] at positions pos0.. <- columns col0.. of src [L, width] (head-major)."""
    KV, _, Dh = cache.shape
    k.kv_store[_threads(src.shape[0] * KV * Dh)](cache, src, col0, pos0)


def copy_positions(dst, src, n: int) -> None:
    """dst[:, :n] = src[:, :n] for KV caches [KV, cap, D] on the device."""
    if n:
        k.copy_positions[_threads(src.shape[0] * n * src.shape[2])](dst, src, n)


def attend(q, heads: int, kc, vc, pos0: int, scale: float, scores=None, out=None):
    """Causal GQA attention: q [L, >= heads * Dk] (device; head h in columns h * Dk..) at
    positions pos0.. over the cache kc [KV, cap, Dk], vc [KV, cap, Dv] (already holding those
    positions) -> [L, heads * Dv]. scores: a scratch [>= L, heads, >= pos0 + L]."""
    L = q.shape[0]
    if scores is None:
        scores = empty((L, heads, pos0 + L))
    if out is None:
        out = empty((L, heads * vc.shape[2]))
    k.attend[(heads, L), k.BLOCK](q, heads, kc, vc, pos0, np.float32(scale), scores, out)
    return out


def mla_attend(q_lat, q_rope, latent, k_rope, pos0: int, scores=None, out=None):
    """MLA's absorbed attention on the device: q_lat [L, H, r] (q_nope W_uk, scaled), q_rope
    [L, H, R] (scaled) at positions pos0.. over the latent cache latent [cap, r] and k_rope
    [cap, R] -> the latent-space outputs [L, H, r] (W_uv and o_proj follow)."""
    L, H, r = q_lat.shape
    if scores is None:
        scores = empty((L, H, pos0 + L))
    if out is None:
        out = empty((L, H, r))
    k.mla_attend[(H, L), k.BLOCK](q_lat, q_rope, latent, k_rope, pos0, scores, out)
    return out


def argmax(z) -> int:
    """np.argmax of a device vector [V] (NaN first, ties to the lowest id)."""
    out = empty(1, np.int64)
    sampling.argmax[1, k.BLOCK](z, out)
    return int(out.copy_to_host()[0])


def sample(z, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The token generate.sample picks from logits z [V] (device) for the uniform number u,
    with temperature > 0, top_k (0: off) and top_p in (0, 1]. Greedy (temperature 0) is
    argmax."""
    if temperature <= 0.0:
        return argmax(z)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    out = empty(1, np.int64)
    sampling.sample[1, k.BLOCK](z, z.view(np.int32), np.float32(temperature), int(top_k), float(top_p),
                         float(u), out)
    return int(out.copy_to_host()[0])


class Sampler:
    """Seeded sampling on the device: a xoroshiro128+ stream (numba.cuda.random) gives each
    token's uniform number. The same seed gives the same tokens on every run of the device
    path (numpy's generator, which the CPU path uses, gives other numbers)."""

    def __init__(self, seed: int):
        from numba.cuda.random import create_xoroshiro128p_states

        self.states = create_xoroshiro128p_states(1, seed=seed)
        self._u = empty(1, np.float64)

    def uniform(self) -> float:
        sampling.uniform[1, 1](self.states, self._u)
        return float(self._u.copy_to_host()[0])

    def __call__(self, z, temperature: float, top_k: int = 0, top_p: float = 1.0) -> int:
        if temperature <= 0.0:
            return argmax(z)
        return sample(z, temperature, top_k, top_p, self.uniform())


# --- host conveniences (tests, benchmarks) --------------------------------------------------


def matvec(t: QTensor, x: np.ndarray, activations: str = "f32") -> np.ndarray:
    """dequantize(t) @ x on the device: float32 [in] -> [out] (uploads t: tests and benches)."""
    return matmul(t, np.asarray(x, np.float32)[None, :], activations)[0]


def matmul(t: QTensor, x: np.ndarray, activations: str = "f32") -> np.ndarray:
    """x [L, in] @ dequantize(t).T on the device -> [L, out]."""
    return to_host(linear(upload(t), to_device(np.asarray(x, np.float32)), activations=activations))


__all__ = [
    "available", "require", "simulated", "device_name", "free_bytes", "DeviceMatrix", "upload", "upload_stacked", "upload_vector", "stream",
    "to_device", "to_host", "empty", "zeros", "linear", "rms_norm", "head_norm", "rope", "silu_mul", "add_into",
    "add_bias", "gather_rows", "scatter_add_scaled", "sigmoid_scale_rows", "rope_copy", "head_matmul", "kv_store", "copy_positions", "attend", "mla_attend", "argmax", "sample", "Sampler", "matvec", "matmul",
]
