"""`colibri plan`: generated MoE containers of several sizes against fake machine descriptions.
Budgets add up, never exceed what is available minus headroom, name a bottleneck, and a dense
part that does not fit is a clear error. At frontier scale: DeepSeek-V3's config.json alone on
the named machines, synthetic slices projected to the full model, machine files and specs."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from colibri import ColibriError
from colibri.io.container import ContainerWriter
from colibri.io.safetensors_io import write_safetensors
from colibri.formats.qtensor import QTensor
from colibri.plan import (GPU, ExpertLayer, GiB, Machine, MiB, ModelFacts, Policy, analyze_model, build_plan,
                          check_fits, engine_options, named_machines, parse_machine_spec, plan_machines, probe_disk,
                          read_machine_file, read_machines)

SMALL_POLICY = Policy(ram_headroom_min_bytes=1 * MiB, vram_headroom_min_bytes=1 * MiB, runtime_bytes=1 * MiB)


def int4(rng, rows: int, cols: int) -> QTensor:
    """A random int4_g64 matrix (the bytes are noise; the planner only reads sizes)."""
    return QTensor("int4_g64", (rows, cols), rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                   rng.random((rows, cols // 64), dtype=np.float32))


def make_moe_container(path, layers=2, experts=4, hidden=64, inter=128, vocab=256, top_k=2, context=512):
    """A Mixtral-shaped container with random int4 experts."""
    rng = np.random.default_rng(0)
    w = ContainerWriter(path, bits=4, source="test")
    w.add_dense("model.embed_tokens.weight", int4(rng, vocab, hidden))
    w.add_dense("lm_head.weight", int4(rng, vocab, hidden))
    w.add_dense("model.norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w.add_dense(f"{p}.self_attn.{proj}.weight", int4(rng, hidden, hidden))
        w.add_dense(f"{p}.input_layernorm.weight", np.ones(hidden, np.float32))
        w.add_dense(f"{p}.post_attention_layernorm.weight", np.ones(hidden, np.float32))
        w.add_dense(f"{p}.block_sparse_moe.gate.weight", rng.random((experts, hidden), dtype=np.float32))
        w.add_expert_layer(f"{p}.block_sparse_moe", i, [
            {"gate_proj": int4(rng, inter, hidden), "up_proj": int4(rng, inter, hidden),
             "down_proj": int4(rng, hidden, inter)} for _ in range(experts)])
    config = {"model_type": "mixtral", "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": vocab, "num_local_experts": experts, "num_experts_per_tok": top_k,
              "max_position_embeddings": context}
    w.finish(config)
    return path


SIZES = {  # name -> (layers, experts, hidden, inter)
    "tiny": (2, 4, 64, 128),
    "medium": (4, 16, 128, 256),
    "large": (8, 32, 128, 512),
}


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return {name: make_moe_container(root / name, *shape) for name, shape in SIZES.items()}


def machine(ram_mib: float, gpus=(), disk_gbs=0.8, cores=2) -> Machine:
    return Machine(cores=cores, ram_total_bytes=int(ram_mib * MiB * 1.5), ram_available_bytes=int(ram_mib * MiB),
                   gpus=[GPU(f"fake GPU {i}", int(g * MiB), int(g * MiB)) for i, g in enumerate(gpus)],
                   disk_read_gbs=disk_gbs, disk_probe="fake", mem_read_gbs=15.0, source="test")


MACHINES = {
    "small-ram": machine(24),
    "mid-ram": machine(48),
    "big-ram": machine(512),
    "gpu": machine(48, gpus=[64]),
    "two-gpus": machine(32, gpus=[8, 16]),
}


def check_budgets(plan: dict, facts: ModelFacts, mach: Machine) -> None:
    t = plan["tiers"]
    ram, vram, disk = t["ram"], t["vram"], t["disk"]
    # RAM: the parts add up to the budget, and the budget stays under available minus headroom.
    assert ram["budget_bytes"] == ram["dense_bytes"] + ram["kv_bytes"] + ram["runtime_bytes"] + ram["expert_bytes"]
    assert ram["limit_bytes"] <= ram["available_bytes"] - ram["headroom_bytes"]
    assert ram["budget_bytes"] <= ram["limit_bytes"]
    # VRAM: the same, per the GPUs' free memory.
    assert vram["budget_bytes"] == vram["dense_bytes"] + vram["expert_bytes"]
    assert vram["budget_bytes"] <= vram["limit_bytes"] <= sum(g.free_bytes for g in mach.gpus)
    # Experts: every one is counted once over the tiers, at its real size.
    blob = facts.expert_layers[0].expert_bytes
    assert vram["experts"] + ram["experts"] + disk["experts_disk_only"] == facts.expert_count == disk["experts"]
    assert vram["expert_bytes"] == vram["experts"] * blob and ram["expert_bytes"] == ram["experts"] * blob
    slots = plan["cache_slots_per_layer"]
    per_layer = facts.expert_layers[0].num_experts
    assert slots["total"] <= per_layer + slots["vram"]
    assert vram["experts"] == min(slots["vram"], per_layer) * len(facts.expert_layers)
    assert (plan["dense_tier"] == "vram") == (vram["dense_bytes"] > 0)
    assert (ram["dense_bytes"] == facts.dense_bytes) != (plan["dense_tier"] == "vram")
    # Figures are in range and a bottleneck is named.
    lo, hi = plan["projection"]["hit_rate"]
    assert 0 <= lo <= hi <= 1
    tlo, thi = plan["projection"]["tok_s"]
    assert 0 <= tlo <= thi
    assert plan["bottleneck"] in ("disk", "memory", "compute") and plan["bottleneck_reason"]


def test_container_facts_come_from_headers(containers):
    layers, experts, hidden, inter = SIZES["medium"]
    facts = analyze_model(containers["medium"])
    assert facts.kind == "container" and facts.model_type == "mixtral" and facts.top_k == 2
    assert facts.expert_count == layers * experts and len(facts.expert_layers) == layers
    # one expert: three int4 matrices (nibbles + f32 scales per 64), padded to 4096 bytes
    raw = 3 * (inter * hidden // 2 + inter * hidden // 64 * 4)
    assert raw <= facts.expert_layers[0].expert_bytes < raw + 4096 + 3 * 64
    assert facts.expert_bytes == facts.expert_count * facts.expert_layers[0].expert_bytes
    assert facts.dense_bytes < facts.disk_bytes
    # untied embedding: a decode step reads one row of it, not the table
    assert facts.dense_bytes_per_token < facts.dense_bytes
    assert facts.kv_bytes_per_token == layers * 2 * (hidden // 4) * 2 * 4


@pytest.mark.parametrize("mname", list(MACHINES))
@pytest.mark.parametrize("size", list(SIZES))
def test_budgets_add_up_and_stay_under_available(containers, size, mname):
    facts = analyze_model(containers[size])
    mach = MACHINES[mname]
    plan = build_plan(facts, mach, policy=SMALL_POLICY)
    assert plan["version"] == 1
    if plan["fits"]:
        check_budgets(plan, facts, mach)


def test_more_memory_never_caches_fewer_experts(containers):
    facts = analyze_model(containers["large"])
    cached = [build_plan(facts, machine(mib), policy=SMALL_POLICY)["tiers"]["ram"]["experts"]
              for mib in (8, 12, 16, 24, 32, 64, 256)]
    assert cached == sorted(cached) and cached[0] < cached[-1] == facts.expert_count


def test_dense_part_that_does_not_fit_is_an_error(containers):
    facts = analyze_model(containers["large"])
    plan = build_plan(facts, machine(1.5), policy=SMALL_POLICY)
    assert not plan["fits"] and plan["bottleneck"] == "memory"
    errors = [w for w in plan["warnings"] if w["level"] == "error"]
    assert errors and "does not fit" in errors[0]["message"]
    assert plan["tiers"]["ram"]["experts"] == 0 and plan["engine_options"] == {}
    with pytest.raises(ColibriError, match="does not fit"):
        check_fits(plan)


def test_gpu_takes_dense_weights_then_experts(containers):
    facts = analyze_model(containers["medium"])
    plan = build_plan(facts, machine(16, gpus=[64]), policy=SMALL_POLICY)
    assert plan["dense_tier"] == "vram" and plan["tiers"]["vram"]["experts"] == facts.expert_count
    assert plan["tiers"]["ram"]["dense_bytes"] == 0 and plan["tiers"]["ram"]["experts"] == 0
    no_gpu = build_plan(facts, machine(16), policy=SMALL_POLICY)
    assert any("no GPU" in w["message"] for w in no_gpu["warnings"])
    # --auto-tier applies the VRAM tier's expert budget as --vram-gb (--device cuda's), sized from
    # the GPU's free memory; without a GPU there is none to apply.
    roomy = build_plan(facts, machine(4096, gpus=[64]), policy=SMALL_POLICY)
    vram = roomy["tiers"]["vram"]["expert_bytes"]
    assert roomy["fits"] and vram > 0
    assert roomy["engine_options"]["vram_gb"] == pytest.approx(vram / 2**30, abs=0.01)
    assert "vram_gb" not in build_plan(facts, machine(4096), policy=SMALL_POLICY)["engine_options"]
    assert any("--device cuda" in w["message"] for w in roomy["warnings"])


def olmoe_like(num_layers=16, experts=64, hidden=2048, inter=1024, top_k=8) -> ModelFacts:
    """OLMoE-1B-7B's shapes at int4 g64, without writing 4 GB of files."""
    blob = -(-3 * hidden * inter * 9 // 16 // 4096) * 4096
    dense = 2 * 50304 * hidden * 9 // 8 + num_layers * 4 * hidden * hidden * 9 // 16
    return ModelFacts("olmoe-like", "container", "olmoe", num_layers, dense, dense - 50304 * hidden * 9 // 8,
                      [ExpertLayer(f"model.layers.{i}.mlp", experts, blob) for i in range(num_layers)], top_k,
                      num_layers * 16 * 128 * 2 * 4, 4096, dense + num_layers * experts * blob)


def test_bottleneck_follows_the_machine():
    facts = olmoe_like()
    small = build_plan(facts, Machine(2, 4 * GiB, int(2.5 * GiB), [], 0.8, "fake", 15.0, "test"))
    big = build_plan(facts, Machine(2, 32 * GiB, 24 * GiB, [], 0.8, "fake", 15.0, "test"))
    for plan in (small, big):
        check_budgets(plan, facts, Machine(2, 0, 0))
    assert small["fits"] and small["bottleneck"] == "disk"
    assert small["tiers"]["disk"]["experts_disk_only"] > 0
    assert big["bottleneck"] in ("memory", "compute") and big["tiers"]["disk"]["experts_disk_only"] == 0
    assert big["projection"]["hit_rate"] == [1.0, 1.0]
    assert big["projection"]["tok_s"][0] > small["projection"]["tok_s"][1]
    # the disk-bound figure is the miss bytes over the disk rate (docs/design.md section 9)
    no_cache = build_plan(facts, Machine(2, 4 * GiB, int(2.5 * GiB), [], 0.8, "fake", 15.0, "test"),
                          ram_gb=facts.dense_bytes / GiB + 0.01)
    assert no_cache["tiers"]["ram"]["experts"] == 0
    assert 1.5 < no_cache["projection"]["tok_s"][1] < 2.1


def test_slow_disk_and_ram_gb_warnings():
    facts = olmoe_like()
    plan = build_plan(facts, Machine(2, 4 * GiB, 3 * GiB, [], 0.1, "fake", 15.0, "test"), ram_gb=100)
    messages = " ".join(w["message"] for w in plan["warnings"])
    assert "slow disk" in messages and "--ram-gb 100" in messages
    assert plan["tiers"]["ram"]["budget_bytes"] <= plan["tiers"]["ram"]["limit_bytes"]
    capped = build_plan(facts, Machine(2, 64 * GiB, 48 * GiB, [], 2.0, "fake", 15.0, "test"), ram_gb=2)
    ram = capped["tiers"]["ram"]
    assert ram["dense_bytes"] + ram["expert_bytes"] <= 2 * GiB
    assert capped["engine_options"]["ram_gb"] == pytest.approx(2, abs=0.01)


def _mixtral_checkpoint(d, hidden: int, inter: int, experts: int, head: bool, config: dict) -> None:
    """A one-layer Mixtral-named float32 checkpoint in d (head: also lm_head, the final norm and
    a q_proj, so `colibri convert` has a model to write)."""
    rng = np.random.default_rng(0)
    tensors = [("model.embed_tokens.weight", rng.random((256, hidden), dtype=np.float32))]
    if head:
        tensors += [("lm_head.weight", rng.random((256, hidden), dtype=np.float32)),
                    ("model.norm.weight", np.ones(hidden, np.float32)),
                    ("model.layers.0.self_attn.q_proj.weight", rng.random((hidden, hidden), dtype=np.float32))]
    tensors += [("model.layers.0.block_sparse_moe.gate.weight", rng.random((experts, hidden), dtype=np.float32)),
                ("model.layers.0.input_layernorm.weight", np.ones(hidden, np.float32))]
    for e in range(experts):
        for name, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            tensors.append((f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight",
                            rng.random(shape, dtype=np.float32)))
    write_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(config))


