"""MTP drafts for the Gated DeltaNet hybrids (models/mtp.py, QWEN3_NEXT; speculative.MTPDrafter) on
tiny Qwen3-Next and Qwen3.5 MoE checkpoints (the text model and the multimodal one) with the
top-level `mtp.` block appended as the real checkpoints ship it (random weights under the names
and shapes vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py load): convert keeps it past the decoder
layers; the output is the same tokens as plain decoding, past one chunk of the delta rule and
under batching; the drafts are made, checked, and are the layer's own predictions; its logits
are those of a plain numpy re-implementation of vLLM's layer."""
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file, save_file
from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                          Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.speculative import MTPDrafter
from harness import check_mtp_drafts_under_batching, make_hf_model, prompts_for

TEXT = dict(vocab_size=130, hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=4, max_position_embeddings=512)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# (model class, config, the config field that declares the MTP layers, the language model's prefix,
# whether the block's experts are stored stacked: Qwen3.5 checkpoints may ship them so)
MODELS = {
    "qwen3_next": (Qwen3NextForCausalLM,
                   lambda: Qwen3NextConfig(intermediate_size=128, linear_conv_kernel_dim=4, **TEXT),
                   "num_nextn_predict_layers", "model.", False),
    "qwen3_5_moe_text": (Qwen3_5MoeForCausalLM, lambda: Qwen3_5MoeTextConfig(**TEXT), "mtp_num_hidden_layers",
                         "model.", False),
    "qwen3_5_moe_multimodal": (Qwen3_5MoeForConditionalGeneration,
                               lambda: Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION),
                               "mtp_num_hidden_layers", "model.language_model.", True),
}
N = TEXT["num_hidden_layers"]  # the MTP layer's index in the container


def add_mtp_block(hf_dir: Path, count_field: str, language_model: str, stacked_experts: bool) -> None:
    """Append the `mtp.` block Qwen3-Next / Qwen3.5 checkpoints ship (transformers ignores it:
    `_keys_to_ignore_on_load_unexpected`): fc [D, 2D], pre_fc_norm_embedding,
    pre_fc_norm_hidden, norm and layers.0, a full-attention decoder layer with the MoE block,
    random weights in the shapes of the checkpoint's own full-attention layer (norms as offsets
    from 1, as the family stores them); and declare one MTP layer in the config."""
    path = str(hf_dir / "model.safetensors")
    state = load_file(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    template = f"{language_model}layers.{text['layer_types'].index('full_attention')}."
    g = torch.Generator().manual_seed(11)

    def draw(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=g) * 0.1

    block = {f"mtp.layers.0.{k[len(template):]}": draw(v) for k, v in state.items() if k.startswith(template)}
    if stacked_experts:  # [E, 2I, D] gate and up stacked, [E, D, I] down
        experts = "mtp.layers.0.mlp.experts"
        n = text["num_experts"]
        proj = {p: [block.pop(f"{experts}.{e}.{p}.weight") for e in range(n)]
                for p in ("gate_proj", "up_proj", "down_proj")}
        block[f"{experts}.gate_up_proj"] = torch.stack([torch.cat([gate, up]) for gate, up in
                                                        zip(proj["gate_proj"], proj["up_proj"])])
        block[f"{experts}.down_proj"] = torch.stack(proj["down_proj"])
    d = text["hidden_size"]
    block["mtp.fc.weight"] = torch.randn(d, 2 * d, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        block[f"mtp.{norm}.weight"] = torch.randn(d, generator=g) * 0.1
    state.update(block)
    save_file(state, path, metadata={"format": "pt"})
    text[count_field] = 1
    (hf_dir / "config.json").write_text(json.dumps(cfg))


class Case(NamedTuple):
    hf: Path         # the checkpoint, MTP block included
    engine: Engine   # its container at --bits 4


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, tmp_path_factory) -> Case:
    cls, config, count_field, language_model, stacked = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(cls, config(), 13, tmp / "hf")
    add_mtp_block(hf, count_field, language_model, stacked)
    return Case(hf, Engine.load(convert(hf, tmp / "c", bits=4, progress=False)))


def test_convert_keeps_the_block_as_the_layer_after_the_decoder_layers(case):
    c = Container(case.engine.container.dir)
    names = list(c.manifest["tensors"])
    assert not [n for n in names if n.startswith("mtp.") or "visual" in n]
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "self_attn.q_proj",
                 "input_layernorm", "mlp.gate", "mlp.shared_expert.down_proj"):
        assert c.has(f"model.layers.{N}.{name}.weight"), name
    layers = c.expert_layouts
    assert set(layers) == {f"model.layers.{i}.mlp" for i in range(N + 1)}
    assert len({layers[p].file for p in layers}) == N + 1  # the block's experts in a file of their own


