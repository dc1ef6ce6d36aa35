"""decode.token_layers, a token's layers in one compiled call run by a team of threads
(colibri.kernels.team), on the real SmolLM2: the per-layer blocks' bits whatever the thread
count, including a team whose iterations the runtime runs one after another. Every family's
tiny models check the same through harness.check_token_layers_match."""
import numpy as np
import pytest
from numba import get_num_threads, set_num_threads

from colibri.kernels import decode, idot
from harness import check_token_layers_match


@pytest.fixture(scope="module")
def smollm2(smollm2_container):
    from colibri import Engine

    return Engine.load(smollm2_container)


@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_whole_token_decode_gives_the_per_layer_bits_on_smollm2(smollm2, activations):
    """SmolLM2 (q4_1, 30 layers): one call for all layers equals the per-layer fused blocks bit
    for bit, logits and the K/V written, in both activation modes."""
    model = smollm2.model
    model.activations = activations
    try:
        prompt = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
        assert check_token_layers_match(smollm2, prompt, steps=5)
    finally:
        model.activations = "f32"


def test_whole_token_decode_survives_a_serialized_team_with_the_same_bits(smollm2):
    """token_layers called with a team of 2 on one pool thread (its iterations run one after
    the other) and a team of 3 on two: it returns, with the bits of a team of 1."""
    model = smollm2.model
    program = model._token_program()
    assert program is not None, "SmolLM2 is covered by the whole-token decode"
    layers, (eps, rot, h, kv, dh, scale, code, norm_eps, clip, n_inter), _ = program
    prompt = smollm2.tokenizer.encode("One two three four five")
    x = np.random.default_rng(0).standard_normal((1, model.args.hidden_size)).astype(np.float32)

    def step(nthreads, pool):
        cache = model.new_cache(64)
        model.forward(np.asarray(prompt), cache)
        cos, sin = model.rope.cos_sin(np.arange(cache.length, cache.length + 1))
        kcs, vcs = cache.typed_lists()
        saved = get_num_threads()
        set_num_threads(min(pool, saved))
        try:
            return decode.token_layers(x, layers, kcs, vcs, cache.length, np.ascontiguousarray(cos, np.float32),
                                       np.ascontiguousarray(sin, np.float32), rot, h, kv, dh, scale, eps, code,
                                       norm_eps, clip, n_inter, nthreads, idot.marker("f32"))
        finally:
            set_num_threads(saved)

    one = step(1, 1)
    for nthreads, pool in [(2, 1), (3, 2), (2, 2)]:
        assert np.array_equal(step(nthreads, pool), one), (nthreads, pool)


def test_a_first_starts_plans_are_what_the_decode_compiles(smollm2):
    """DecoderModel.token_plans (what colibri.warmup hands its compile process) names exactly
    the kernels and signatures a decode step runs: token_steps' calls, and token_layers' typed
    lists and team function, found without compiling anything."""
    import threading

    model = smollm2.model
    cache = model.new_cache(8)
    model.forward(np.array([0, 1]), cache)
    calls, program = model.token_plans(cache, get_num_threads())
    steps = {(k, tuple(k.typeof_pyval(a) for a in args)) for k, args in calls}
    assert {k.py_func.__name__ for k, _ in steps} == {"rms_norm_into", "rows_phase", "_prepare_row",
                                                     "_attention_phase", "_merge_chunks", "silu_mul_into"}
    assert [k.py_func.__name__ for k, _ in program] == ["unmanaged_layer_list", "add_unmanaged_layer",
                                                        "unmanaged_arrays", "unmanaged_arrays", "_token_buffers",
                                                        "_token_thread"]
    saved = model.program_wait
    try:
        for wait in (threading.Event(), None):  # token_steps, then token_layers
            model.program_wait = wait
            model.forward(np.array([2]), cache)
    finally:
        model.program_wait = saved
    for kernel, sig in [*steps, *program]:
        assert tuple(sig) in kernel.overloads, (kernel.py_func.__name__, sig)
