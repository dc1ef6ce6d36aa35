"""`colibri bench` as a user runs it: a JSON report with cold and warm figures that add up."""
import json
import os
import subprocess
import sys

from tools import synthetic_moe


def test_bench_json_report(tmp_path):
    model = synthetic_moe.write_container(tmp_path / "m", "tiny", progress=False)
    from colibri.io.container import Container

    c = Container(model)
    ram_gb = (c.dense_bytes + 2.5 * sum(l.blob_bytes for l in c.expert_layouts.values())) / 2**30
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "bench", "--model", str(model), "--ram-gb", str(ram_gb),
                        "--tokens", "6", "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLIBRI_HOME": str(tmp_path / "home")})
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["expert_store"] == "ExpertStore" and r["tokens"] == 6
    for state in ("cold", "warm"):
        row = r[state]
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["ttft_s"] > 0
        assert 0.0 <= row["hit_rate"] <= 1.0 and 0.0 <= row["disk_wait_share"] <= 1.0
        assert row["expert_gb_per_token"] >= 0
    assert r["cold"]["expert_gb_per_token"] > 0  # two slots per layer cannot hold the working set
    assert r["peak_rss_gb"] > 0


def test_bench_rejects_too_few_tokens(tmp_path):
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "bench", "--tokens", "1"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and "--tokens" in p.stderr and "Traceback" not in p.stderr


def test_bench_breakdown_and_projection_on_a_slice(tmp_path):
    """A 4-layer slice of DeepSeek-V3 (3 dense + 1 MoE, reduced width): the per-token phases add
    up to the measured time, attention and routed experts are both seen, and the whole 61-layer
    model is projected (and labelled as a projection), slower than the slice."""
    model = synthetic_moe.write_container(tmp_path / "ds", "deepseek-v3", progress=False, layers=4,
                                          width_divisor=16, vocab=512)
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "bench", "--model", str(model), "--tokens", "8",
                        "--prompt-tokens", "16", "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLIBRI_HOME": str(tmp_path / "home")})
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for state in ("cold", "warm"):
        bd = r[state]["breakdown"]
        phases = bd["per_token_s"]
        assert set(phases) == {"attention", "dense_mlp", "routing", "routed_experts", "disk_wait", "head", "other"}
        assert phases["attention"] > 0 and phases["routed_experts"] > 0 and phases["dense_mlp"] > 0
        assert abs(sum(phases.values()) - bd["total_s"]) < 1e-6 * max(1.0, bd["total_s"]) + 1e-9
        assert set(bd["per_layer_s"]) == {"attention", "dense_ffn", "moe_ffn"}
        proj = bd["projection"]
        assert proj["layers_measured"] == 4 and proj["layers_full"] == 61 and "projected" in proj["note"]
        assert proj["seconds_per_token"] > bd["total_s"]
        # each phase's weights over its time
        assert {"attention", "dense_mlp", "routed_experts", "head"} <= set(bd["gb_per_s"])
        assert all(v > 0 for v in bd["gb_per_s"].values())


def test_phase_bytes_count_every_matrix_once(tmp_path):
    """phase_bytes puts every matrix a token reads in one phase (norms and the embedding aside)
    and counts the top-k experts of each MoE layer."""
    from colibri.io.container import Container
    from colibri.profile import phase_bytes

    model = synthetic_moe.write_container(tmp_path / "ds", "deepseek-v3", progress=False, layers=4,
                                          width_divisor=16, vocab=512)
    c = Container(model)
    b = phase_bytes(c)
    matrices = [n for n in c.manifest["tensors"] if "norm" not in n and "embed_tokens" not in n]
    assert sum(b[p] for p in ("attention", "dense_mlp", "routing", "head")) == sum(map(c.tensor_bytes, matrices))
    assert b["head"] == c.tensor_bytes("lm_head.weight") > 0
    assert b["attention"] == sum(c.tensor_bytes(n) for n in matrices if ".self_attn." in n) > 0
    top_k = c.config["num_experts_per_tok"]
    assert b["routed_experts"] == top_k * sum(l.blob_bytes for l in c.expert_layouts.values()) > 0
