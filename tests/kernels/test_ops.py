"""Fused decode-glue kernels (colibri.kernels.ops) against plain numpy references written the
way transformers computes them."""
import numpy as np
import pytest

from colibri.kernels import ops

rng = np.random.default_rng(0)


def close(a, b, rtol=2e-6):
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) <= rtol * max(1.0, np.max(np.abs(b))) * 10


@pytest.mark.parametrize("L,D", [(1, 1), (1, 576), (7, 64), (3, 4097)])
def test_rms_norm(L, D):
    x = rng.normal(size=(L, D)).astype(np.float32)
    w = rng.normal(size=D).astype(np.float32)
    var = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    ref = (w * (x / np.sqrt(var + 1e-5))).astype(np.float32)
    close(ops.rms_norm(x, w, np.float32(1e-5)), ref)


@pytest.mark.parametrize("L,H,Dh,rot", [(1, 1, 2, 2), (5, 3, 64, 64), (2, 4, 128, 64), (1, 9, 96, 32)])
def test_rope_matches_rotate_half(L, H, Dh, rot):
    x = rng.normal(size=(L, H, Dh)).astype(np.float32)
    freqs = rng.uniform(0, 10, size=(L, rot // 2)).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    r = x[..., :rot]
    rotated = np.concatenate([-r[..., rot // 2:], r[..., : rot // 2]], axis=-1)
    ref = x.copy()
    ref[..., :rot] = r * cos[:, None] + rotated * sin[:, None]
    out = x.copy()
    ops.rope(out, cos, sin, rot)
    close(out, ref)


@pytest.mark.parametrize("H,KV,Dk,Dv,n,cap", [(1, 1, 8, 8, 1, 4), (4, 2, 16, 16, 37, 64), (9, 3, 64, 64, 200, 256),
                                              (8, 8, 24, 16, 5, 5), (6, 2, 32, 32, 1000, 1024),
                                              (2, 1, 16, 16, 128, 128), (15, 5, 64, 64, 3001, 3072),
                                              # head sizes of each value path: 128 in registers, 48 through memory
                                              (8, 2, 128, 128, 300, 320), (4, 2, 48, 48, 100, 128)])
def test_attend_one(H, KV, Dk, Dv, n, cap):
    q = rng.normal(size=(H, Dk)).astype(np.float32)
    k = rng.normal(size=(KV, cap, Dk)).astype(np.float32)
    v = rng.normal(size=(KV, cap, Dv)).astype(np.float32)
    scale = np.float32(Dk ** -0.5)
    G = H // KV
    ref = np.empty((H, Dv), np.float64)
    for h in range(H):
        s = (k[h // G, :n].astype(np.float64) @ q[h]) * scale
        p = np.exp(s - s.max())
        ref[h] = (p / p.sum()) @ v[h // G, :n]
    close(ops.attend_one(q, k, v, n, scale), ref.reshape(-1).astype(np.float32), rtol=1e-5)


def test_attend_one_online_softmax_when_the_max_moves():
    """Decode attention keeps a running max per 16 keys: scores that rise along the context
    (every block raises the max, the sums already held are rescaled) and a sharp peak early on
    (no later block raises it) both give the full softmax's result."""
    H, KV, D, n = 4, 2, 64, 700
    q = rng.normal(size=(H, D)).astype(np.float32)
    v = rng.normal(size=(KV, n, D)).astype(np.float32)
    scale = np.float32(D ** -0.5)
    rising = np.linspace(0.1, 6.0, n, dtype=np.float32)[None, :, None] * rng.normal(size=(KV, n, D)).astype(np.float32)
    rising[:, :, :] += np.linspace(-4, 4, n, dtype=np.float32)[None, :, None] * np.sign(np.repeat(q[::2][:, None], n, 1))
    peak = rng.normal(size=(KV, n, D)).astype(np.float32)
    peak[:, 3] = 20 * np.sign(q[::2])
    for k in (rising, peak):
        k = np.ascontiguousarray(k, dtype=np.float32)
        ref = np.empty((H, D), np.float64)
        for h in range(H):
            s = (k[h // 2].astype(np.float64) @ q[h]) * scale
            p = np.exp(s - s.max())
            ref[h] = (p / p.sum()) @ v[h // 2]
        np.testing.assert_allclose(ops.attend_one(q, k, v, n, scale), ref.reshape(-1), rtol=1e-4, atol=1e-5)


def test_attend_one_same_bits_with_any_thread_count():
    """Chunks of keys are fixed and merged in order, so threads never change the result (and
    so never change a token)."""
    import numba

    q = rng.normal(size=(9, 64)).astype(np.float32)
    k = rng.normal(size=(3, 2048, 64)).astype(np.float32)
    v = rng.normal(size=(3, 2048, 64)).astype(np.float32)
    saved = numba.get_num_threads()
    try:
        outs = []
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            outs.append(ops.attend_one(q, k, v, 1999, np.float32(0.125)))
    finally:
        numba.set_num_threads(saved)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_attend_rows_is_attend_one_per_row_and_independent_of_the_others():
    """Several queries on their own caches (or one cache at several lengths: drafted tokens) in
    one call: each row equals attend_one's result to float32 rounding, and is the same bits as
    attending that row alone, whatever shares the call."""
    from numba.typed import List

    caches = [(rng.normal(size=(3, cap, 64)).astype(np.float32), rng.normal(size=(3, cap, 64)).astype(np.float32))
              for cap in (300, 64, 300)]
    caches.append(caches[0])  # a fourth row on the first row's cache, further along
    ends = np.array([290, 1, 130, 291], np.int64)
    q = rng.normal(size=(4, 9, 64)).astype(np.float32)
    scale = np.float32(0.125)
    kcs, vcs = List([k for k, _ in caches]), List([v for _, v in caches])
    rows = ops.attend_rows(q, kcs, vcs, ends, scale)
    for r, (k, v) in enumerate(caches):
        close(rows[r], ops.attend_one(q[r], k, v, int(ends[r]), scale), rtol=1e-5)
        alone = ops.attend_rows(q[r:r + 1], List([k]), List([v]), ends[r:r + 1], scale)
        assert np.array_equal(rows[r], alone[0])


@pytest.mark.parametrize("L,n", [(1, 1), (1, 1536), (6, 33)])
def test_silu_mul(L, n):
    gu = rng.normal(scale=3, size=(L, 2 * n)).astype(np.float32)
    g, u = gu[:, :n].astype(np.float64), gu[:, n:]
    close(ops.silu_mul(gu, n), (g / (1 + np.exp(-g)) * u).astype(np.float32))


def test_silu_gate_matches_silu_mul_and_extremes():
    g = np.concatenate([rng.normal(scale=3, size=997), [0.0, -100.0, 100.0, -1e30, 1e30]]).astype(np.float32)
    u = rng.normal(size=g.shape).astype(np.float32)
    with np.errstate(over="ignore"):
        ref = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u).astype(np.float32)
    out = ops.silu_gate(g, u)
    assert np.all(np.isfinite(out))
    close(out, ref)
    np.testing.assert_array_equal(out, ops.silu_mul(np.concatenate([g, u])[None], g.size)[0])


def test_expf_within_one_ulp():
    from numba import njit

    @njit
    def run(a):
        out = np.empty_like(a)
        for i in range(a.shape[0]):
            out[i] = ops.expf(a[i])
        return out

    x = np.linspace(-87, 88, 200_001).astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(run(x) - ref) / ulp) <= 1.0
    edge = run(np.array([-np.inf, -1e4, 1e4], np.float32))
    assert edge[0] == edge[1] and 0 <= edge[0] < 1e-37 and np.isfinite(edge[2])


def test_prompt_glue_split_over_threads_keeps_every_bit():
    """models/layers.py's rms_norm and silu_mul and models/rope.py's apply_rope split a prompt's rows over the
    threads (tasks.over_rows): the same bits as one call over all rows, at 1 and 2 threads."""
    import numba

    from colibri.kernels import tasks
    from colibri.models import layers as common
    from colibri.models.rope import apply_rope

    L = 3 * tasks.SPLIT_MIN_ROWS + 5
    x = rng.normal(size=(L, 96)).astype(np.float32)
    w = rng.normal(size=96).astype(np.float32)
    gu = rng.normal(scale=3, size=(L, 2 * 40)).astype(np.float32)
    q = rng.normal(size=(L, 3, 32)).astype(np.float32)
    emb = rng.uniform(0, 10, size=(L, 16)).astype(np.float32)
    cos, sin = np.cos(np.concatenate([emb, emb], -1)), np.sin(np.concatenate([emb, emb], -1))
    whole_rope = q.copy()
    ops.rope(whole_rope, cos, sin, 32)
    saved = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            assert np.array_equal(common.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, np.float32(1e-5)))
            assert np.array_equal(common.silu_mul(gu, 40), ops.silu_mul(gu, 40))
            assert np.array_equal(apply_rope(q, cos, sin, 32), whole_rope)
    finally:
        numba.set_num_threads(saved)


def test_over_rows_covers_every_row_once():
    from colibri.kernels.tasks import SPLIT_MIN_ROWS, over_rows

    for n, threads in ((0, 2), (5, 2), (SPLIT_MIN_ROWS, 2), (1001, 3), (1001, 1)):
        hits = np.zeros(n, np.int64)
        over_rows(lambda a, b: hits.__setitem__(slice(a, b), hits[a:b] + 1), n, threads)
        assert np.all(hits == 1)


def _softmax_topk_reference(logits, k, normalize):
    """The numpy form softmax_topk replaced: softmax in float64, a stable sort."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w, ids


@pytest.mark.parametrize("L,E,k", [(1, 128, 8), (5, 64, 8), (3, 8, 2), (2, 60, 4), (1, 4, 4)])
@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_topk_against_sorting(L, E, k, normalize):
    logits = (rng.normal(size=(L, E)) * 3).astype(np.float32)
    w, ids = ops.softmax_topk(logits, k, normalize)
    ref_w, ref_ids = _softmax_topk_reference(logits, k, normalize)
    assert w.dtype == np.float32 and ids.dtype == np.int64 and w.shape == ids.shape == (L, k)
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=0)


def test_softmax_topk_ties_take_the_lower_id_first():
    logits = np.array([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0]], np.float32)
    w, ids = ops.softmax_topk(logits, 4, False)
    assert ids.tolist() == [[1, 3, 4, 2]]
    assert w[0, 0] == w[0, 1] == w[0, 2] > w[0, 3]
    # A huge logit: the others underflow to zero probability and still come in id order.
    w, ids = ops.softmax_topk(np.array([[0.0, 200.0, 0.0, 0.0]], np.float32), 3, True)
    assert ids.tolist() == [[1, 0, 2]] and w.tolist() == [[1.0, 0.0, 0.0]]
