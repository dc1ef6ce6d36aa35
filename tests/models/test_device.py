"""--device cuda (colibri/models/device.py) against the CPU path on tiny random llama models:
the same greedy tokens and logits within float32 rounding, for f32 and int4 weights, with the
KV cache grown on the device and a follow-up turn reusing it.

Without a GPU this runs under numba's CUDA simulator in a fresh process (see
tests/kernels/test_cuda.py for why); the simulator runs each GPU thread as a Python thread, so
the models are tiny and the generations short.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda_simulator import rerun_under_simulator
from transformers import LlamaConfig, LlamaForCausalLM

from harness import make_hf_model

from colibri import ColibriError, Engine
from colibri.io.convert import convert
from colibri.kernels import cuda
from colibri.models.device import DeviceModel, place

ROOT = Path(__file__).resolve().parents[2]
on_device = pytest.mark.skipif(not cuda.available(), reason="no CUDA GPU and not under the simulator")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=True)
    return make_hf_model(LlamaForCausalLM, cfg, 21, d / "hf")


def test_under_the_simulator():
    if cuda.simulated():
        pytest.skip("this process is the simulator run")
    rerun_under_simulator(__file__, ROOT / "tests" / "models", timeout=900)


def test_cuda_without_a_gpu_is_one_clear_error_and_auto_is_the_cpu(tiny, tmp_path):
    if cuda.available():
        pytest.skip("a CUDA device (or the simulator) is present")
    out = convert(tiny, tmp_path / "c4", bits=4, progress=False)
    with pytest.raises(ColibriError, match="no CUDA GPU found|needs NVIDIA's numba-cuda"):
        Engine.load(out, device="cuda")
    assert not isinstance(Engine.load(out, device="auto").model, DeviceModel)
    with pytest.raises(ColibriError, match="--device must be one of cpu, cuda, auto"):
        Engine.load(out, device="gpu")


@pytest.mark.parametrize("device, message", [("cuda", "error: --device cuda"),
                                             ("gpu", "error: --device must be one of cpu, cuda, auto")])
def test_cli_device_errors_are_one_line(tiny, tmp_path, device, message):
    if cuda.available():
        pytest.skip("a CUDA device (or the simulator) is present")
    out = convert(tiny, tmp_path / "c4", bits=4, progress=False)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-m", "colibri.cli", "bench", "--model", str(out), "--device", device],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().startswith(message) and "Traceback" not in r.stderr


@on_device
@pytest.mark.parametrize("bits", [32, 4])
def test_device_decode_matches_the_cpu(tiny, tmp_path, bits):
    out = convert(tiny, tmp_path / f"c{bits}", bits=bits, progress=False)
    cpu = Engine.load(out, max_context=300)
    gpu = Engine.load(out, max_context=300, device="cuda")
    assert isinstance(gpu.model, DeviceModel) and not isinstance(cpu.model, DeviceModel)
    prompt = [3, 17, 42, 8, 77]
    want = cpu.generate(prompt, max_tokens=4, stop_at_eos=False).token_ids
    assert gpu.generate(prompt, max_tokens=4, stop_at_eos=False).token_ids == want
    # A follow-up turn: the device cache keeps the first turn and prefills only the new tokens.
    turn2 = prompt + want + [9]
    g2 = gpu.generate(turn2, max_tokens=2, stop_at_eos=False)
    assert g2.prompt_tokens_reused == len(turn2) - 2
    assert g2.token_ids == cpu.generate(turn2, max_tokens=2, stop_at_eos=False).token_ids
    ref = cpu.logits(prompt)
    np.testing.assert_allclose(gpu.logits(prompt), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@on_device
def test_device_cache_grows_and_keeps_what_it_holds(tiny, tmp_path):
    out = convert(tiny, tmp_path / "c4", bits=4, progress=False)
    cpu, gpu = Engine.load(out).model, Engine.load(out, device="cuda").model
    c_cpu, c_gpu = cpu.new_cache(600), gpu.new_cache(600)
    cpu.forward(np.array([5, 6, 7]), c_cpu)
    gpu.forward(np.array([5, 6, 7]), c_gpu)
    c_gpu.reserve(300)  # past the first 256 positions: the cache is copied into a larger one
    assert c_gpu.capacity == 512 and c_gpu.length == 3
    ref = cpu.forward(np.array([8]), c_cpu)
    np.testing.assert_allclose(gpu.forward(np.array([8]), c_gpu), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@on_device
def test_int8_activations_on_the_device_follow_the_cpu_int8_path(tiny, tmp_path):
    out = convert(tiny, tmp_path / "c4", bits=4, progress=False)
    cpu = Engine.load(out, activations="int8")
    gpu = Engine.load(out, activations="int8", device="cuda")
    ids = [4, 40, 61, 2, 19]
    ref = cpu.logits(ids)
    np.testing.assert_allclose(gpu.logits(ids), ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert not np.allclose(Engine.load(out).logits(ids), ref, rtol=0, atol=1e-6)  # int8 really ran


@on_device
def test_models_the_device_does_not_cover_are_refused(tiny, tmp_path):
    out = convert(tiny, tmp_path / "c4", bits=4, progress=False)
    model = Engine.load(out).model
    model.layers[1].mlp.gate_up = None  # as a model with unfused gate/up weights would have
    with pytest.raises(ColibriError, match="does not run feed-forward blocks other than"):
        place(model, "cuda")
