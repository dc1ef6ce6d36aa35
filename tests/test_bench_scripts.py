"""Every bench script run at a tiny size, as a user runs it (`python -m bench.<group>.<name>`),
so a script that stops running is seen here and not on the next benchmark day.

The scripts are found by glob: a new one is covered at once, by `--help` until it gets an entry
in SMOKE. Each entry says what the run covers here: a peer that is not installed (llama.cpp) is
left out, a GPU is replaced by numba's simulator, and so on. Figures are not checked, only that
the script runs to its end (and, where it writes one, that its --json report parses).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HELPERS = {"__init__.py", "common.py"}
SCRIPTS = sorted(p for p in (REPO / "bench").rglob("*.py") if p.name not in HELPERS)


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


# module -> (what the smoke run covers, args(ctx) -> argv after the module, slow?, extra env)
# ctx: a dict with "smol" (SmolLM2 container), "gguf", "tiny" (a synthetic OLMoE-shaped MoE
# container), "tmp" (this test's directory), "json" (a path the report is written to).
SMOKE: dict[str, tuple] = {
    # peers: colibri only (llama-cpp-python is not installed here; transformers is, and is slow)
    "bench.peers.decode_vs_peers": (
        "colibri only (--no-transformers, no --llama-python), 4 tokens",
        lambda c: ["--gguf", c["gguf"], "--container", c["smol"], "--no-transformers", "--tokens", "4",
                   "--prompt-words", "20", "--repeats", "1", "--json", c["json"]], False, {}),
    "bench.peers.moe_resident": (
        "colibri on the tiny MoE (no llama.cpp), 4 tokens",
        lambda c: ["--model", c["tiny"], "--engines", "colibri", "--tokens", "4", "--repeats", "1",
                   "--json", c["json"]], False, {}),
    "bench.peers.expert_streaming": (
        "colibri on the tiny MoE in a 1 GiB memory cgroup (no llama.cpp), 4 tokens",
        lambda c: ["--model", c["tiny"], "--limit-gb", "1", "--tokens", "4", "--json", c["json"]], False, {}),
    "bench.peers.perplexity_vs_peers": (
        "transformers fp32 and colibri, 160 tokens (no llama.cpp peer venv)",
        lambda c: ["--gguf", c["gguf"], "--tokens", "160", "--ctx", "64", "--stride", "32",
                   "--peer-python", "/nonexistent/python", "--json", c["json"]], True, {}),
    # kernels
    "bench.kernels.block_matvec": (
        "256x256, int4_g64, q4_k and q5_k, 1 MiB, f32 and int8",
        lambda c: ["--shapes", "256x256", "--schemes", "int4_g64,q4_k,q5_k", "--repeats", "1", "--mib", "1",
                   "--activations", "f32,int8"], False, {}),
    "bench.kernels.decode_attention": (
        "64-token context, 2 layers", lambda c: ["--contexts", "64", "--layers", "2", "--repeats", "1"], False, {}),
    "bench.kernels.delta_rule": (
        "4 heads of 32, 128 tokens, two decays",
        lambda c: ["--heads", "4", "--dim", "32", "--tokens", "128", "--decays", "0.1,10", "--repeats", "1",
                   "--json", c["json"]], False, {}),
    "bench.kernels.v4_attention": (
        "contexts 512 and 4096, 2 repeats", lambda c: ["--contexts", "512,4096", "--repeats", "2", "--json", c["json"]],
        False, {}),
    "bench.kernels.int4_tiles": (
        "one 1 MB matrix", lambda c: ["--shapes", "576:1", "--repeats", "1"], False, {}),
    "bench.kernels.idot_tiles": (
        "two 16-row q8_0 matrices, one round", lambda c: ["--shapes", "16x576,16x2048", "--scheme", "q8_0",
                                                          "--rounds", "1"], False, {}),
    "bench.kernels.kernels_quick": (
        "256x256, q4_1 only", lambda c: ["--n", "256", "--calls", "2", "--prefill", "4", "--schemes", "q4_1"],
        False, {}),
    "bench.kernels.moe_kernel": (
        "the tiny MoE, 1 layer", lambda c: ["--model", c["tiny"], "--layers", "1", "--calls", "2"], False, {}),
    "bench.kernels.prefill_gemm": ("4 rows", lambda c: ["--rows", "4", "--repeats", "1"], False, {}),
    "bench.kernels.row_stream": (
        "128 inputs, 1 MiB", lambda c: ["--shapes", "128", "--gib", "0.001", "--rows-per-call", "64"], False, {}),
    "bench.kernels.interleaved_layout": ("--smoke (2 matrices per shape)", lambda c: ["--smoke", "--repeats", "1"],
                                         True, {}),
    "bench.kernels.sampling": ("4 tokens", lambda c: ["--repeats", "1", "--tokens", "4", "--json", c["json"]],
                               False, {}),
    "bench.kernels.grammar_mask": (
        "llguidance only (xgrammar is not installed), 20 steps",
        lambda c: ["--engines", "llguidance", "--steps", "20", "--json", c["json"]], True, {}),
    # engine
    "bench.engine.decode_phases": (
        "the tiny MoE (layer by layer and the phase clock; SmolLM2's one-call path compiles for minutes), 4 tokens",
        lambda c: ["--model", c["tiny"], "--tokens", "4", "--rounds", "1", "--context", "8", "--json", c["json"]],
        False, {}),
    "bench.engine.threads": (
        "default setting, no competitor, 4 tokens",
        lambda c: ["--setting", "default", "--competitors", "0", "--repeats", "1", "--tokens", "4", "--max-s", "2",
                   "--quiet-wait", "0", "--json", c["json"]], False, {}),
    "bench.engine.speculative": (
        "the tiny MoE streamed (the random-ids prompt), 3 modes, 6 tokens",
        lambda c: ["--model", c["tiny"], "--ram-gb", "0.05", "--tokens", "6", "--repeats", "1", "--json", c["json"]],
        False, {}),
    "bench.engine.long_prompt": ("one 32-token prompt", lambda c: ["--lengths", "32", "--json", c["json"]], False, {}),
    "bench.engine.int8_fidelity": ("the tiny MoE, 4 tokens per prompt", lambda c: ["-m", c["tiny"], "--tokens", "4"],
                                   False, {}),
    "bench.engine.startup": (
        "the tiny MoE, one run each way, 2 tokens",
        lambda c: [c["tiny"], "--typing", "0", "--runs", "1", "--tokens", "2", "--settle", "0",
                   "--json", c["json"]], False, {}),
    "bench.engine.first_start": (
        "one first start from empty caches and one cached start of the default model, 2 tokens",
        lambda c: ["--tokens", "2", "--top", "3", "--json", c["json"]], True, {}),
    "bench.engine.grammar_decode": ("8 tokens", lambda c: ["--tokens", "8", "--json", c["json"]], False, {}),
    "bench.engine.serve_batching": (
        "colibri serve, 1 client, 8 tokens (no llama-server)",
        lambda c: ["--clients", "1", "--tokens", "8", "--rounds", "1", "--no-baseline", "--logs", c["tmp"],
                   "--json", c["json"]], True, {}),
    "bench.engine.mla_decode": (
        "a glm-5.3-flash slice at 1/16 width, 64 tokens (past its 8-token choice: the sparse rows)",
        lambda c: ["--shrink", "16", "--contexts", "64", "--repeats", "1", "--json", c["json"]], False, {}),
    "bench.engine.mla_kv": ("deepseek-v3 at 64 tokens", lambda c: ["--presets", "deepseek-v3", "--contexts", "64",
                                                                  "--json", c["json"]], False, {}),
    # io
    "bench.io.resident_load": ("the tiny MoE, one run each way", lambda c: [c["tiny"], "--runs", "1"], False, {}),
    "bench.io.fp8_convert": (
        "1 layer, 4 experts, width/32, no decode",
        lambda c: ["--layers", "2", "--experts", "4", "--vocab", "512", "--width-divisor", "32", "--no-tokenizer",
                   "--no-decode", "--workdir", c["tmp"], "--json", c["json"]], False, {}),
    "bench.io.checksums": (
        "hash speeds, and the tiny MoE streamed, 4 tokens",
        lambda c: ["--model", c["tiny"], "--ram-gb", "0.2", "--tokens", "4", "--repeats", "1", "--json", c["json"]],
        False, {}),
    "bench.io.gguf_layout_oracle": (
        "without llama.cpp (the script says there is nothing to compare against); with LLAMA_CPP_DIR set, "
        "qwen3moe against its convert_hf_to_gguf.py",
        lambda c: (["--llama-cpp", os.environ["LLAMA_CPP_DIR"], "--arch", "qwen3moe"] if os.environ.get("LLAMA_CPP_DIR")
                   else []) + ["--json", c["json"]], False, {}),
    # scale
    "bench.scale.cluster": (
        "a local Ray cluster, 1 worker, the tiny MoE",
        lambda c: ["--model", c["tiny"], "--workers", "1", "--tokens", "4", "--prompt-tokens", "8", "--rounds", "1",
                   "--budget-workers", "1", "--budget-tokens", "4", "--repeats", "2", "--greedy", "4",
                   "--json", c["json"]], True, {}),
    "bench.scale.cluster_nodes": (
        "network namespaces: head + 1 worker node, one delay, both wires; 2 nodes in 1 GiB cgroups",
        lambda c: ["--model", c["tiny"], "--workers", "1", "--tokens", "4", "--greedy", "4", "--delays", "0,0.5",
                   "--node-gb", "1", "--budget-workers", "1", "--json", c["json"]], True, {}),
    "bench.scale.gpu": (
        "--smoke --dry-run (CPU preparation; the CUDA simulator run is tests/gpu's)",
        lambda c: ["--smoke", "--dry-run", "--model", c["smol"], "--work", c["tmp"]], False, {}),
    "bench.membw": ("64 MiB", lambda c: ["--mib", "64", "--json", c["json"]], False, {}),
}


@pytest.fixture(scope="session")
def bench_models(smollm2_gguf, smollm2_container, tmp_path_factory):
    """A COLIBRI_HOME whose default model is the session's SmolLM2 container (no conversion per
    script), and a tiny synthetic MoE."""
    from tools import synthetic_moe

    root = tmp_path_factory.mktemp("bench_scripts")
    home = root / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "SmolLM2-135M-Instruct-Q4_1").symlink_to(Path(smollm2_container).resolve())
    tiny = synthetic_moe.write_container(root / "tiny", "tiny", progress=False)
    return {"home": str(home), "smol": str(smollm2_container), "gguf": str(smollm2_gguf), "tiny": str(tiny)}


def _params():
    for path in SCRIPTS:
        mod = module_of(path)
        slow = mod in SMOKE and SMOKE[mod][2]
        yield pytest.param(mod, id=mod, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("module", list(_params()))
def test_bench_script_smoke(module, bench_models, tmp_path):
    ctx = {**bench_models, "tmp": str(tmp_path), "json": str(tmp_path / "report.json")}
    if module in SMOKE:
        _, args, _, extra_env = SMOKE[module]
        argv = args(ctx)
    else:  # a script with no entry yet: at least it imports and parses its arguments
        argv, extra_env = ["--help"], {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLIBRI_HOME": bench_models["home"], "NUMBA_NUM_THREADS": "2", **extra_env}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    took = time.perf_counter() - t0
    assert p.returncode == 0, f"{module} {' '.join(argv)} failed ({took:.0f} s):\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    if "--json" in argv:
        report = json.loads(Path(ctx["json"]).read_text())
        assert report["script"] == module and report["machine"]["cores"] >= 1


def test_smoke_entries_name_real_scripts():
    """SMOKE names only scripts that exist (a script moved or renamed takes its entry along; one
    with no entry is run with --help above until it is given a tiny-size run)."""
    modules = {module_of(p) for p in SCRIPTS}
    assert set(SMOKE) <= modules, set(SMOKE) - modules


def test_common_helpers(tmp_path, capsys):
    import argparse

    from bench import common

    m = common.machine()
    assert m["cores"] >= 1 and m["isa"] and m["date"]
    assert common.isa(["avx2", "fma"]) == "AVX2"
    assert common.isa(["avx512f", "avx512_vnni", "avx2", "amx_tile"]) == "AVX-512 (VNNI), AMX"
    order = []
    runs = common.interleaved(["a", "b"], 3, lambda v: order.append(v) or (None if v == "b" and len(order) == 2
                                                                          else len(order)))
    assert order == ["a", "b"] * 3 and runs == {"a": [1, 3, 5], "b": [4, 6]}
    assert common.medians(runs) == {"a": 3, "b": 5.0}
    order.clear()
    common.interleaved("xyz", 3, order.append, alternate=True)
    assert "".join(order) == "xyzzyxxyz"
    assert common.median([{"x": 1}, {"x": 3}], "x") == 2 and common.median([]) != common.median([])  # nan
    ap = argparse.ArgumentParser()
    common.add_json_arg(ap)
    assert ap.parse_args([]).json is None and ap.parse_args(["--json"]).json == "-"
    a = ap.parse_args(["--json", str(tmp_path / "r.json")])
    common.write_json(a.json, {"x": 1}, script="bench.x", args=a)
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["script"] == "bench.x" and r["x"] == 1 and r["args"]["json"] == str(tmp_path / "r.json")
    env = common.child_env({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]
