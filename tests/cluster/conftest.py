"""Fixtures of the cluster tests: the models of cluster_models.py, written once per module."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools import synthetic_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from cluster_models import FAMILIES, HF_FAMILIES, HF_VOCAB  # noqa: E402
from harness import make_hf_model  # noqa: E402  (tests/models: tiny transformers checkpoints)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-models")
    return {p: synthetic_moe.write_container(root / p, p, progress=False, vocab=512, **opts)
            for p, opts in FAMILIES.items()}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from colibri.io.convert import convert

    root = tmp_path_factory.mktemp("cluster-hf-models")
    out = {}
    for i, (family, (model_cls, config_cls, config)) in enumerate(sorted(HF_FAMILIES.items())):
        cfg = getattr(transformers, config_cls)(**{"num_hidden_layers": 2, "vocab_size": HF_VOCAB,
                                                    "max_position_embeddings": 256, **config})
        hf = make_hf_model(getattr(transformers, model_cls), cfg, 90 + i, root / f"{family}-hf")
        out[family] = convert(hf, root / family, bits=4, progress=False)
    return out
