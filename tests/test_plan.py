"""`colibri plan`: generated MoE containers of several sizes against fake machine descriptions.
Budgets add up, never exceed what is available minus headroom, name a bottleneck, and a dense
part that does not fit is a clear error. (The issue's "projected tok/s within 2x of `bench`" check
waits for the bench command of issue 4.)"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri import ColibriError
from colibri.io.container import ContainerWriter
from colibri.io.safetensors_io import write_safetensors
from colibri.kernels.quant import QTensor
from colibri.plan import (GPU, ExpertLayer, GiB, Machine, MiB, ModelFacts, Policy, analyze_model, build_plan,
                          check_fits, engine_options, probe_disk, read_machine_file)

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
    # the disk-bound figure is the miss bytes over the disk rate (DESIGN.md section 9: ~1.6-2 tok/s with no hits)
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


def test_hf_checkpoint_is_estimated_for_conversion(tmp_path):
    rng = np.random.default_rng(0)
    hidden, inter, experts = 64, 128, 4
    tensors = [("model.embed_tokens.weight", rng.random((256, hidden), dtype=np.float32)),
               ("model.layers.0.block_sparse_moe.gate.weight", rng.random((experts, hidden), dtype=np.float32)),
               ("model.layers.0.input_layernorm.weight", np.ones(hidden, np.float32))]
    for e in range(experts):
        for name, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            tensors.append((f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight",
                            rng.random(shape, dtype=np.float32)))
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 1,
                                                      "num_experts_per_tok": 2, "hidden_size": hidden,
                                                      "num_attention_heads": 4}))
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