def test_hf_checkpoint_is_estimated_for_conversion(tmp_path):
    hidden, inter, experts = 64, 128, 4
    _mixtral_checkpoint(tmp_path, hidden, inter, experts, head=False,
                        config={"model_type": "mixtral", "num_hidden_layers": 1, "num_experts_per_tok": 2,
                                "hidden_size": hidden, "num_attention_heads": 4})
    facts = analyze_model(tmp_path)
    assert facts.kind == "hf" and facts.expert_count == experts and facts.top_k == 2
    assert facts.expert_layers[0].expert_bytes == 4096 * -(-(3 * inter * hidden * 9 // 16) // 4096)
    plan = build_plan(facts, machine(64), policy=SMALL_POLICY)
    assert any("convert" in w["message"] for w in plan["warnings"])


def test_machine_description_file(tmp_path):
    m = MACHINES["two-gpus"]
    f = tmp_path / "m.json"
    f.write_text(json.dumps(m.to_dict()))
    assert read_machine_file(f) == m
    f.write_text(json.dumps({**m.to_dict(), "ram_gigs": 3}))
    with pytest.raises(ColibriError, match="ram_gigs"):
        read_machine_file(f)


def test_disk_probe_reads_the_model(containers):
    facts = analyze_model(containers["large"])
    gbs, how = probe_disk(facts.probe_files, block=256 * 1024, max_bytes=8 * MiB, max_s=0.3)
    assert gbs and gbs > 0 and "reads" in how


def test_auto_tier_applies_the_plan_or_refuses(containers):
    from colibri.engine import EngineConfig

    opts = engine_options(containers["tiny"], None, True, quiet=True, machine=machine(4096))
    if "ram_gb" in EngineConfig.__dataclass_fields__:
        assert opts["ram_gb"] > 0
    else:
        assert opts == {}
    with pytest.raises(ColibriError, match="does not fit"):
        engine_options(containers["large"], None, True, quiet=True, machine=machine(1))
    assert engine_options(containers["tiny"], None, False, quiet=True) == {}


def colibri(*args):
    return subprocess.run([sys.executable, "-m", "colibri.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "120"})


def test_plan_command_json_and_table(containers, tmp_path):
    mfile = tmp_path / "machine.json"
    mfile.write_text(json.dumps(machine(4096).to_dict()))
    p = colibri("plan", "--model", containers["medium"], "--machine", mfile, "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["version"] == 1 and plan["fits"] and plan["model"]["expert_count"] == 64
    p = colibri("plan", "--model", containers["medium"], "--machine", mfile)
    assert p.returncode == 0, p.stderr
    assert "bottleneck" in p.stdout and "RAM" in p.stdout and "projected" in p.stdout


def test_plan_command_dense_does_not_fit(containers, tmp_path):
    mfile = tmp_path / "machine.json"
    mfile.write_text(json.dumps(machine(64).to_dict()))  # less than the default headroom + runtime
    p = colibri("plan", "--model", containers["tiny"], "--machine", mfile, "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert json.loads(p.stdout)["fits"] is False
    assert " ".join(p.stderr.split()).startswith("error: the dense part does not fit")


def test_plan_command_not_a_model(tmp_path):
    p = colibri("plan", "--model", tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "error:" in p.stderr and "colibri model directory" in " ".join(p.stderr.split())


def test_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    from colibri.plan import discover_gpus

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771, 140000'\necho 'NVIDIA L4, 23034, 22000'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert discover_gpus() == [GPU("NVIDIA H200", 143771 * MiB, 140000 * MiB), GPU("NVIDIA L4", 23034 * MiB, 22000 * MiB)]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert discover_gpus() == []


def test_plan_reserves_the_prefill_workspace_bounded_by_the_chunk():
    """A prompt's working memory is planned from the chunk size, not the prompt: it grows with the
    chunk, and with the context only for GLM-5's sparse indexer (its per-query token scores)."""
    from colibri.workspace import prefill_workspace_bytes

    llama = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
             "vocab_size": 49152}
    small, big = (prefill_workspace_bytes(llama, chunk, 8192, 2) for chunk in (128, 512))
    assert small < big < 64 * MiB
    assert prefill_workspace_bytes(llama, 512, 32768, 2) == big
    dsa = {"hidden_size": 6144, "moe_intermediate_size": 2048, "num_attention_heads": 64, "kv_lora_rank": 512,
           "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048,
           "vocab_size": 154880}
    assert prefill_workspace_bytes(dsa, 512, 32768, 2) > prefill_workspace_bytes(dsa, 512, 8192, 2)


def test_plan_suggests_the_float16_kv_cache_where_the_cache_rivals_the_weights(tmp_path, deepseek_v3_config):
    """GQA attention whose full-context cache is large next to the dense weights gets the
    `--kv-cache f16` hint; MLA (its latent cache stays float32) and a small cache do not."""
    transformers = pytest.importorskip("transformers")
    qwen = tmp_path / "qwen3"
    qwen.mkdir()
    # Qwen3-30B-A3B's shapes (transformers' defaults are a smaller model)
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=48, hidden_size=2048, head_dim=128, num_attention_heads=32,
                                      num_key_value_heads=4, moe_intermediate_size=768, num_experts=128,
                                      num_experts_per_tok=8, vocab_size=151936)
    (qwen / "config.json").write_text(json.dumps(cfg.to_dict()))
    desktop = read_machines("default")[0]

    def hinted(model_dir, **kw) -> bool:
        plan = build_plan(analyze_model(model_dir), desktop, **kw)
        return any("--kv-cache f16" in w["message"] for w in plan["warnings"])

    assert hinted(qwen)  # 8192 tokens: 1.6 GB of float32 K/V against ~1.3 GB of dense weights
    assert not hinted(qwen, max_context=512)
    assert not hinted(deepseek_v3_config)


# ----------------------------------------------------------------------------- frontier scale

DEFAULT_NAMES = ["desktop-64g", "workstation-128g-24gvram", "server-512g"]


@pytest.fixture(scope="module")
def deepseek_v3_config(tmp_path_factory):
    """DeepSeek-V3's config.json (transformers' DeepseekV3Config defaults are its shapes), no weights."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("deepseek-v3")
    (d / "config.json").write_text(json.dumps(transformers.DeepseekV3Config().to_dict()))
    return d


def test_deepseek_v3_config_alone_is_sized_for_int4(deepseek_v3_config):
    facts = analyze_model(deepseek_v3_config)
    assert facts.kind == "config" and facts.num_layers == 61 and facts.slice_layers == 0
    # first_k_dense_replace = 3: 58 MoE layers of 256 experts; one expert is three 2048x7168 int4 g64
    # matrices (4.5 bits per weight), a 4096-aligned blob
    assert len(facts.expert_layers) == 58 and {l.num_experts for l in facts.expert_layers} == {256}
    assert facts.expert_layers[0].expert_bytes == -(-3 * 2048 * 7168 * 9 // 16 // 4096) * 4096 == 24_772_608
    assert facts.top_k == 8
    # ~380 GB at int4: 368 GB of routed experts, ~11 GB resident (attention, 3 dense MLPs, shared experts,
    # q8_0 embedding and lm_head)
    assert 367e9 < facts.expert_bytes < 369e9 and 10e9 < facts.dense_bytes < 12e9
    assert 375e9 < facts.disk_bytes < 385e9
    assert facts.kv_bytes_per_token == 61 * (512 + 64) * 4  # MLA: the latent and the rope key, float32


def test_deepseek_v3_on_the_named_machines(deepseek_v3_config):
    facts = analyze_model(deepseek_v3_config)
    machines = read_machines("default")
    plans = plan_machines(facts, machines)
    assert list(plans) == DEFAULT_NAMES
    desktop, workstation, server = plans.values()
    for plan, mach in zip(plans.values(), machines):
        assert plan["fits"] and plan["model"]["layers"] == 61
        check_budgets(plan, facts, mach)
    # More RAM (and a faster disk, more cores) never projects fewer tok/s, at either end of the range.
    for end in (0, 1):
        assert desktop["projection"]["tok_s"][end] < workstation["projection"]["tok_s"][end] \
            < server["projection"]["tok_s"][end]
    # 512 GiB minus 12% headroom (450 GiB) holds all 14848 experts (343 GiB) and the dense part:
    # nothing is read from disk after warm-up, and the bound moves to compute.
    assert server["tiers"]["disk"]["experts_disk_only"] == 0 and server["projection"]["hit_rate"] == [1.0, 1.0]
    assert server["bottleneck"] == "compute"
    assert any("--activations int8" in w["message"] for w in server["warnings"])
    assert not any("--activations int8" in w["message"] for w in desktop["warnings"])
    # 64 GiB caches ~1 expert in 8 per layer: disk-bound, well under 1 tok/s.
    assert desktop["bottleneck"] == "disk" and desktop["projection"]["hit_rate"][0] < 0.2
    assert desktop["projection"]["tok_s"][1] < 1
    # The 24 GiB GPU takes the dense part and KV cache (~11 GiB) and some experts; RAM takes more.
    assert workstation["dense_tier"] == "vram" and workstation["tiers"]["ram"]["dense_bytes"] == 0
    assert 0 < workstation["cache_slots_per_layer"]["vram"] < workstation["cache_slots_per_layer"]["ram"] < 256


@pytest.mark.parametrize("gpu_gb", [None, 24])
def test_more_ram_never_projects_fewer_tok_s(deepseek_v3_config, gpu_gb):
    facts = analyze_model(deepseek_v3_config)
    gpu = f",vram_gb={gpu_gb}" if gpu_gb else ""
    plans = [build_plan(facts, parse_machine_spec(f"m{ram}:ram_gb={ram},disk_gbs=3,cores=16,mem_gbs=80{gpu}"))
             for ram in (16, 32, 64, 96, 128, 192, 256, 384, 512, 1024)]
    fitting = [p for p in plans if p["fits"]]
    assert len(fitting) >= 8  # 16 GiB (and without a GPU, 32) cannot hold the 10 GiB dense part with headroom
    for end in (0, 1):
        speeds = [p["projection"]["tok_s"][end] for p in fitting]
        assert speeds == sorted(speeds)
    cached = [p["tiers"]["ram"]["experts"] + p["tiers"]["vram"]["experts"] for p in fitting]
    assert cached == sorted(cached) and cached[-1] == facts.expert_count


def make_slice_container(path, held=3, full=10, experts=4, hidden=64, inter=128, moe_inter=128, vocab=256):
    """A DeepSeek-shaped slice: layer 0 dense (first_k_dense_replace = 1), the others MoE, the config
    recording the full layer count as tools/synthetic_moe.py --layers does. Returns the bytes of
    one MoE layer's resident tensors (attention, norms, router)."""
    rng = np.random.default_rng(0)
    w = ContainerWriter(path, bits=4, source="test")
    w.add_dense("model.embed_tokens.weight", int4(rng, vocab, hidden))
    w.add_dense("lm_head.weight", int4(rng, vocab, hidden))
    w.add_dense("model.norm.weight", np.ones(hidden, np.float32))
    moe_layer_bytes = 0
    for i in range(held):
        p = f"model.layers.{i}"
        tensors = {f"{p}.self_attn.{proj}.weight": int4(rng, hidden, hidden)
                   for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
        tensors[f"{p}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        if i == 0:
            tensors.update({f"{p}.mlp.gate_proj.weight": int4(rng, inter, hidden),
                            f"{p}.mlp.up_proj.weight": int4(rng, inter, hidden),
                            f"{p}.mlp.down_proj.weight": int4(rng, hidden, inter)})
        else:
            tensors[f"{p}.mlp.gate.weight"] = rng.random((experts, hidden), dtype=np.float32)
            w.add_expert_layer(f"{p}.mlp", i, [
                {"gate_proj": int4(rng, moe_inter, hidden), "up_proj": int4(rng, moe_inter, hidden),
                 "down_proj": int4(rng, hidden, moe_inter)} for _ in range(experts)])
            moe_layer_bytes = sum(t.nbytes if isinstance(t, np.ndarray) else t.q.nbytes + t.scales.nbytes
                                  for t in tensors.values())
        for name, t in tensors.items():
            w.add_dense(name, t)
    w.finish({"model_type": "deepseek_v3", "hidden_size": hidden, "intermediate_size": inter,
              "moe_intermediate_size": moe_inter, "num_hidden_layers": held, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "n_routed_experts": experts, "num_experts_per_tok": 2,
              "first_k_dense_replace": 1, "max_position_embeddings": 512,
              "colibri_synthetic": {"preset": "test", "seed": 0, "skew": 1.0, "layers_kept": held,
                                    "full_num_hidden_layers": full}})
    return moe_layer_bytes


def test_slice_is_projected_to_the_full_model(tmp_path):
    moe_layer_bytes = make_slice_container(tmp_path / "slice", held=3, full=10)
    held = analyze_model(tmp_path / "slice", project_slice=False)  # what the engine loads (--auto-tier)
    full = analyze_model(tmp_path / "slice")
    assert held.num_layers == 3 and held.slice_layers == 0 and len(held.expert_layers) == 2
    assert full.num_layers == 10 and full.slice_layers == 3
    # 1 dense layer + 9 MoE layers: the 7 MoE layers the slice lacks are shaped like its two
    blob = held.expert_layers[0].expert_bytes
    assert [l.prefix for l in full.expert_layers] == [f"model.layers.{i}.mlp" for i in range(1, 10)]
    assert full.expert_count == 9 * 4 and full.expert_bytes == 9 * 4 * blob
    assert full.dense_bytes == held.dense_bytes + 7 * moe_layer_bytes  # embeddings and lm_head once
    assert full.dense_bytes - full.dense_bytes_per_token == held.dense_bytes - held.dense_bytes_per_token
    assert full.kv_bytes_per_token == held.kv_bytes_per_token * 10 // 3 == 10 * 2 * 16 * 2 * 4
    assert full.disk_bytes == full.dense_bytes + full.expert_bytes > held.dense_bytes + held.expert_bytes
    plan = build_plan(full, machine(4096), policy=SMALL_POLICY)
    assert plan["model"]["layers"] == 10 and plan["model"]["slice_layers"] == 3 and plan["model"]["moe_layers"] == 9
    assert any("projected from a 3-layer slice" in w["message"] for w in plan["warnings"])
    check_budgets(plan, full, machine(4096))


def test_slice_without_a_moe_layer_cannot_be_projected(tmp_path):
    make_slice_container(tmp_path / "slice", held=1, full=10)
    with pytest.raises(ColibriError, match="without a MoE layer"):
        analyze_model(tmp_path / "slice")


def test_synthetic_slice_matches_the_full_config(tmp_path, monkeypatch):
    """tools/synthetic_moe.py --layers: the plan of a 4-layer DeepSeek-V3 slice (at 1/16 width) is the
    plan of the full 61-layer model estimated from its config.json."""
    import inspect

    synthetic_moe = pytest.importorskip("synthetic_moe")
    if "layers" not in inspect.signature(synthetic_moe.write_container).parameters:
        pytest.skip("tools/synthetic_moe.py has no --layers")
    monkeypatch.setattr(synthetic_moe, "smollm2_tokenizer_files", dict)  # the plan reads none
    synthetic_moe.write_container(tmp_path / "slice", "deepseek-v3", progress=False, layers=4, width_divisor=16,
                                  vocab=256)
    (tmp_path / "full").mkdir()
    full_config = synthetic_moe.build_config("deepseek-v3", None, width_divisor=16, vocab=256)
    (tmp_path / "full" / "config.json").write_text(json.dumps(full_config))
    sliced, estimated = analyze_model(tmp_path / "slice"), analyze_model(tmp_path / "full")
    assert sliced.slice_layers == 4 and sliced.num_layers == estimated.num_layers == 61
    for field in ("dense_bytes", "dense_bytes_per_token", "expert_bytes", "expert_count", "kv_bytes_per_token"):
        assert getattr(sliced, field) == getattr(estimated, field), field


def test_mlp_kinds_follow_the_families():
    """The planner's dense/MoE rule (shapes.mlp_kinds) is the one the model families apply."""
    from colibri.models import family
    from colibri.plan.shapes import mlp_kinds

    base = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "intermediate_size": 128}
    configs = [
        {**base, "model_type": "deepseek_v3", "num_hidden_layers": 6, "n_routed_experts": 8, "n_group": 1,
         "topk_group": 1, "first_k_dense_replace": 2},
        {**base, "model_type": "glm4_moe", "num_hidden_layers": 4, "n_routed_experts": 8, "n_group": 1,
         "topk_group": 1},  # first_k_dense_replace left out: glm4_moe's default (1)
        {**base, "model_type": "deepseek_v3", "num_hidden_layers": 4, "n_routed_experts": 8, "n_group": 1,
         "topk_group": 1, "mlp_layer_types": ["dense", "sparse"] * 2},
        {**base, "model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 8, "decoder_sparse_step": 2,
         "mlp_only_layers": [3]},
        {**base, "model_type": "mixtral", "num_hidden_layers": 3, "num_local_experts": 4},
    ]
    for config in configs:
        args = family(config["model_type"]).ModelArgs.from_dict(config)
        n = config["num_hidden_layers"]
        assert mlp_kinds(config, n) == [args.mlp_kind(i) for i in range(n)], config["model_type"]
    # a slice's mlp_layer_types covers the layers it holds: the layers past it route
    assert mlp_kinds({**configs[2], "mlp_layer_types": ["dense", "sparse"]}, 4) == ["dense", "moe", "moe", "moe"]


def test_hf_estimate_matches_the_converted_container(tmp_path):
    """The planner's estimate for a Hugging Face checkpoint (its own copy of the expert-name rule)
    is what `colibri convert --bits 4` writes."""
    from colibri.io.convert import convert

    hidden, inter, experts = 64, 128, 4
    hf = tmp_path / "hf"
    hf.mkdir()
    _mixtral_checkpoint(hf, hidden, inter, experts, head=True,
                        config={"model_type": "mixtral", "num_hidden_layers": 1, "hidden_size": hidden,
                                "intermediate_size": inter, "num_attention_heads": 4, "vocab_size": 256,
                                "num_local_experts": experts, "num_experts_per_tok": 2})
    estimated = analyze_model(hf)
    converted = analyze_model(convert(hf, tmp_path / "c", progress=False))
    assert estimated.kind == "hf" and converted.kind == "container"
    assert [(l.prefix, l.num_experts, l.expert_bytes) for l in estimated.expert_layers] == \
        [(l.prefix, l.num_experts, l.expert_bytes) for l in converted.expert_layers]
    assert estimated.dense_bytes == converted.dense_bytes
    assert estimated.dense_bytes_per_token == converted.dense_bytes_per_token


# ----------------------------------------------------------------------------- named machines

def test_default_machines():
    machines = {m.name: m for m in read_machines("default")}
    assert list(machines) == DEFAULT_NAMES
    desktop, workstation, server = (machines[n] for n in DEFAULT_NAMES)
    assert (desktop.ram_total_bytes, desktop.cores, desktop.disk_read_gbs, desktop.gpus) == (64 * GiB, 8, 2.0, [])
    assert (workstation.ram_total_bytes, workstation.cores, workstation.disk_read_gbs) == (128 * GiB, 16, 7.0)
    assert [g.total_bytes for g in workstation.gpus] == [24 * GiB]
    assert (server.ram_total_bytes, server.cores, server.disk_read_gbs, server.gpus) == (512 * GiB, 64, 7.0, [])
    assert [m.name for m in read_machines("default:server-512g,desktop-64g")] == ["server-512g", "desktop-64g"]


def test_machine_files_and_specs_agree(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text('[box]\nram_gb = 32\ndisk_gbs = 3.5\ncores = 12\nmem_gbs = 50\n'
                    'gpus = [{ name = "L4", vram_gb = 22 }, { vram_gb = 8, bandwidth_gbs = 300 }]\n')
    js = tmp_path / "m.json"
    js.write_text(json.dumps({"box": {"ram_gb": 32, "disk_gbs": 3.5, "cores": 12, "mem_gbs": 50,
                                      "gpus": [{"name": "L4", "vram_gb": 22}, {"vram_gb": 8, "bandwidth_gbs": 300}]}}))
    (from_toml,), (from_json,) = read_machines(str(toml)), read_machines(str(js))
    from_spec = parse_machine_spec("box:ram_gb=32,disk_gbs=3.5,cores=12,mem_gbs=50,vram_gb=22,vram_gb=8")
    for m in (from_toml, from_json, from_spec):
        assert (m.name, m.cores, m.ram_total_bytes, m.ram_available_bytes) == ("box", 12, 32 * GiB, 32 * GiB)
        assert (m.disk_read_gbs, m.mem_read_gbs) == (3.5, 50.0)
        assert [g.total_bytes for g in m.gpus] == [22 * GiB, 8 * GiB]
    assert from_toml.gpus[0].name == "L4" and from_toml.gpus[1].bandwidth_gbs == 300
    assert from_toml == dataclasses.replace(from_json, source=from_toml.source)  # the same machine either way
    assert [m.name for m in named_machines("default:desktop-64g", ["a:ram_gb=8,disk_gbs=1,cores=2"])] == \
        ["desktop-64g", "a"]


BAD_SOURCES = {  # file text (None: no file) -> the --machines argument's tail, and what the error says
    "unknown name": (None, "default:laptop", "no machine named 'laptop'"),
    "missing file": (None, "nowhere.toml", "no such file"),
    "malformed TOML": ("[box\nram_gb = 8\n", "", "cannot read the machine file"),
    "negative RAM": ("[box]\nram_gb = -8\ndisk_gbs = 1\ncores = 4\n", "", "ram_gb must be a positive number"),
    "zero disk": ("[box]\nram_gb = 8\ndisk_gbs = 0\ncores = 4\n", "", "disk_gbs must be a positive number"),
    "fractional cores": ("[box]\nram_gb = 8\ndisk_gbs = 1\ncores = 4.5\n", "", "cores must be a positive whole"),
    "text for a number": ("[box]\nram_gb = '8'\ndisk_gbs = 1\ncores = 4\n", "", "ram_gb must be a positive number"),
    "unknown field": ("[box]\nram_gb = 8\ndisk_gbs = 1\ncores = 4\nram = 3\n", "", "unknown field 'ram'"),
    "missing field": ("[box]\nram_gb = 8\ncores = 4\n", "", "missing disk_gbs"),
    "negative VRAM": ("[box]\nram_gb = 8\ndisk_gbs = 1\ncores = 4\ngpus = [{ vram_gb = -1 }]\n", "",
                      "vram_gb must be a positive number"),
    "not a table": ("box = 3\n", "", "expected a table"),
    "empty file": ("", "", "expected one table per machine"),
}
BAD_SPECS = {
    "no name": ("ram_gb=8,disk_gbs=1,cores=4", "expected NAME:"),
    "unknown key": ("x:ram=8,disk_gbs=1,cores=4", "'ram=8' is not one of"),
    "not a number": ("x:ram_gb=lots,disk_gbs=1,cores=4", "ram_gb='lots' is not a number"),
    "negative": ("x:ram_gb=-64,disk_gbs=2,cores=8", "ram_gb must be a positive number"),
    "twice": ("x:ram_gb=8,ram_gb=9,disk_gbs=1,cores=4", "ram_gb is given twice"),
    "missing": ("x:ram_gb=8,cores=4", "missing disk_gbs"),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_machine_file_is_a_clear_error(tmp_path, case):
    text, tail, message = BAD_SOURCES[case]
    source = tail
    if text is not None:
        (tmp_path / "m.toml").write_text(text)
        source = str(tmp_path / "m.toml") + tail
    with pytest.raises(ColibriError, match=re.escape(message)) as e:
        read_machines(source)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_machine_spec_is_a_clear_error(case):
    spec, message = BAD_SPECS[case]
    with pytest.raises(ColibriError, match=re.escape(message)):
        parse_machine_spec(spec)


def test_same_name_twice_and_bad_machine_json(tmp_path):
    with pytest.raises(ColibriError, match="two machines are named 'server-512g'"):
        named_machines("default", ["server-512g:ram_gb=8,disk_gbs=1,cores=2"])
    f = tmp_path / "m.json"
    f.write_text(json.dumps({**machine(64).to_dict(), "ram_available_bytes": -1}))
    with pytest.raises(ColibriError, match="ram_available_bytes must be a non-negative number"):
        read_machine_file(f)
    f.write_text("[1, 2]")
    with pytest.raises(ColibriError, match="expected an object"):
        read_machine_file(f)


def test_plan_command_compares_machines(deepseek_v3_config, tmp_path):
    here = tmp_path / "here.json"
    here.write_text(json.dumps(machine(4096).to_dict()))  # stands for this machine: no probe in tests
    args = ("plan", "-m", deepseek_v3_config, "--machine", here, "--machines", "default",
            "--machine-spec", "laptop:ram_gb=32,disk_gbs=3,cores=8,vram_gb=8")
    p = colibri(*args, "--json")
    assert p.returncode == 0, p.stderr
    plans = json.loads(p.stdout)
    assert list(plans) == ["this machine", *DEFAULT_NAMES, "laptop"]
    assert all(plan["version"] == 1 and plan["model"]["expert_count"] == 58 * 256 for plan in plans.values())
    assert plans["this machine"]["fits"] is False  # 4 GiB: a finding in a comparison, not an error
    p = colibri(*args)
    assert p.returncode == 0, p.stderr
    flat = " ".join(p.stdout.split())
    for word in ("this machine", *DEFAULT_NAMES, "laptop", "tok/s", "expert hit rate", "bound by",
                 "RAM slots/layer", "VRAM slots/layer", "KV cache", "does not fit", "config.json alone"):
        assert word in flat, word


def test_plan_command_slice_says_it_is_projected(tmp_path):
    make_slice_container(tmp_path / "slice", held=3, full=10)
    here = tmp_path / "here.json"
    here.write_text(json.dumps(machine(4096).to_dict()))
    p = colibri("plan", "-m", tmp_path / "slice", "--machine", here)
    assert p.returncode == 0, p.stderr
    assert "projected from a 3-layer slice" in " ".join(p.stdout.split())
    stored = colibri("plan", "-m", tmp_path / "slice", "--machine", here, "--as-stored", "--json")
    assert stored.returncode == 0, stored.stderr
    full = colibri("plan", "-m", tmp_path / "slice", "--machine", here, "--json")
    held, whole = json.loads(stored.stdout), json.loads(full.stdout)
    assert held["model"]["layers"] == 3 and whole["model"]["layers"] == 10


@pytest.mark.parametrize("args, message", [
    (("--machines", "default:laptop"), "no machine named 'laptop'"),
    (("--machine-spec", "x:ram_gb=-64,disk_gbs=2,cores=8"), "ram_gb must be a positive number"),
])
def test_plan_command_bad_machines_are_one_line(tmp_path, args, message):
    p = colibri("plan", "-m", tmp_path, *args)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().startswith("error:") and message in " ".join(p.stderr.split())
