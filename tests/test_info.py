"""`colibri info`: what a container holds, from its manifest and headers."""
import json
import os
import subprocess
import sys

import pytest

from colibri import ColibriError
from colibri.info import describe, quant_summary
from test_plan import make_moe_container


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_moe_container(tmp_path_factory.mktemp("info") / "moe", layers=3, experts=8, hidden=64, inter=128,
                              vocab=256, top_k=2)


def test_moe_container(moe):
    info = describe(moe)
    expert_params = 3 * 128 * 64                        # gate, up, down of one expert
    dense = 2 * 256 * 64 + 64 + 3 * (4 * 64 * 64 + 2 * 64 + 8 * 64)
    assert info["model_type"] == "mixtral"
    assert info["params_dense"] == dense
    assert info["params_total"] == dense + 3 * 8 * expert_params
    assert info["params_active"] == dense + 3 * 2 * expert_params   # top-2 of 8 in each of 3 layers
    assert info["experts"] == {"moe_layers": 3, "per_layer": 8, "total": 24, "top_k": 2,
                               "expert_bytes": info["experts"]["expert_bytes"]}
    q = info["quantization"]
    assert q["routed experts"]["schemes"] == {"int4_g64": 3 * 8 * 3}
    assert q["router"]["schemes"] == {"f32": 3} and q["attention"]["schemes"] == {"int4_g64": 12}
    assert q["norms and biases"]["tensors"] == 7
    assert info["disk"]["expert_bytes"] == sum(os.path.getsize(moe / f"experts-{i:03d}.safetensors") for i in range(3))
    assert info["disk"]["total_bytes"] == sum(f.stat().st_size for f in moe.iterdir())
    assert info["chat_template"] is False and info["context_length"] == 512
    assert "int4_g64" in quant_summary(info)


def test_real_model(smollm2_container):
    info = describe(smollm2_container)
    assert info["model_type"] == "llama" and info["chat_template"] is True
    assert info["params_total"] == info["params_active"] == 134_515_008  # SmolLM2-135M
    assert info["experts"]["total"] == 0
    assert set(info["quantization"]) == {"dense MLP", "attention", "embedding", "norms and biases"}
    assert info["quantization"]["embedding"]["schemes"] == {"q8_0": 1}


def test_not_a_container(tmp_path):
    with pytest.raises(ColibriError, match="not a colibri model directory"):
        describe(tmp_path)


def colibri(*args):
    return subprocess.run([sys.executable, "-m", "colibri.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "120"})


def test_info_command(moe, tmp_path):
    p = colibri("info", "--model", moe, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["experts"]["total"] == 24
    p = colibri("info", "--model", moe)
    assert p.returncode == 0, p.stderr
    assert "routed experts" in p.stdout and "active per token" in p.stdout and "top-k 2" in p.stdout
    (tmp_path / "config.json").write_text("{}")
    p = colibri("info", "--model", tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert " ".join(p.stderr.split()).startswith("error:") and "convert" in p.stderr
