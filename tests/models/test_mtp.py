"""MTP drafts (models/mtp.py, speculative.MTPDrafter) on tiny DeepSeek-V3 and GLM-4.5 checkpoints
with an MTP layer appended (as the real checkpoints ship it): the output is the same tokens as
plain decoding, greedy and sampled; the drafts are the MTP layer's own predictions; its cache
holds what a fresh run of the layer over the same rows computes."""

import numpy as np
import pytest
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.convert import convert
from colibri.speculative import MTPDrafter
from harness import add_mtp_layer, check_mtp_drafts_under_batching, make_hf_model, prompts_for

MODELS = {
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        vocab_size=150, max_position_embeddings=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "glm4_moe": (Glm4MoeForCausalLM, Glm4MoeConfig(
        vocab_size=140, max_position_embeddings=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
        n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
        use_qk_norm=True)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def engine(request, tmp_path_factory):
    cls, config = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(cls, config, 7, tmp / "hf")
    add_mtp_layer(hf)
    return Engine.load(convert(hf, tmp / "c", bits=4, progress=False))


def test_the_model_gets_its_mtp_layer_when_it_first_drafts(engine):
    fresh = Engine.load(engine.container.dir)
    assert fresh.model.has_mtp and "mtp" not in vars(fresh.model)  # not loaded with the model
    fresh.generate([1, 2, 3], max_tokens=3, speculative="mtp")
    assert "mtp" in vars(fresh.model)
    assert fresh.model.mtp.prefix == f"model.layers.{len(fresh.model.layers)}"


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, top_p=0.95, seed=4)], ids=["greedy", "sampled"])
def test_mtp_drafts_never_change_the_output(engine, kw):
    vocab = engine.vocab_size
    for prompt in prompts_for(vocab, 3, lengths=(1, 9)):
        plain = engine.generate(prompt, max_tokens=24, stop_at_eos=False, **kw)
        for k in (1, 3):
            drafted = engine.generate(prompt, max_tokens=24, stop_at_eos=False, speculative="mtp", draft_tokens=k, **kw)
            assert drafted.token_ids == plain.token_ids
            assert drafted.speculative["drafted"] > 0
        auto = engine.generate(prompt, max_tokens=24, stop_at_eos=False, speculative="auto", **kw)
        assert auto.token_ids == plain.token_ids


def test_mtp_drafts_under_batching_keep_every_stream_to_its_solo_tokens(engine):
    check_mtp_drafts_under_batching(engine.container.dir, engine.vocab_size)


def main_hidden(engine, tokens: list[int]) -> np.ndarray:
    """The main model's final hidden states at every position, one token at a time."""
    model = engine.model
    cache = model.new_cache(len(tokens) + 1)
    rows = []
    for t in tokens:
        model.forward_rows([t], [cache])
        rows.append(np.array(model.rows_hidden[0]))
    return np.stack(rows)


@pytest.mark.parametrize("oracle", [False, True], ids=["own-drafts", "oracle-drafts"])
def test_the_mtp_cache_and_drafts_are_the_layer_run_afresh(engine, monkeypatch, oracle):
    """Proposals feed the layer a few rows at a time and draft past them, then cut back: the rows
    the cache keeps equal one fresh run of the layer over the same positions, and each proposal's
    first draft is the argmax of that fresh run's last row. A random MTP layer's drafts are almost
    never taken; the oracle run swaps in the true continuation after each proposal, so drafts are
    accepted and the next proposal feeds several rows at once."""
    prompt = prompts_for(engine.vocab_size, 5, lengths=(6,))[0]
    truth = prompt + engine.generate(prompt, max_tokens=20, stop_at_eos=False).token_ids
    proposals, drafters = [], []
    propose, init = MTPDrafter.propose, MTPDrafter.__init__

    def record(self, committed, k):
        out = propose(self, committed, k)
        proposals.append((committed, out))
        return truth[committed + 1:committed + 1 + len(out)] if oracle else out

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        drafters.append(self)

    monkeypatch.setattr(MTPDrafter, "propose", record)
    monkeypatch.setattr(MTPDrafter, "__init__", keep)
    g = engine.generate(prompt, max_tokens=20, stop_at_eos=False, speculative="mtp", draft_tokens=2)
    (drafter,) = drafters
    seq = prompt + g.token_ids
    assert seq == truth
    if oracle:
        assert g.speculative["accepted"] > 5
    hidden = main_hidden(engine, seq)
    head = engine.model.mtp
    checked = 0
    for committed, drafts in proposals:
        if not drafts:
            continue
        rows = np.arange(drafter.start, committed)
        fresh = head.new_cache(64)
        logits, _ = head(hidden[rows], [seq[p + 1] for p in rows], rows, fresh, 0)
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 1e-3 * abs(top2[1]):  # a near tie may round either way
            assert drafts[0] == int(np.argmax(logits))
            checked += 1
    assert checked > 0
    n = drafter.next - drafter.start
    rows = np.arange(drafter.start, drafter.next)
    fresh = head.new_cache(64)
    head(hidden[rows], [seq[p + 1] for p in rows], rows, fresh, 0)
    assert drafter.cache.length == n
    np.testing.assert_allclose(drafter.cache.k[0][:, :n], fresh.k[0][:, :n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(drafter.cache.v[0][:, :n], fresh.v[0][:, :n], rtol=1e-4, atol=1e-5)


def test_mtp_on_a_model_without_the_layer_is_refused(smollm2_container):
    engine = Engine.load(smollm2_container)
    with pytest.raises(ColibriError, match="multi-token-prediction"):
        engine.generate("hi", max_tokens=2, speculative="mtp")
    assert engine.generate("hi", max_tokens=2, speculative="auto").token_ids  # auto: prompt lookup


def test_the_drafter_holds_only_the_hidden_states_it_has_not_fed(engine, monkeypatch):
    drafters = []
    init = MTPDrafter.__init__

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        drafters.append(self)

    monkeypatch.setattr(MTPDrafter, "__init__", keep)
    prompt = prompts_for(engine.vocab_size, 8, lengths=(5,))[0]
    engine.generate(prompt, max_tokens=60, stop_at_eos=False, speculative="mtp", draft_tokens=3)
    (d,) = drafters
    assert len(d.hidden) <= 3 + 1  # the last pass's rows, nothing older
    assert d.next - d.start > 40   # fed as it went
