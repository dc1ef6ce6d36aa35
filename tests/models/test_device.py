"""--device cuda (colibri/placement/cuda_model.py) against the CPU path on tiny random llama models:
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
from colibri.placement.cuda_model import DeviceModel, place

ROOT = Path(__file__).resolve().parents[2]
on_device = pytest.mark.skipif(not cuda.available(), reason="no CUDA GPU and not under the simulator")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=True)
    return make_hf_model(LlamaForCausalLM, cfg, 21, d / "hf")


@pytest.mark.slow  # the CUDA simulator run: ~3.5 min on 2 cores
def test_under_the_simulator():
    if cuda.simulated():
        pytest.skip("this process is the simulator run")
    rerun_under_simulator(__file__, ROOT / "tests" / "models", timeout=1800)


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


# --- MoE models: routed experts from the VRAM tier (colibri/placement/vram_experts.py) ----------------

MOE = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",  # per-head q/k norms
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, head_dim=16,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",  # q/k norms over all heads
              dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                   num_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",  # a gated shared expert, a dense layer, qkv bias
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",  # grouped sigmoid routing, shared expert, partial rotary
                 dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, head_dim=32,
                      num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, n_group=2, topk_group=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True, use_qk_norm=True, attention_bias=True)),
    # MLA: the compressed latent cache, absorbed attention; q_lora, interleaved yarn rope, shared expert
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                         qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=2, topk_group=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                         norm_topk_prob=True,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": 32, "mscale": 1.0,
                                          "mscale_all_dim": 0.8})),
    # MLA without q_lora (q_proj), half-split rope, attention biases
    "deepseek_v3_plain_q": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                            dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                                 num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
                                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                                 n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0,
                                 routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False,
                                 attention_bias=True)),
}
PROMPT = [3, 17, 42, 8, 77]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("tiny_moe")
    out = {}
    for i, (family, (model_cls, config_cls, config)) in enumerate(sorted(MOE.items())):
        cfg = getattr(transformers, config_cls)(vocab_size=96, num_hidden_layers=2, max_position_embeddings=256,
                                                **config)
        hf = make_hf_model(getattr(transformers, model_cls), cfg, 30 + i, root / f"{family}-hf")
        out[family] = convert(hf, root / family, bits=4, progress=False)
    return out


def _expert_gb(model, n: float) -> float:
    """The VRAM budget, in GiB, of n experts of the model."""
    from colibri.io.container import Container

    layouts = Container(model).expert_layouts.values()
    return n * max(l.blob_bytes for l in layouts) / 2**30


def _same_as_cpu(model, gpu, max_tokens=4):
    cpu = Engine.load(model, max_context=64)
    want = cpu.generate(PROMPT, max_tokens=max_tokens, stop_at_eos=False).token_ids
    assert gpu.generate(PROMPT, max_tokens=max_tokens, stop_at_eos=False).token_ids == want
    ref = cpu.logits(PROMPT)
    np.testing.assert_allclose(gpu.logits(PROMPT), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@on_device
@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_on_the_device_matches_the_cpu(moe_models, family):
    """Every expert fits the VRAM tier (the default budget, sized to the device): all pinned at
    start, every routed expert a VRAM hit, the CPU path's tokens."""
    gpu = Engine.load(moe_models[family], max_context=64, device="cuda")
    experts = sum(l.num_experts for l in gpu.container.expert_layouts.values())
    assert isinstance(gpu.model, DeviceModel) and gpu.model.vram.slots == experts
    _same_as_cpu(moe_models[family], gpu)
    s = gpu.expert_stats
    assert s["vram_hits"] > 0 and s["vram_misses"] == 0 and s["vram_hit_rate"] == 1.0


@on_device
@pytest.mark.parametrize("slots", [3, 0])
def test_vram_budget_never_changes_the_tokens(moe_models, slots):
    """A VRAM tier of 3 slots (an LRU over 16 experts: misses copied up from RAM and kept) or
    of none (each expert copied up for its use): the same tokens, the tiers' counts add up."""
    model = moe_models["qwen3_moe"]
    gpu = Engine.load(model, max_context=64, device="cuda", vram_gb=_expert_gb(model, slots + 0.5))
    assert gpu.model.vram.slots == slots
    _same_as_cpu(model, gpu)
    s = gpu.expert_stats
    assert s["vram_misses"] > 0 and (s["vram_hits"] > 0) == (slots > 0)
    assert s["hits"] == s["vram_misses"]  # every miss served by the RAM tier below
    assert gpu.model.vram.bytes_resident <= _expert_gb(model, slots + 0.5) * 2**30


