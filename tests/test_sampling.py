"""The sampler (colibri/generate.py): the distribution `candidates` keeps equals the numpy
reference's (temperature, full sort, top-k, top-p, min-p: transformers' order), draws follow it,
and a seed gives the same tokens."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.generate import SamplingParams, candidates, sample


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The straightforward version: a float64 softmax and a full stable sort of the vocabulary."""
    z = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < z.size:
        kth = np.sort(z)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = np.zeros(probs.size, bool)
        keep[order[cum - probs[order] < p.top_p]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


PARAMS = [SamplingParams(0.8, 0.95, 40), SamplingParams(0.8, 0.95, 0), SamplingParams(1.0, 1.0, 0),
          SamplingParams(0.6, 1.0, 0, min_p=0.05), SamplingParams(1.3, 0.5, 0), SamplingParams(0.8, 1.0, 7),
          SamplingParams(0.7, 0.999, 0), SamplingParams(1.0, 0.9, 100, min_p=0.02)]


@pytest.mark.parametrize("vocab", [50, 49152, 151936])
@pytest.mark.parametrize("scale", [1.0, 6.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("p", PARAMS, ids=str)
def test_candidates_are_the_reference_distribution(vocab, scale, p):
    z = (np.random.default_rng(vocab).standard_normal(vocab) * scale).astype(np.float32)
    ids, w = candidates(z, p)
    want = reference_probs(z, p)
    differ = set(ids.tolist()) ^ set(np.flatnonzero(want).tolist())
    if differ:  # only the nucleus' last token, where its cumulative mass ties top_p within rounding
        (t,) = differ
        full = reference_probs(z, SamplingParams(p.temperature, 1.0, p.top_k))
        before = full[full > full[t]].sum()
        assert abs(before - p.top_p) < 1e-6
        keep = np.isin(ids, np.flatnonzero(want))
        ids, w = ids[keep], w[keep]
        want = np.where(np.isin(np.arange(vocab), ids), want, 0.0)
        want /= want.sum()
    got = np.zeros(vocab)
    got[ids] = w / w.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def test_draws_follow_the_distribution_and_repeat_with_a_seed():
    z = np.random.default_rng(0).standard_normal(30).astype(np.float32) * 2
    p = SamplingParams(0.9, 0.9, 0)
    rng = np.random.default_rng(5)
    draws = np.array([sample(z, p, rng) for _ in range(20000)])
    freq = np.bincount(draws, minlength=30) / draws.size
    want = reference_probs(z, p)
    assert np.abs(freq - want).max() < 0.015 and not freq[want == 0].any()
    again = np.random.default_rng(5)
    assert [sample(z, p, again) for _ in range(200)] == draws[:200].tolist()


def test_ties_keep_the_lower_id_first():
    z = np.zeros(10, np.float32)
    z[[3, 7]] = 5.0
    ids, _ = candidates(z, SamplingParams(1.0, 0.5, 0))
    assert ids.tolist() == [3, 7]
    ids, _ = candidates(z, SamplingParams(1.0, 1.0, 1))
    assert ids.tolist() == [3]
