"""The opt-in float16 KV cache (EngineConfig.kv_cache = "f16", --kv-cache f16): K and V rounded
to float16 as numpy rounds, decode attention over the rounded values exactly as over the same
values in float32, logits close to the exact cache's, batching and drafted rows still the same
bits as decoding alone, and the places it does not cover refusing it clearly."""
import numpy as np
import pytest
from numba import njit
from transformers import DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.convert import convert
from colibri.io.kv_store import load_kv, save_kv
from colibri.kernels import ops
from harness import check_rows_match_solo_decode, make_hf_model, prompts_for

rng = np.random.default_rng(5)


@njit(cache=True)
def _put_all(a, x):
    for t in range(x.shape[1]):
        for d in range(x.shape[2]):
            ops.kv_put(a, 0, t, d, x[0, t, d])


@njit(cache=True)
def _get_all(a, out):
    for t in range(a.shape[1]):
        for d in range(a.shape[2]):
            out[0, t, d] = ops.kv_get(a, 0, t, d)


def test_kernel_rounding_is_numpys():
    """Decode writes K/V through kv_put, prefill through numpy's astype: both must round alike
    (to nearest, ties to even), subnormals, overflow to inf and signed zeros included."""
    x = np.concatenate([rng.normal(scale=s, size=4000) for s in (1e-6, 1e-3, 1.0, 300.0, 3e4)]).astype(np.float32)
    ties = (np.arange(1, 600, dtype=np.float32) * np.float32(2.0 ** -11) + np.float32(1.0))  # halfway points
    x = np.concatenate([x, ties, [0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 2.9e-8]]).astype(np.float32)
    x = x.reshape(1, 1, -1)
    bits = np.zeros(x.shape, np.uint16)
    _put_all(bits, x)
    with np.errstate(over="ignore"):
        assert np.array_equal(bits, x.astype(np.float16).view(np.uint16))
    back = np.empty(x.shape, np.float32)
    _get_all(bits, back)
    assert np.array_equal(back, bits.view(np.float16).astype(np.float32))


@pytest.mark.parametrize("H,KV,D,n", [(9, 3, 64, 1000), (4, 2, 16, 37), (4, 2, 24, 300), (2, 1, 32, 16)])
def test_attention_over_a_half_cache_is_attention_over_its_values(H, KV, D, n):
    """The kernels widen float16 on load: the result is the float32 kernel's on the rounded
    values, bit for bit (the 16-key intrinsics and the scalar tail alike)."""
    q = rng.normal(size=(H, D)).astype(np.float32)
    k = rng.normal(size=(KV, n + 5, D)).astype(np.float16)
    v = rng.normal(size=(KV, n + 5, D)).astype(np.float16)
    scale = np.float32(D ** -0.5)
    want = ops.attend_one(q, k.astype(np.float32), v.astype(np.float32), n, scale)
    assert np.array_equal(ops.attend_one(q, k.view(np.uint16), v.view(np.uint16), n, scale), want)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv16")
    cfg = LlamaConfig(vocab_size=160, num_hidden_layers=2, max_position_embeddings=512, hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    hf = make_hf_model(LlamaForCausalLM, cfg, 13, tmp / "hf")
    return convert(hf, tmp / "c", bits=32, progress=False)


def test_half_cache_engine_is_close_to_the_exact_one(llama):
    exact, half = Engine.load(llama), Engine.load(llama, kv_cache="f16")
    cache = half.slots[0].cache
    assert cache.k[0].dtype == np.uint16 and cache.dtype == "f16"
    assert cache.bytes_per_token * 2 == exact.slots[0].cache.bytes_per_token
    for prompt in prompts_for(160, 3, lengths=(1, 9, 40)):
        want = exact.generate(prompt, max_tokens=12, stop_at_eos=False).token_ids
        got = half.generate(prompt, max_tokens=12, stop_at_eos=False)
        a, b = exact.logits(prompt + want), half.logits(prompt + want)
        assert np.max(np.abs(a - b)) < 1e-2 * np.max(np.abs(a))
        # K/V rounding moves logits by ~1e-3 here, far less than these tiny models' top-2 gaps
        assert got.token_ids == want
    # decoded tokens' K/V (rounded by the kernel) hold what a fresh prefill of the same tokens
    # holds (rounded by numpy), to one float16 step: the two compute K/V through different
    # matmuls, so the float32 values before rounding can differ in their last bits
    prompt = prompts_for(160, 4, lengths=(20,))[0]
    got = half.generate(prompt, max_tokens=6, stop_at_eos=False).token_ids
    c = half.slots[0].cache
    ids = prompt + got[:-1]
    fresh = half.model.new_cache(len(ids))
    half.model.forward(np.asarray(ids), fresh)
    for layer in range(len(c.k)):
        for mine, theirs in ((c.keys(layer, len(ids)), fresh.keys(layer, len(ids))),
                             (c.values(layer, len(ids)), fresh.values(layer, len(ids)))):
            assert np.all(np.abs(mine - theirs) <= 2.0 ** -10 * np.maximum(np.abs(theirs), 2.0 ** -14))


def test_half_cache_batches_and_drafts_keep_solo_bits(llama):
    """forward_rows (a batch of sequences, drafted positions) over half caches: each row the
    same bits as decoding it alone, as with the exact cache."""
    half = Engine.load(llama, kv_cache="f16")
    check_rows_match_solo_decode(half, prompts_for(160, 8, lengths=(17,))[0], prompts_for(160, 9, lengths=(4,))[0])


def test_saved_slot_from_another_cache_type_is_refused(llama, tmp_path):
    exact, half = Engine.load(llama), Engine.load(llama, kv_cache="f16")
    prompt = prompts_for(160, 5, lengths=(9,))[0]
    exact.generate(prompt, max_tokens=2, stop_at_eos=False)
    save_kv(tmp_path / "slot.npz", exact.slots[0].ids, exact.slots[0].cache, "m")
    with pytest.raises(ColibriError, match="another --kv-cache"):
        load_kv(tmp_path / "slot.npz", half.slots[0].cache, "m")
    assert load_kv(tmp_path / "slot.npz", Engine.load(llama).slots[0].cache, "m") == exact.slots[0].ids


def test_bad_kv_cache_value_and_uncovered_models_are_refused(llama, tmp_path):
    with pytest.raises(ColibriError, match="kv_cache must be one of f32, f16"):
        Engine.load(llama, kv_cache="f8")
    from test_deepseek_v3 import config

    hf = make_hf_model(DeepseekV3ForCausalLM, config("plain_q"), 3, tmp_path / "hf")
    mla = convert(hf, tmp_path / "c", bits=32, progress=False)
    with pytest.raises(ColibriError, match="--kv-cache f16 covers grouped-query attention"):
        Engine.load(mla, kv_cache="f16")
