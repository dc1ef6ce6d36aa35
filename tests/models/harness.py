"""Shared runner for the per-architecture tests: a tiny random transformers model, converted
with `colibri convert`, must give the same greedy tokens and close final logits.

At --bits 32 the reference is the transformers model itself. At --bits 4 the reference is the
same transformers model with every weight replaced by colibri's dequantized values, so what is
compared is the kernels and the model code, not the quantizer's rounding.
"""
from __future__ import annotations

import contextlib
import json
import re
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from colibri import Engine
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.model_types import checkpoint_name
from colibri.kernels import attention
from colibri.model_types import checkpoint_name
from colibri.formats.qtensor import dequantize

NEW_TOKENS = 32
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
# gpt-oss's stacked experts: gate_up [E, D, 2I] (gate/up interleaved on the last axis), down [E, I, D]
_GPT_OSS_EXPERTS = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def make_hf_model(model_cls, config, seed: int, out_dir: Path, init_std: float = 0.1, prepare=None) -> Path:
    """Random weights (normal, std `init_std`: large enough that greedy argmax is decisive).
    `prepare(model)`, if given, runs before saving (e.g. to set buffers such as routing biases)."""
    torch.manual_seed(seed)
    config.initializer_range = init_std
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights near 1, not 0: keep the signal alive
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
        if prepare is not None:
            prepare(model)
    model.save_pretrained(out_dir)
    return out_dir


def dequantized_reference(hf_dir: Path, container_dir: Path, out_dir: Path) -> Path:
    """A copy of the HF checkpoint whose tensors hold colibri's dequantized weights."""
    c = Container(container_dir)
    experts = {}
    for prefix, layout in c.expert_layouts.items():
        path, _, _ = c.expert_range(prefix, 0)
        f = c.expert_file(prefix)
        experts[prefix] = [layout.unpack(np.array(f.raw(f"{prefix}.experts.{e}")))
                           for e in range(layout.num_experts)]
    state = load_file(str(hf_dir / "model.safetensors"))
    model_type = json.loads((hf_dir / "config.json").read_text())["model_type"]
    gpt_oss = model_type == "gpt_oss"
    for stored in list(state):
        name = checkpoint_name(model_type, stored)  # the container's name for it
        if gpt_oss and (m := _GPT_OSS_EXPERTS.match(name)):
            stacked = torch.empty_like(state[name])
            for e, ew in enumerate(experts[m["prefix"]]):
                if m["proj"] == "down_proj":
                    stacked[e] = torch.from_numpy(dequantize(ew["down_proj"]).T.copy())
                else:
                    stacked[e, :, 0::2] = torch.from_numpy(dequantize(ew["gate_proj"]).T.copy())
                    stacked[e, :, 1::2] = torch.from_numpy(dequantize(ew["up_proj"]).T.copy())
            state[stored] = stacked
        elif m := _EXPERT.match(name):
            t = experts[m["prefix"]][int(m["e"])][_MIXTRAL.get(m["proj"], m["proj"])]
            state[stored] = torch.from_numpy(dequantize(t).copy())
        elif c.has(name):
            t = c.tensor(name)
            value = t if isinstance(t, np.ndarray) else dequantize(t)
            state[stored] = torch.from_numpy(np.array(value, dtype=np.float32).reshape(state[stored].shape))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    return out_dir


