"""lm-evaluation-harness against `colibri serve`, compared with lm-eval's own `hf` backend running the
same SmolLM2 GGUF in transformers (dequantized to float32, CPU), on two small tasks read from local
files (tests/data/lm_eval: task YAMLs, JSONL data and a `custom_dataset` loader; no hub download):

  colibri_mc   30 questions x 4 choices, `multiple_choice` (120 loglikelihood requests; acc, acc_norm)
  colibri_ppl  6 short texts, `loglikelihood_rolling` (word/byte perplexity, bits per byte)

lm-eval's `local-completions` model POSTs /v1/completions with the prompt as token ids,
{"temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": true, "seed": 1234}, and reads
choices[0].logprobs.token_logprobs[ctxlen:-1] (and top_logprobs[ctxlen:-1] for is_greedy): the echoed
prompt's entries followed by exactly one entry for the generated token, which it drops. That entry
must exist also when the generated token is end-of-sequence (colibri's TokenEvent.end): without it,
lm-eval dropped the continuation's last token wherever the model's next token was EOS (found by this
test: 6 of 120 choices and 1 of 6 texts were off).

Needs `pip install lm-eval` (skipped without it)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = ["colibri_mc", "colibri_ppl"]
# Per request (one choice's continuation, or one whole text): colibri's numba kernels and torch sum
# in different orders over the same dequantized weights; measured at most ~6e-5 (a choice) and
# ~2e-4 (a ~25-token text).
LL_TOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing may try the network: no hub, no dataset downloads (constants read at import time too)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        import datasets.config
        import huggingface_hub.constants

        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR))


@pytest.fixture(scope="module")
def one_torch_thread():
    # Two torch threads on a shared two-core machine ran a batch ~10x slower than one.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def hf_lm(smollm2_gguf, smollm2_container, one_torch_thread):
    """lm-eval's HF backend: transformers loads the GGUF (`gguf_file=`, dequantized to float32); the
    tokenizer is the container's tokenizer.json, the very file the server tokenizes with."""
    from lm_eval.models.huggingface import HFLM

    gguf = Path(smollm2_gguf)
    return HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, tokenizer=str(smollm2_container),
                dtype="float32", device="cpu", batch_size=8)


def completions_lm(cls, server, container):
    # tokenizer: lm-eval needs one to split context from continuation tokens; the container directory
    # (tokenizer.json + tokenizer_config.json) loads with transformers.AutoTokenizer.
    return cls(model="smollm2", base_url=server.url + "/v1/completions", tokenizer=str(container),
               tokenizer_backend="huggingface", num_concurrent=1, max_retries=1, timeout=120)


@pytest.fixture(scope="module")
def colibri_lm(server, smollm2_container):
    """lm-eval's stock `local-completions` model pointed at the real server."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return completions_lm(LocalCompletionsAPI, server, smollm2_container)


def evaluate(lm, task_manager) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=task_manager, log_samples=True,
                                   bootstrap_iters=0, random_seed=0)


@pytest.fixture(scope="module")
def hf_results(hf_lm, task_manager):
    return evaluate(hf_lm, task_manager)


@pytest.fixture(scope="module")
def colibri_results(colibri_lm, task_manager):
    return evaluate(colibri_lm, task_manager)


def per_request(results: dict, task: str) -> dict[tuple[int, int], tuple]:
    """(doc_id, request index) -> the model's raw answer: (loglikelihood, is_greedy), or
    (loglikelihood,) for a rolling one."""
    out = {}
    for s in results["samples"][task]:
        for i, resp in enumerate(s["resps"]):
            out[s["doc_id"], i] = tuple(resp[0]) if isinstance(resp[0], (tuple, list)) else (resp[0],)
    return out


def differing(got: dict, ref: dict) -> dict:
    assert got.keys() == ref.keys()
    return {k: (got[k], ref[k]) for k in ref
            if not math.isclose(got[k][0], ref[k][0], abs_tol=LL_TOL) or got[k][1:] != ref[k][1:]}


def test_the_tasks_are_read_from_local_files(hf_results):
    assert hf_results["results"]["colibri_mc"]["sample_len"] == 30
    assert hf_results["results"]["colibri_ppl"]["sample_len"] == 6
    assert len(per_request(hf_results, "colibri_mc")) == 120
    assert hf_results["results"]["colibri_mc"]["acc,none"] > 0.25  # better than chance: the prompts make sense


@pytest.mark.parametrize("task", TASKS)
def test_local_completions_matches_hf_on_every_request(hf_results, colibri_results, task):
    """Every loglikelihood within LL_TOL of transformers', every is_greedy equal, so the metrics agree."""
    ref, got = per_request(hf_results, task), per_request(colibri_results, task)
    off = differing(got, ref)
    assert not off, f"{len(off)} of {len(ref)} requests differ (colibri, hf): {off}"
    for metric, value in hf_results["results"][task].items():
        if isinstance(value, float):
            assert colibri_results["results"][task][metric] == pytest.approx(value, rel=1e-4), metric


def test_the_end_token_that_stops_a_scoring_request_has_its_logprob(server, smollm2_container):
    """The request shape lm-eval sends, on a continuation after which the model's greedy token is EOS."""
    from colibri.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_container)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True)
    with server.client() as c:
        answer = c.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "temperature": 0,
                                                  "max_tokens": 32}).json()["choices"][0]
        assert answer["finish_reason"] == "stop"  # the model's own answer, after which it ends
        ids = tok.encode(prompt + answer["text"], add_special_tokens=False)
        r = c.post("/v1/completions", json={"model": "smollm2", "prompt": [ids], "temperature": 0, "max_tokens": 1,
                                             "logprobs": 1, "echo": True})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][-1] < 0
    assert lp["tokens"][-1] == "<|im_end|>" and choice["text"] == tok.decode(ids)


def test_lm_evals_remote_tokenizer_reads_the_servers(server, smollm2_container):
    """tokenizer_backend=remote (what `auto` picks when /tokenizer_info answers): no local tokenizer needed."""
    from lm_eval.utils import RemoteTokenizer

    from colibri.tokenizer import Tokenizer

    local = Tokenizer.from_dir(smollm2_container)
    remote = RemoteTokenizer(server.url + "/v1/completions", 30, True, None, None)
    text = "The capital of France is Paris."
    assert remote.encode(text) == local.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    assert remote.eos_token_id in local.eos_token_ids
    assert "<|im_start|>" in remote.apply_chat_template([{"role": "user", "content": "hi"}])