def test_the_planner_sizes_the_block_as_the_container_holds_it(case):
    """colibri plan on the checkpoint counts the block's experts as the layer after the decoder
    layers, as convert writes them (not as decoder layer 0's)."""
    from colibri.plan.facts import analyze_model

    on_checkpoint, converted = analyze_model(case.hf), analyze_model(case.engine.container.dir)
    assert sorted((l.prefix, l.num_experts, l.expert_bytes) for l in on_checkpoint.expert_layers) == \
        sorted((l.prefix, l.num_experts, l.expert_bytes) for l in converted.expert_layers)
    assert on_checkpoint.dense_bytes == converted.dense_bytes


def test_the_model_gets_its_mtp_layer_when_it_first_drafts(case):
    fresh = Engine.load(case.engine.container.dir)
    assert fresh.model.has_mtp and "mtp" not in vars(fresh.model)  # not loaded with the model
    fresh.generate([1, 2, 3], max_tokens=3, speculative="mtp")
    assert "mtp" in vars(fresh.model)
    assert fresh.model.mtp.prefix == f"model.layers.{N}"


def test_mtp_drafts_never_change_the_output(case):
    engine = case.engine
    # 70 tokens: the prompt runs through the chunked delta rule (chunks of 64)
    for prompt in prompts_for(engine.vocab_size, 3, lengths=(1, 9, 70)):
        plain = engine.generate(prompt, max_tokens=24, stop_at_eos=False)
        for k in (1, 2, 3):
            drafted = engine.generate(prompt, max_tokens=24, stop_at_eos=False, speculative="mtp", draft_tokens=k)
            assert drafted.token_ids == plain.token_ids, f"prompt of {len(prompt)}, {k} drafts"
            assert drafted.speculative["drafted"] > 0


def test_mtp_drafts_under_batching_keep_every_stream_to_its_solo_tokens(case):
    check_mtp_drafts_under_batching(case.engine.container.dir, case.engine.vocab_size)


