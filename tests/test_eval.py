"""Quality measurement (colibri/eval.py, `colibri perplexity`): windows cover every token once,
scores equal the model's log-softmax, a run against its own reference has zero KL, and bad
input is a clear error."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from colibri import ColibriError, Engine
from colibri.eval import load_reference, save_reference, score_text, windows

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Python is a programming language that lets you "
        "work quickly and integrate systems more effectively. ") * 4


@pytest.fixture(scope="module")
def engine(smollm2_container) -> Engine:
    return Engine.load(smollm2_container, max_context=512)


@pytest.mark.parametrize("n, ctx, stride", [(10, 4, 2), (11, 4, 4), (100, 32, 7), (5, 8, 3), (2, 2, 1)])
def test_windows_score_every_token_once_within_ctx(n, ctx, stride):
    scored = []
    for begin, end, first in windows(n, ctx, stride):
        assert end - begin <= ctx and begin < first < end + 1 and first >= begin + 1
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_window_arguments_are_checked():
    for ctx, stride in [(1, 1), (8, 0), (8, 9)]:
        with pytest.raises(ColibriError):
            windows(100, ctx, stride)
    with pytest.raises(ColibriError, match="at least 2"):
        windows(1, 8, 4)


def _reference_nll(engine, ids, ctx, stride):
    """The same windows scored from Engine.logits, one full window at a time."""
    out = []
    for begin, end, first in windows(len(ids), ctx, stride):
        z = engine.logits(ids[begin:end]).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
        out += [z[t - 1 - begin, ids[t]] for t in range(first, end)]
    return np.array(out)


def test_scores_equal_the_models_log_softmax(engine):
    ids = engine.encode_prompt(TEXT, raw=True)
    engine.config.prefill_chunk, chunk = 24, engine.config.prefill_chunk  # windows span several chunks
    try:
        s = score_text(engine, ids, ctx=64, stride=24)
    finally:
        engine.config.prefill_chunk = chunk
    np.testing.assert_allclose(s.logprobs, _reference_nll(engine, ids, 64, 24), atol=1e-4)
    assert s.targets.tolist() == ids[1:]
    one = score_text(engine, ids, ctx=len(ids), stride=len(ids))  # a single window: Engine.score
    np.testing.assert_allclose(one.logprobs, [lp for lp, _ in engine.score(ids)], atol=1e-6)
    assert s.perplexity > 1.0 and s.summary()["tokens_scored"] == len(ids) - 1


def test_a_run_against_its_own_reference_has_no_divergence(engine, tmp_path):
    ids = engine.encode_prompt(TEXT, raw=True)
    ref = score_text(engine, ids, ctx=64, stride=32, keep_top=True)
    save_reference(tmp_path / "ref.npz", ref, ids, engine.model_id)
    loaded = load_reference(tmp_path / "ref.npz", ids, 64, 32)
    run = score_text(engine, ids, ctx=64, stride=32, reference=loaded)
    assert run.kl.max() < 1e-9 and run.agree.all()
    # a different window (less context) is a measurable divergence, not zero
    shorter = score_text(engine, ids, ctx=16, stride=16, reference=None)
    assert abs(shorter.perplexity - run.perplexity) > 1e-3
    with pytest.raises(ColibriError, match="--ctx 64 --stride 32"):
        load_reference(tmp_path / "ref.npz", ids, 64, 16)
    with pytest.raises(ColibriError, match="other tokens"):
        load_reference(tmp_path / "ref.npz", ids[:-1], 64, 32)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "colibri.cli", "perplexity", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_perplexity_command(smollm2_container, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    r = _cli(str(text), "-m", str(smollm2_container), "--ctx", "64", "--stride", "32", "--json",
             "--save-logits", str(tmp_path / "ref.npz"))
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["windows"] > 1 and first["perplexity"] > 1
    r = _cli(str(text), "-m", str(smollm2_container), "--ctx", "64", "--stride", "32", "--json",
             "--kl-divergence", str(tmp_path / "ref.npz"))
    second = json.loads(r.stdout)
    assert second["perplexity"] == pytest.approx(first["perplexity"], rel=1e-9) and second["kl_mean"] < 1e-9


@pytest.mark.parametrize("content, args, words", [
    (b"", [], "empty"),
    (b"\x00\x01binary", [], "binary"),
    (TEXT.encode(), ["--stride", "0"], "--stride"),
    (TEXT.encode(), ["--ctx", "64", "--stride", "65"], "--stride"),
    (TEXT.encode(), ["--ctx", "9000"], "trained for"),
])
def test_perplexity_command_refuses_bad_input(smollm2_container, tmp_path, content, args, words):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    r = _cli(str(f), "-m", str(smollm2_container), *args)
    assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr
