"""The `colibri` command as a user runs it (real processes): answers, and one-line errors with a
non-zero exit, never a traceback, on bad input."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from requirements import missing


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


def test_installed_console_script_answers(smollm2_container):
    """The `colibri` entry point pip installed (not `python -m`): after `pip install .` then
    `pip install -e .` in one environment (README, .ci/run), a package directory left behind in
    site-packages used to shadow the editable install (No module named 'colibri.formats.qtensor')."""
    script = os.path.join(os.path.dirname(sys.executable), "colibri")
    if not os.path.exists(script):
        script = shutil.which("colibri")
    if script is None:
        missing("the colibri console script is not installed")
    p = subprocess.run([script, "run", "--model", str(smollm2_container), "-n", "8",
                        "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_model_option_takes_a_gguf_file(smollm2_gguf, tmp_path):
    """-m model.gguf: indexed once into the cache (the weights stay in the file), reused after, on
    every command with -m."""
    env = {"COLIBRI_HOME": str(tmp_path / "home")}
    first = colibri("run", "-m", smollm2_gguf, "-n", "24", "What is the capital of France?", env=env)
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout and "indexing" in first.stderr
    containers = list((tmp_path / "home" / "models" / "gguf").glob("*/*/colibri.json"))
    assert len(containers) == 1
    info = colibri("info", "-m", smollm2_gguf, "--json", env=env)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["model_type"] == "llama" and "indexing" not in info.stderr
    plan = colibri("plan", "-m", smollm2_gguf, "--json", env=env)
    assert plan.returncode == 0, plan.stderr
    assert list((tmp_path / "home" / "models" / "gguf").glob("*/*/colibri.json")) == containers  # reused


def test_model_option_rejects_other_files(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    for cmd in (["run", "-m", f, "hi"], ["info", "-m", f], ["plan", "-m", f], ["bench", "-m", f]):
        assert_clean_error(colibri(*cmd), "neither a directory nor a .gguf file", "-m takes a model directory")


@pytest.mark.parametrize("cmd", [["run", "hi"], ["bench"], ["serve"], ["chat"]])
def test_threads_must_be_positive(cmd):
    assert_clean_error(colibri(*cmd, "--threads", "0"), "--threads must be >= 1")
    assert_clean_error(colibri(*cmd, "--threads", "-2"), "--threads must be >= 1")


def test_more_threads_than_numba_runs_is_a_warning(smollm2_container):
    p = colibri("run", "--model", smollm2_container, "--threads", "4096", "--raw", "The capital of France is",
                "-n", "4")
    assert p.returncode == 0, p.stderr
    warning = [line for line in p.stderr.splitlines() if "--threads 4096" in line]
    assert len(warning) == 1 and warning[0].startswith("warning:") and "using" in warning[0]


def test_max_tokens_past_the_context_is_announced(smollm2_container):
    """The engine stops at the end of the context; -n asking for more gets a one-line note."""
    p = colibri("run", "--model", smollm2_container, "--max-context", "32", "-n", "1000000", "--raw",
                "Once upon a time")
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, p.stderr
    room = 32 - 4  # "Once upon a time" is 4 tokens for SmolLM2
    assert notes[0] == f"note: -n 1000000 is past the context (32 tokens): generating at most {room}"
    quiet = colibri("run", "--model", smollm2_container, "--max-context", "32", "-n", "8", "--raw", "Once upon a time")
    assert quiet.returncode == 0 and "note:" not in quiet.stderr


def write_tiny_llama(path):
    """A tiny random Llama checkpoint (config + safetensors, no tokenizer), written with numpy."""
    import numpy as np
    from safetensors.numpy import save_file

    d, f, v = 64, 128, 32
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=d, intermediate_size=f, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=v, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=True)))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    p = "model.layers.0."
    save_file({"model.embed_tokens.weight": w(v, d), "model.norm.weight": np.ones(d, np.float32),
               p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(d // 2, d),
               p + "self_attn.v_proj.weight": w(d // 2, d), p + "self_attn.o_proj.weight": w(d, d),
               p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
               p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": np.ones(d, np.float32),
               p + "post_attention_layernorm.weight": np.ones(d, np.float32)},
              str(path / "model.safetensors"))
    return path


def test_checkpoint_without_tokenizer(tmp_path):
    """Converting warns at once; running says what is missing and how to fix it (one line each)."""
    src = write_tiny_llama(tmp_path / "hf")
    dst = tmp_path / "out"
    conv = colibri("convert", src, dst)
    assert conv.returncode == 0, conv.stderr
    warning = [line for line in conv.stderr.splitlines() if line.startswith("warning:")]
    assert warning == [f"warning: no tokenizer.json in {src}: the container can only be driven with token ids; "
                       f"copy tokenizer.json/tokenizer_config.json into {dst} to chat with it"]
    assert_clean_error(colibri("run", "--model", dst, "hi"), "no tokenizer.json", "tokenizer_config.json")
    assert_clean_error(colibri("chat", "--model", dst), "no tokenizer.json")


def test_run_answers_while_resident_experts_load_with_the_same_tokens(tmp_path):
    """`run` starts its answer once the dense weights are in (the experts load on behind it);
    --wait-for-experts reads them all first. The answer is the same either way (an answer
    overtaking the readers: tests/io/test_integrity.py)."""
    from tools import synthetic_moe

    model = synthetic_moe.write_container(tmp_path / "m", "tiny", progress=False)
    args = ("run", "--model", model, "--raw", "--max-tokens", "6", "--ram-gb", "4", "once upon a time")
    behind, waited = colibri(*args), colibri(*args, "--wait-for-experts")
    assert behind.returncode == 0 and waited.returncode == 0, behind.stderr + waited.stderr
    assert behind.stdout == waited.stdout and behind.stdout.strip()