def main_hidden(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The main model's final hidden states (after its final norm) at the positions of `tokens`,
    as a generation computes them: `prompt` prefilled in one pass (the chunked delta rule, which
    rounds unlike one token at a time), then one token at a time."""
    model = engine.model
    cache = model.new_cache(len(prompt) + len(tokens) + 1)
    if prompt:
        model.forward(np.asarray(prompt), cache)
    rows = []
    for t in tokens:
        model.forward_rows([t], [cache])
        rows.append(np.array(model.rows_hidden[0]))
    return np.stack(rows)


def test_the_drafts_are_the_layer_run_afresh_and_its_cache_keeps_true_rows(case, monkeypatch):
    """The true continuation swapped in after each proposal (so drafts are accepted and several
    rows are fed at once): each proposal's first draft is the argmax of a fresh run of the layer
    over the rows since the drafter started, and the rows the cache keeps are that run's."""
    engine = case.engine
    prompt = prompts_for(engine.vocab_size, 5, lengths=(6,))[0]
    truth = prompt + engine.generate(prompt, max_tokens=20, stop_at_eos=False).token_ids
    proposals, drafters = [], []
    propose, init = MTPDrafter.propose, MTPDrafter.__init__

    def record(self, committed, k):
        out = propose(self, committed, k)
        proposals.append((committed, out))
        return truth[committed + 1:committed + 1 + len(out)]

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        drafters.append(self)

    monkeypatch.setattr(MTPDrafter, "propose", record)
    monkeypatch.setattr(MTPDrafter, "__init__", keep)
    g = engine.generate(prompt, max_tokens=20, stop_at_eos=False, speculative="mtp", draft_tokens=2)
    (drafter,) = drafters
    seq = prompt + g.token_ids
    assert seq == truth and g.speculative["accepted"] > 5
    # the drafter is handed no hidden state of a prompt position
    hidden = {len(prompt) + i: row for i, row in enumerate(main_hidden(engine, prompt, g.token_ids))}
    head = engine.model.mtp
    checked = 0
    for committed, drafts in proposals:
        if not drafts:
            continue
        rows = np.arange(drafter.start, committed)
        logits, _ = head(np.stack([hidden[p] for p in rows]), [seq[p + 1] for p in rows], rows,
                         head.new_cache(64), 0)
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 1e-3 * abs(top2[1]):  # a near tie may round either way
            assert drafts[0] == int(np.argmax(logits))
            checked += 1
    assert checked > 0
    n = drafter.next - drafter.start
    rows = np.arange(drafter.start, drafter.next)
    fresh = head.new_cache(64)
    head(np.stack([hidden[p] for p in rows]), [seq[p + 1] for p in rows], rows, fresh, 0)
    assert drafter.cache.length == n
    np.testing.assert_allclose(drafter.cache.k[0][:, :n], fresh.k[0][:, :n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(drafter.cache.v[0][:, :n], fresh.v[0][:, :n], rtol=1e-4, atol=1e-5)


def rms(x: np.ndarray, offset_weight: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Qwen3NextRMSNorm: x / rms(x) * (1 + w) (eps: the configs' rms_norm_eps)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + offset_weight)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_mtp_logits(t: dict, text: dict, hidden: np.ndarray, ids: list[int], positions: np.ndarray) -> np.ndarray:
    """vLLM's Qwen3NextMultiTokenPredictor (and Qwen3_5MultiTokenPredictor) over rows at
    `positions`, in float64 from the checkpoint's tensors `t`: fc over [embedding | hidden],
    each normed; a full-attention decoder layer (q with its output gate per head, q/k norms,
    partial neox rope, causal GQA; the routed experts and the gated shared expert); the final
    norm; the shared lm_head. Returns the last row's logits."""
    lm = "model.language_model." if "model.language_model.embed_tokens.weight" in t else "model."
    p = "mtp.layers.0."
    H, KV, Dh = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    e = t[f"{lm}embed_tokens.weight"][ids]
    x = np.concatenate([rms(e, t["mtp.pre_fc_norm_embedding.weight"]),
                        rms(hidden, t["mtp.pre_fc_norm_hidden.weight"])], axis=1) @ t["mtp.fc.weight"].T
    L = x.shape[0]
    a = rms(x, t[p + "input_layernorm.weight"])
    qg = (a @ t[p + "self_attn.q_proj.weight"].T).reshape(L, H, 2 * Dh)
    q, gate = rms(qg[..., :Dh], t[p + "self_attn.q_norm.weight"]), qg[..., Dh:].reshape(L, H * Dh)
    k = rms((a @ t[p + "self_attn.k_proj.weight"].T).reshape(L, KV, Dh), t[p + "self_attn.k_norm.weight"])
    v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(L, KV, Dh)
    rope = text["rope_parameters"]
    r = int(Dh * rope["partial_rotary_factor"])
    angles = positions[:, None] * (1.0 / rope["rope_theta"] ** (np.arange(0, r, 2) / r))[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, 1))[:, None], np.sin(np.concatenate([angles] * 2, 1))[:, None]

    def rotate(y):
        half = np.concatenate([-y[..., r // 2:r], y[..., :r // 2]], axis=-1)
        return np.concatenate([y[..., :r] * cos + half * sin, y[..., r:]], axis=-1)

    q, k = rotate(q), rotate(k)
    k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(Dh) + np.triu(np.full((L, L), -np.inf), 1)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    attn = np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), v).reshape(L, H * Dh)
    x = x + (attn / (1.0 + np.exp(-gate))) @ t[p + "self_attn.o_proj.weight"].T
    m = rms(x, t[p + "post_attention_layernorm.weight"])
    probs = np.exp(m @ t[p + "mlp.gate.weight"].T)
    probs /= probs.sum(-1, keepdims=True)
    moe = np.zeros_like(m)
    for row in range(L):
        top = np.argsort(-probs[row])[: text["num_experts_per_tok"]]
        for ex, weight in zip(top, probs[row, top] / probs[row, top].sum()):  # both families renormalize
            ep = f"{p}mlp.experts.{ex}."
            hid = silu(m[row] @ t[ep + "gate_proj.weight"].T) * (m[row] @ t[ep + "up_proj.weight"].T)
            moe[row] += weight * (hid @ t[ep + "down_proj.weight"].T)
    sp = p + "mlp.shared_expert."
    shared = (silu(m @ t[sp + "gate_proj.weight"].T) * (m @ t[sp + "up_proj.weight"].T)) @ t[sp + "down_proj.weight"].T
    x = x + moe + shared / (1.0 + np.exp(-(m @ t[p + "mlp.shared_expert_gate.weight"].T)))
    return (rms(x[-1:], t["mtp.norm.weight"]) @ t["lm_head.weight"].T)[0]


def test_the_layer_computes_vllms_multi_token_predictor(case, tmp_path):
    """At --bits 32, the MTP layer's logits for a row, over the rows before it, equal a numpy
    re-implementation of vLLM's layer from the checkpoint's tensors (stacked experts unstacked)."""
    engine = Engine.load(convert(case.hf, tmp_path / "c32", bits=32, progress=False))
    t = {k: v.astype(np.float64) for k, v in load_numpy(str(case.hf / "model.safetensors")).items()
         if not k.startswith("model.visual.")}
    stacked = t.pop("mtp.layers.0.mlp.experts.gate_up_proj", None)
    if stacked is not None:
        down = t.pop("mtp.layers.0.mlp.experts.down_proj")
        for ex in range(stacked.shape[0]):
            ep = f"mtp.layers.0.mlp.experts.{ex}."
            t[ep + "gate_proj.weight"], t[ep + "up_proj.weight"] = np.split(stacked[ex], 2)
            t[ep + "down_proj.weight"] = down[ex]
    cfg = json.loads((case.hf / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    seq = prompts_for(engine.vocab_size, 17, lengths=(9,))[0]
    hidden = main_hidden(engine, [], seq)
    positions = np.arange(len(seq) - 1)
    ids = seq[1:]
    head = engine.model.mtp
    logits, fed_back = head(hidden[positions], ids, positions, head.new_cache(16), 0)
    expected = reference_mtp_logits(t, text, hidden[positions].astype(np.float64), ids, positions)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # a further draft reads the output after the final norm (vLLM's proposer feeds the predictor's return back)
    np.testing.assert_allclose(fed_back[-1] @ t["lm_head.weight"].T, logits, rtol=1e-4, atol=1e-5)


def test_the_config_declares_the_layer(case):
    """No count in the config: one layer where the weights are there (vLLM's default; Qwen3-Next's
    config.json declares none); a count of 0: no MTP layer."""
    path = Path(case.engine.container.dir) / "config.json"
    original = path.read_text()
    cfg = json.loads(original)
    field = next(f for f in ("num_nextn_predict_layers", "mtp_num_hidden_layers") if f in cfg)
    for declared, has_mtp in (({k: v for k, v in cfg.items() if k != field}, True), (dict(cfg, **{field: 0}), False)):
        path.write_text(json.dumps(declared))
        try:
            assert Engine.load(path.parent).model.has_mtp is has_mtp
        finally:
            path.write_text(original)


def test_a_checkpoint_without_the_block_converts_as_before_and_refuses_mtp(tmp_path):
    hf = make_hf_model(Qwen3NextForCausalLM, MODELS["qwen3_next"][1](), 13, tmp_path / "hf")
    engine = Engine.load(convert(hf, tmp_path / "c", bits=4, progress=False))
    assert not [n for n in Container(engine.container.dir).manifest["tensors"] if n.startswith(f"model.layers.{N}.")]
    assert not engine.model.has_mtp
    with pytest.raises(ColibriError, match="multi-token-prediction"):
        engine.generate([1, 2, 3], max_tokens=2, speculative="mtp")
    assert engine.generate([1, 2, 3], max_tokens=2, speculative="auto").token_ids  # auto: prompt lookup
