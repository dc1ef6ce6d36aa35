"""qwen3_5_moe against transformers: the text model (Qwen3_5MoeForCausalLM, model_type
qwen3_5_moe_text) and the multimodal checkpoint as published (Qwen3_5MoeForConditionalGeneration:
its text_config and language model converted, the vision tower skipped, saying so)."""
import json

import pytest
from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                          Qwen3_5MoeTextConfig)

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from harness import check_against_transformers, make_hf_model, prompts_for

TEXT = {"vocab_size": 130, "hidden_size": 64, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 4, "max_position_embeddings": 512}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
CASES = {"text_model": TEXT}

MODEL = Qwen3_5MoeForCausalLM


def config(case: str) -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(**CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 71


def text_config() -> Qwen3_5MoeTextConfig:
    return config("text_model")


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen3_5_moe_matches_transformers(tmp_path, case, bits):
    # 90 tokens: longer than one chunk of the chunked delta rule (64)
    check_against_transformers(MODEL, config(case), tmp_path, case_seed(case), bits,
                               prompts_for(TEXT["vocab_size"], case_seed(case), (1, 5, 90)))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32])  # (--bits 4 of the same language model: the test above)
def test_multimodal_checkpoint_runs_its_language_model(tmp_path, capfd, bits):
    cfg = Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)
    check_against_transformers(Qwen3_5MoeForConditionalGeneration, cfg, tmp_path, 73, bits,
                               prompts_for(TEXT["vocab_size"], 73, (5, 23)))
    err = capfd.readouterr().err
    assert "qwen3_5_moe: skipping the vision tower (" in err and "colibri runs the language model only" in err
    c = Container(tmp_path / f"c{bits}")
    assert c.config["model_type"] == "qwen3_5_moe_text" and c.config["num_hidden_layers"] == 4
    assert c.has("model.layers.0.linear_attn.in_proj_qkv.weight") and c.has("model.norm.weight")
    assert not [n for n in c.dense.tensors if "visual" in n or "language_model" in n]


def test_unimplemented_config_fields_are_rejected(tmp_path):
    hf = make_hf_model(Qwen3_5MoeForCausalLM, text_config(), 3, tmp_path / "hf")
    assert {"model_type": "qwen3_5_moe_text"}.items() <= json.loads((hf / "config.json").read_text()).items()  # the alias
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    cfg_path = out / "config.json"
    for field, value, words in (("layer_types", ["linear_attention", "sliding_attention"] * 2, "layer_types"),
                                ("linear_num_value_heads", 3, "linear_num_value_heads"),
                                ("hidden_act", "gelu", "hidden_act")):
        cfg = json.loads(cfg_path.read_text())
        cfg[field] = value
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(ColibriError, match=words):
            Engine.load(out)
        cfg_path.write_text(json.dumps(dict(cfg, **{field: json.loads((hf / "config.json").read_text())[field]})))