def requantized_checkpoint(hf_dir: Path, stored: dict, reference: dict, quantization_config: dict) -> Path:
    """For an `after_save` that rewrites the saved checkpoint into a quantized release format:
    write `stored` (its tensors in that format) and `quantization_config` into hf_dir, and
    `reference` (the same values as float, which transformers loads) beside it; returns the
    reference's directory."""
    save_file(stored, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    ref_dir = hf_dir.parent / "hf_float"
    ref_dir.mkdir()
    save_file(reference, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    return ref_dir


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens by full recompute each step (no cache: the plainest reference), and the
    logits at the last position of prompt + generated tokens."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
        final = model(torch.tensor([ids])).logits[0, -1].numpy()
    return ids[len(prompt):], final


def check_against_transformers(model_cls, config, tmp_path: Path, seed: int, bits: int,
                               prompts: list[list[int]], init_std: float = 0.1, prepare=None,
                               after_save=None, convert_source=None):
    """Returns the colibri Engine. `prepare(model)` runs before the checkpoint is saved,
    `after_save(hf_dir)` after (e.g. to add tensors transformers does not load, like MTP layers);
    where it rewrites the checkpoint into a form transformers does not load on the CPU (such as
    gpt-oss's MXFP4 experts), it returns the Path of a checkpoint with the same values that
    transformers loads, the reference then. `convert_source(hf_dir) -> dir`, where given, is what
    colibri converts: the same weights in a form transformers does not load (e.g.
    compressed-tensors int4)."""
    hf_dir = make_hf_model(model_cls, config, seed, tmp_path / "hf", init_std, prepare)
    saved = after_save(hf_dir) if after_save is not None else None
    reference = saved if isinstance(saved, Path) else hf_dir
    src = hf_dir if convert_source is None else convert_source(hf_dir)
    out = convert(src, tmp_path / f"c{bits}", bits=bits, progress=False)
    ref_dir = reference if bits == 32 else dequantized_reference(reference, out, tmp_path / "hf_deq")
    ref = model_cls.from_pretrained(ref_dir, attn_implementation="eager", dtype=torch.float32).eval()
    engine = Engine.load(out)
    for prompt in prompts:
        expected, ref_logits = hf_greedy(ref, prompt, NEW_TOKENS)
        got = engine.generate(prompt, max_tokens=NEW_TOKENS, stop_at_eos=False).token_ids
        assert got == expected, f"prompt {prompt}: tokens differ\n colibri {got}\n transformers {expected}"
        ours = engine.logits(prompt + got)[-1]
        rel = np.max(np.abs(ours - ref_logits)) / np.max(np.abs(ref_logits))
        assert rel < 1e-4, f"prompt {prompt}: final logits differ by {rel:.2e} (relative to max)"
    check_fused_decode_matches(engine, prompts[-1])
    check_token_layers_match(engine, prompts[-1])
    check_rows_match_solo_decode(engine, prompts[-1], prompts[0])
    check_chunked_prefill(out, prompts[-1], ref)
    return engine


def check_rows_match_solo_decode(engine, prompt_a: list[int], prompt_b: list[int], steps: int = 6) -> None:
    """DecoderModel.forward_rows gives each row the same bits as decoding it alone: two
    sequences in one batch, and drafted positions of one sequence verified together (then cut
    back, as a rejected draft is)."""
    model = engine.model
    rng = np.random.default_rng(len(prompt_a) + 7)
    ta, tb = (rng.integers(0, engine.vocab_size, steps).tolist() for _ in range(2))

    def solo(prompt, tokens):
        cache = model.new_cache(len(prompt) + len(tokens) + 1)
        model.forward(np.asarray(prompt), cache)
        return np.concatenate([model.forward(np.asarray([t]), cache) for t in tokens])

    def prefilled(prompt):
        cache = model.new_cache(len(prompt) + steps + 1)
        model.forward(np.asarray(prompt), cache)
        return cache

    alone_a, alone_b = solo(prompt_a, ta), solo(prompt_b, tb)
    ca, cb = prefilled(prompt_a), prefilled(prompt_b)
    for s in range(steps):  # a batch of two sequences
        rows = model.forward_rows([ta[s], tb[s]], [ca, cb])
        assert np.array_equal(rows[0], alone_a[s]) and np.array_equal(rows[1], alone_b[s]), f"batch step {s}"
    c = prefilled(prompt_a)  # one sequence, three positions at once, the last two then rejected
    rows = model.forward_rows(ta[:3], [c, c, c])
    assert np.array_equal(rows, alone_a[:3]) and c.length == len(prompt_a) + 3
    c.truncate(len(prompt_a) + 1)
    rows = model.forward_rows(ta[1:steps], [c] * (steps - 1))
    assert np.array_equal(rows, alone_a[1:steps])


def check_chunked_prefill(container_dir: Path, prompt: list[int], ref, chunk: int = 7) -> None:
    """A prompt longer than one prefill chunk, with attention over 4-key blocks (so every
    blockwise path runs several blocks), gives transformers' tokens and final logits."""
    expected, ref_logits = hf_greedy(ref, prompt, 8)
    engine = Engine.load(container_dir, prefill_chunk=chunk)
    with small_key_blocks():
        got = engine.generate(prompt, max_tokens=8, stop_at_eos=False).token_ids
        assert got == expected, f"chunked prefill: tokens differ\n colibri {got}\n transformers {expected}"
        cache = engine.model.new_cache(len(prompt) + len(got))
        for a in range(0, len(prompt) + len(got), chunk):
            ours = engine.model.forward(np.asarray((prompt + got)[a : a + chunk]), cache)[-1]
    rel = np.max(np.abs(ours - ref_logits)) / np.max(np.abs(ref_logits))
    assert rel < 1e-4, f"chunked prefill: final logits differ by {rel:.2e} (relative to max)"


@contextlib.contextmanager
def small_key_blocks(keys: int = 4):
    saved = attention.SCORE_BLOCK_BYTES, attention.MIN_BLOCK
    attention.SCORE_BLOCK_BYTES, attention.MIN_BLOCK = 1, keys
    try:
        yield
    finally:
        attention.SCORE_BLOCK_BYTES, attention.MIN_BLOCK = saved


def check_fused_decode_matches(engine, prompt: list[int], steps: int = 8) -> int:
    """colibri.kernels.decode runs whole attention and MLP blocks in one compiled call; on every
    decode step they must give the step-by-step path's logits and KV cache within float32
    rounding. (Not bit for bit: the kernels' reductions may reassociate, and LLVM picks the
    order per compiled specialization, which differs between the two call paths depending on
    what was compiled first.) Returns how many layer halves took the fused path."""
    model = engine.model
    layers = [layer for layer in model.layers if hasattr(layer, "_build_fused")]
    fused_halves = sum(half is not None for layer in layers for half in layer._build_fused())
    if not fused_halves:
        return 0
    tokens = np.random.default_rng(len(prompt)).integers(0, engine.vocab_size, steps).tolist()

    def run(fused: bool):
        saved, saved_program = [layer._fused for layer in layers], model._program
        if not fused:
            for layer in layers:
                layer._fused = (None, None)
            model._program = False  # nor the whole-token call built from the fused blocks
        try:
            cache = model.new_cache(len(prompt) + steps + 1)
            out = [model.forward(np.asarray(prompt), cache)[-1:]]
            out += [model.forward(np.asarray([t]), cache) for t in tokens]
            return np.concatenate(out), cache
        finally:
            for layer, f in zip(layers, saved):
                layer._fused = f
            model._program = saved_program

    (fused, cache_f), (plain, cache_p) = run(True), run(False)

    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * max(1.0, float(np.max(np.abs(b)))))

    close(fused, plain)
    for kf, kp in zip(cache_f.k, cache_p.k):
        close(kf[:, :cache_f.length], kp[:, :cache_p.length])
    assert (np.argmax(fused, axis=-1) == np.argmax(plain, axis=-1)).all()
    return fused_halves


def prompts_for(vocab: int, seed: int, lengths=(1, 5, 23)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def add_mtp_layer(hf_dir: Path) -> list[str]:
    """Append a DeepSeek/GLM-style MTP layer (index num_hidden_layers) to the saved checkpoint, as
    the real checkpoints ship it: a copy of the last decoder layer plus enorm, hnorm, eh_proj and
    shared_head. transformers does not load it; `convert` must keep it. Returns the new names."""
    n = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    path = str(hf_dir / "model.safetensors")
    state = load_file(path)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    added = {mtp + k[len(last):]: v.clone() for k, v in state.items() if k.startswith(last)}
    d, vocab = state["model.norm.weight"].shape[0], state["model.embed_tokens.weight"].shape[0]
    g = torch.Generator().manual_seed(0)
    added.update({
        mtp + "enorm.weight": torch.ones(d), mtp + "hnorm.weight": torch.ones(d),
        mtp + "eh_proj.weight": torch.randn(d, 2 * d, generator=g) * 0.1,
        mtp + "shared_head.norm.weight": torch.ones(d),
        mtp + "shared_head.head.weight": torch.randn(vocab, d, generator=g) * 0.1,
        mtp + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
    })
    state.update(added)
    save_file(state, path, metadata={"format": "pt"})
    return sorted(added)


def check_decode_matches_recompute(engine, prompt: list[int], n: int = NEW_TOKENS) -> None:
    """Tokens decoded one at a time through the KV cache equal the argmax of one full recompute
    (a fresh prefill) of prompt + generated tokens at every position."""
    got = engine.generate(prompt, max_tokens=n, stop_at_eos=False).token_ids
    logits = engine.logits(prompt + got)                          # [L, V], fresh context
    recomputed = np.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()
    assert got == recomputed, f"cached decode {got}\n full recompute {recomputed}"


def check_token_layers_match(engine, prompt: list[int], steps: int = 6) -> bool:
    """Where one compiled call runs all of a token's layers (decode.token_layers, a team of
    threads), each decode step gives the per-layer fused blocks' logits and KV cache bit for
    bit, with the numba threads the engine has and with one, and so do its phases run one by
    one from Python (decode.token_steps, a first start's first tokens). Returns whether it covers the model."""
    from numba import get_num_threads, set_num_threads

    model = engine.model
    if model._token_program() is None:
        return False
    tokens = np.random.default_rng(len(prompt) + 3).integers(0, engine.vocab_size, steps).tolist()

    def run(program, wait=None):
        saved = model._program, model.program_wait
        model._program, model.program_wait = program, wait
        try:
            cache = model.new_cache(len(prompt) + steps + 1)
            model.forward(np.asarray(prompt), cache)
            return np.concatenate([model.forward(np.asarray([t]), cache) for t in tokens]), cache
        finally:
            model._program, model.program_wait = saved

    (per_layer, cache_l), (whole, cache_w) = run(False), run(None)
    assert np.array_equal(whole, per_layer), "whole-token decode differs from the per-layer blocks"
    for a, b in zip(cache_w.k + cache_w.v, cache_l.k + cache_l.v):
        assert np.array_equal(a[:, :cache_w.length], b[:, :cache_l.length])
    # A first start's tokens before token_layers is compiled (colibri.warmup): decode.token_steps
    stepwise, cache_s = run(None, threading.Event())
    assert np.array_equal(stepwise, whole), "decode.token_steps differs from the whole-token decode"
    for a, b in zip(cache_w.k + cache_w.v, cache_s.k + cache_s.v):
        assert np.array_equal(a[:, :cache_w.length], b[:, :cache_s.length])
    threads = get_num_threads()
    set_num_threads(1)
    try:
        one, _ = run(None)
    finally:
        set_num_threads(threads)
    assert np.array_equal(one, per_layer), "whole-token decode on one thread differs"
    return True


def check_mtp_drafts_under_batching(container_dir: Path, vocab: int) -> None:
    """Batched, each speculating generation gets its own rows' hidden states from the shared
    pass and its MTP passes run on the batcher's thread: the tokens equal plain solo decoding,
    and the drafts were really made and checked inside shared steps."""
    prompts = prompts_for(vocab, 11, lengths=(3, 7, 5))
    kws = [dict(speculative="mtp", draft_tokens=2), dict(speculative="mtp", draft_tokens=3, temperature=0.9, seed=5),
           dict()]
    batched = Engine.load(container_dir, kv_slots=3)
    alone = [batched.generate(p, max_tokens=20, stop_at_eos=False, slot=i,
                              **{k: v for k, v in kw.items() if k not in ("speculative", "draft_tokens")}).token_ids
             for i, (p, kw) in enumerate(zip(prompts, kws))]
    for i in range(3):
        batched.reset(i)
    out: list = [None] * 3
    go = threading.Barrier(3)

    def work(i):
        go.wait()
        try:
            out[i] = batched.generate(prompts[i], max_tokens=20, stop_at_eos=False, slot=i, **kws[i])
        except Exception as e:  # noqa: BLE001 - compared below
            out[i] = e

    batched.start_batching()
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stats = batched.batch_stats
    finally:
        batched.stop_batching()
    assert [g.token_ids for g in out] == alone
    assert out[0].speculative["drafted"] > 0 and out[1].speculative["drafted"] > 0
    assert stats["mean_rows"] > 1.5


def check_plan_sizes_the_engine(model_cls, config, tmp_path: Path):
    """colibri plan on config.json alone, on the checkpoint and on its container gives the
    container's dense bytes and expert layers, and the engine's cache bytes per token and
    recurrent state per slot (with its kept snapshots). Returns (the engine's ModelArgs, the
    container's config) for the family's own checks of the planner's layer rules."""
    from colibri.plan.facts import analyze_model
    from colibri.plan.shapes import mlp_kinds
    from colibri.workspace import STATE_SNAPSHOTS

    hf = make_hf_model(model_cls, config, 3, tmp_path / "hf")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((hf / "config.json").read_text())
    container = convert(hf, tmp_path / "c", bits=4, progress=False)
    engine = Engine.load(container)
    cache = engine.model.new_cache(16)
    args = engine.model.args
    converted = analyze_model(container)
    for facts in (analyze_model(bare), analyze_model(hf), converted):
        assert facts.kv_bytes_per_token == cache.bytes_per_token, facts.kind
        assert facts.state_bytes_per_slot == getattr(cache, "state_bytes", 0) * (1 + STATE_SNAPSHOTS), facts.kind
        assert facts.dense_bytes == converted.dense_bytes, facts.kind
        assert [(l.num_experts, l.expert_bytes) for l in facts.expert_layers] == \
            [(l.num_experts, l.expert_bytes) for l in converted.expert_layers]
    n = args.num_hidden_layers
    assert mlp_kinds(converted.config, n) == [args.mlp_kind(i) for i in range(n)]
    return args, converted.config