@on_device
def test_mla_cache_on_the_device_grows_and_prefill_chunks_match(moe_models):
    """MLA on the device: a prompt prefilled in chunks, the latent cache grown past its first
    capacity, each step's logits the CPU path's within float32 rounding."""
    model = moe_models["deepseek_v3"]
    cpu, gpu = Engine.load(model).model, Engine.load(model, device="cuda").model
    c_cpu, c_gpu = cpu.new_cache(600), gpu.new_cache(600)
    assert c_gpu.bytes_per_token == c_cpu.bytes_per_token  # (kv_lora_rank + rope dims) per layer
    for chunk in ([5, 6, 7], [8, 9]):
        ref = cpu.forward(np.array(chunk), c_cpu, all_logits=True)
        np.testing.assert_allclose(gpu.forward(np.array(chunk), c_gpu, all_logits=True), ref, rtol=0,
                                   atol=2e-5 * np.abs(ref).max())
    c_gpu.reserve(300)
    assert c_gpu.capacity == 512 and c_gpu.length == 5
    ref = cpu.forward(np.array([10]), c_cpu)
    np.testing.assert_allclose(gpu.forward(np.array([10]), c_gpu), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@on_device
@pytest.mark.parametrize("family, gpu_layers", [("qwen3_moe", 1), ("deepseek_v3", 1), ("mixtral", 0)])
def test_layers_past_gpu_layers_run_on_the_cpu(moe_models, family, gpu_layers):
    """--gpu-layers N (a model whose dense weights do not all fit the GPU): the first N layers on
    the device, the rest and the head on the CPU with their KV cache in RAM; a follow-up turn
    reuses both caches. The CPU path's tokens."""
    model = moe_models[family]
    gpu = Engine.load(model, max_context=64, device="cuda", gpu_layers=gpu_layers)
    assert gpu.model.gpu_layers == gpu_layers and len(gpu.model.device_layers) == gpu_layers
    assert gpu.model.lm_head is None and gpu.model.new_cache(8).host is not None
    _same_as_cpu(model, gpu)
    cpu = Engine.load(model, max_context=64)
    turn2 = PROMPT + cpu.generate(PROMPT, max_tokens=3, stop_at_eos=False).token_ids + [9]
    gpu.generate(PROMPT, max_tokens=3, stop_at_eos=False)
    g2 = gpu.generate(turn2, max_tokens=2, stop_at_eos=False)
    assert g2.prompt_tokens_reused == len(turn2) - 2
    assert g2.token_ids == cpu.generate(turn2, max_tokens=2, stop_at_eos=False).token_ids


def test_layers_that_fit_counts_the_dense_weights_and_the_head(tiny, tmp_path):
    from colibri.placement.cuda_model import dense_bytes as _dense_bytes, layers_that_fit

    model = Engine.load(convert(tiny, tmp_path / "c4", bits=4, progress=False)).model
    per_layer = _dense_bytes(model.layers[0])
    assert per_layer == model.layers[0].attn.qkv.nbytes + model.layers[0].attn.o_proj.nbytes \
        + model.layers[0].mlp.gate_up.nbytes + model.layers[0].mlp.down.nbytes
    both = 2 * per_layer
    assert layers_that_fit(model, both + model.lm_head.nbytes) == 2
    assert layers_that_fit(model, both) == 1  # no room for the head: the last layer goes with it
    assert layers_that_fit(model, per_layer - 1) == 0
    with pytest.raises(ColibriError, match="--gpu-layers must be >= 0"):
        Engine.load(tmp_path / "c4", gpu_layers=-1)


@on_device
def test_vram_hot_set_follows_the_routing_history_and_streams_from_disk_below(moe_models, tmp_path):
    """With a routing history, the tier pins the hottest experts (half its slots) at start; with
    a RAM budget under the experts, misses come from the streaming store (disk reads) below.
    Tokens: the CPU path's."""
    import json
    import shutil

    from colibri.default_model import history_path
    from colibri.io.container import Container

    model = shutil.copytree(moe_models["mixtral"], tmp_path / "mixtral")
    c = Container(model)
    prefixes = list(c.expert_layouts)
    counts = {p: [0, 0, 0, 0] for p in prefixes}
    counts[prefixes[0]] = [5, 0, 9, 1]  # the two hottest: layer 0's experts 2 and 0
    history = history_path(model)
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text(json.dumps({"version": 1, "counts": counts}))
    try:
        ram_gb = (c.dense_bytes + c.expert_bytes / 4) / 2**30
        gpu = Engine.load(model, max_context=64, device="cuda", vram_gb=_expert_gb(model, 4.5), ram_gb=ram_gb,
                          stream_experts=True)
        assert gpu.model.vram.places(prefixes[0], 4)[:3] == ["pinned", None, "pinned"]
        _same_as_cpu(model, gpu)
        assert gpu.expert_stats["reads"] > 0  # the RAM tier read experts from disk for the VRAM tier
    finally:
        history.unlink(missing_ok=True)
