"""Checkpoint names -> the shared decoder's (docs/design.md section 5): the rules live as plain
data in colibri/model_types.py, which the converter applies and the family's sanitize reads."""
import subprocess
import sys

from colibri import models
from colibri.model_types import checkpoint_name


def test_mixtral_expert_names_map_onto_the_decoder():
    names = {f"model.layers.0.block_sparse_moe.experts.3.{p}.weight": p for p in ("w1", "w3", "w2")}
    names["model.layers.0.block_sparse_moe.gate.weight"] = "router"
    out = models.sanitize(models.family("mixtral"), names)
    assert out == {"model.layers.0.block_sparse_moe.experts.3.gate_proj.weight": "w1",
                   "model.layers.0.block_sparse_moe.experts.3.up_proj.weight": "w3",
                   "model.layers.0.block_sparse_moe.experts.3.down_proj.weight": "w2",
                   "model.layers.0.block_sparse_moe.gate.weight": "router"}


def test_families_without_rules_keep_their_names():
    name = "model.layers.0.mlp.experts.3.w1.weight"
    assert checkpoint_name("qwen3_moe", name) == name
    names = {name: 1}
    assert models.sanitize(models.family("qwen3_moe"), names) is names


def test_the_converter_imports_no_model_code():
    code = "import sys, colibri.io.convert; assert not [m for m in sys.modules if m.startswith('colibri.models')]"
    subprocess.run([sys.executable, "-c", code], check=True)
