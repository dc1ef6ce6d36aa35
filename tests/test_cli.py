"""The `colibri` command as a user runs it (real processes): answers, and one-line errors with a
non-zero exit, never a traceback, on bad input."""
import json
import os
import shutil
import subprocess
import sys

import pytest


def colibri(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "colibri.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    msg = " ".join(proc.stderr.split())  # Rich may wrap long lines
    assert msg.startswith("error:"), proc.stderr
    for n in needles:
        assert n in msg, proc.stderr


@pytest.fixture
def model_copy(smollm2_container, tmp_path):
    """A private copy of the SmolLM2 container that a test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(smollm2_container, dst)
    return dst


def test_run_answers(smollm2_container):
    p = colibri("run", "--model", smollm2_container, "What is the capital of France?", "--max-tokens", "24")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_run_default_model_converts_on_first_use(tmp_path):
    """No --model: the embedded SmolLM2 is converted into the cache directory, then reused."""
    env = {"COLIBRI_HOME": str(tmp_path / "home")}
    first = colibri("run", "What is the capital of France?", "-n", "24", env=env)
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout
    assert (tmp_path / "home" / "models").is_dir()
    second = colibri("run", "--raw", "The capital of France is", "-n", "4", env=env)
    assert second.returncode == 0, second.stderr
    assert "repacking" not in second.stderr  # reused, not converted again


def test_missing_model_directory(tmp_path):
    assert_clean_error(colibri("run", "--model", tmp_path / "nope", "hi"), "does not exist")


def test_directory_that_is_not_a_container(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert_clean_error(colibri("run", "--model", tmp_path, "hi"), "not a colibri model directory", "convert")


def test_corrupt_manifest(model_copy):
    (model_copy / "colibri.json").write_text("{ this is not json")
    assert_clean_error(colibri("run", "--model", model_copy, "hi"), "manifest")


def test_truncated_safetensors(model_copy):
    f = model_copy / "dense.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    assert_clean_error(colibri("run", "--model", model_copy, "hi"), "truncated")


def test_unknown_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "gpt_unicorn"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(colibri("run", "--model", model_copy, "hi"), "gpt_unicorn", "not supported")


def test_convert_unknown_model_type(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_unicorn"}))
    assert_clean_error(colibri("convert", src, tmp_path / "out"), "gpt_unicorn")


def test_convert_truncated_gguf(smollm2_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    assert_clean_error(colibri("convert", bad, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_convert_bad_bits(tmp_path):
    assert_clean_error(colibri("convert", tmp_path, tmp_path / "out", "--bits", "3"), "--bits")


def test_prompt_longer_than_context(smollm2_container):
    p = colibri("run", "--model", smollm2_container, "--max-context", "16", "word " * 40)
    assert_clean_error(p, "context")


def test_negative_max_tokens(smollm2_container):
    assert_clean_error(colibri("run", "--model", smollm2_container, "-n", "-3", "hi"), "max-tokens")


def test_chat_prompt_without_chat_template(model_copy):
    cfg_path = model_copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    assert_clean_error(colibri("run", "--model", model_copy, "hi"), "chat template")
    raw = colibri("run", "--model", model_copy, "--raw", "The capital of France is", "-n", "6")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.strip()
