"""`--activations int8` end to end on SmolLM2 (Q4_1): close to the exact path (KL, top-1),
batch rows equal solo decode bit for bit, and the exact path is untouched next to it."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.engine import Engine
from colibri.errors import ColibriError

TEXT = ("The quick brown fox jumps over the lazy dog. Python is a programming language that lets "
        "you work quickly and integrate systems more effectively. ") * 3


@pytest.fixture(scope="module")
def engines(smollm2_container):
    return {mode: Engine.load(smollm2_container, activations=mode, max_context=256) for mode in ("f32", "int8")}


def _log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_int8_is_close_to_exact_and_not_equal(engines):
    ids = engines["f32"].encode_prompt(TEXT, raw=True)
    lp = {m: _log_softmax(e.logits(ids)) for m, e in engines.items()}
    kl = (np.exp(lp["f32"]) * (lp["f32"] - lp["int8"])).sum(axis=-1)
    top1 = (lp["f32"].argmax(-1) == lp["int8"].argmax(-1)).mean()
    assert 0 < kl.mean() < 0.02 and top1 > 0.9, (kl.mean(), top1)


def test_decode_matches_prefill_rows_and_batches(engines):
    """Under int8 activations too, forward_rows gives each row the bits of decoding it alone."""
    model = engines["int8"].model
    tok = engines["int8"].encode_prompt(TEXT, raw=True)
    pa, pb, ta, tb = tok[:9], tok[20:25], tok[9:13], tok[25:29]

    def solo(prompt, tokens):
        cache = model.new_cache(32)
        model.forward(np.asarray(prompt), cache)
        return np.concatenate([model.forward(np.asarray([t]), cache) for t in tokens])

    def prefilled(prompt):
        cache = model.new_cache(32)
        model.forward(np.asarray(prompt), cache)
        return cache

    alone_a, alone_b = solo(pa, ta), solo(pb, tb)
    ca, cb = prefilled(pa), prefilled(pb)
    for s in range(4):
        rows = model.forward_rows([ta[s], tb[s]], [ca, cb])
        np.testing.assert_array_equal(rows[0], alone_a[s])
        np.testing.assert_array_equal(rows[1], alone_b[s])


def test_exact_engine_unchanged_beside_an_int8_one(engines, smollm2_container):
    prompt = "Name three colours."
    a = engines["f32"].generate(prompt, max_tokens=12, temperature=0)
    engines["int8"].generate(prompt, max_tokens=12, temperature=0)
    fresh = Engine.load(smollm2_container, max_context=256)
    assert fresh.generate(prompt, max_tokens=12, temperature=0).token_ids == a.token_ids


def test_bad_mode_is_refused(smollm2_container):
    with pytest.raises(ColibriError, match="activations must be one of f32, int8"):
        Engine.load(smollm2_container, activations="int4")
