"""tools/gguf_writer against llama.cpp's own converter: for a tiny random transformers model of
each MoE architecture colibri imports from GGUF (the hybrids qwen35moe and qwen3next converted
with --no-mtp: the tiny models have no MTP block; gpt-oss twice, with float experts and with
MXFP4 experts as the released checkpoints store them, which both repack without requantizing),
both write an f32 GGUF, and every tensor (name, GGUF dims, type, bytes), the metadata keys
colibri reads (`<arch>.*`, `tokenizer.ggml.*`) and the config colibri's importer derives from
each file are compared.

    python -m bench.io.gguf_layout_oracle --llama-cpp /path/to/llama.cpp [--arch qwen3moe ...] [--json]

llama.cpp's convert_hf_to_gguf.py is pure Python; it runs in a subprocess with its own gguf-py
first on sys.path. It refuses a tokenizer whose pre-tokenizer it does not recognize by hash, so
the run tells it the family's pre-tokenizer name (and GLM's special-token vocabulary setup and
llama's sentencepiece attempt are replaced by the plain gpt2 one): the tokenizer itself is the fixture BPE both sides read. Without
--llama-cpp (or with a path that has no converter) the script says so and exits 0 (nothing to
compare against). Exit status 1 when any architecture differs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, machine_line, write_json

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.7, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
_HYBRID = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)
# the released checkpoints' rope (yarn, truncate false), sliding layers first; widths of whole MXFP4 blocks
_GPT_OSS = dict(num_hidden_layers=2, intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
# arch -> (HF class, config class, config kwargs, routing bias, MTP layer)
MODELS = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                 dict(num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True), False, False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2), False, False),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(num_hidden_layers=2, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                   num_experts=4, num_experts_per_tok=2), False, False),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_hidden_layers=2, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=None), False, False),
    "glm4moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                     num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, n_group=2,
                     topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True), True, True),
    "deepseek2": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                  dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
                       qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, n_group=2,
                       topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                       norm_topk_prob=True, rope_parameters=YARN, scoring_func="sigmoid",
                       topk_method="noaux_tc"), True, True),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(_HYBRID, linear_num_value_heads=4), False, False),
    "qwen3next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(_HYBRID, linear_num_value_heads=4,
                                                                   intermediate_size=96), False, False),
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig", _GPT_OSS, False, False),
    "gpt-oss-mxfp4": ("GptOssForCausalLM", "GptOssConfig", _GPT_OSS, False, False),
}
VOCAB = 320
# Mixtral is llama.cpp's llama with experts; gpt-oss-mxfp4 is gpt-oss whose experts are rewritten as
# MXFP4 blocks and scales after saving (mxfp4_experts)
GGUF_ARCH = {"mixtral": "llama", "gpt-oss-mxfp4": "gpt-oss"}

# Each family's converter module is imported only for its own architecture: a module pulls in
# others (glm -> deepseek -> qwen), which may name gguf-py constants an older gguf package lacks
# (a source tree without gguf-py, such as llama-cpp-python's sdist, runs on the installed one).
# An older gguf has no LazyChunkedTensor either; it makes none, so the converter's isinstance
# test against a stand-in class is false, as it would be.
_RUNNER = r"""
import runpy, sys
llama, pre, arch = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path[:0] = [llama + "/gguf-py", llama]
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[4:]
import gguf
if not hasattr(gguf, "LazyChunkedTensor"):
    gguf.LazyChunkedTensor = type("LazyChunkedTensor", (), {})
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
if arch == "glm4moe":
    import conversion.glm as glm
    glm.Glm4MoeModel.set_vocab = base.TextModel._set_vocab_gpt2
if arch == "llama":
    import conversion.llama as llama_mod  # (its sentencepiece attempt needs a package this is not about)
    llama_mod.LlamaModel.set_vocab = base.TextModel._set_vocab_gpt2
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def tiny_model(arch: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from tools.gguf_writer import save_fixture_tokenizer

    cls, cfg_cls, kw, bias, mtp = MODELS[arch]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=256, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if bias and name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(out)
    if mtp:  # an MTP layer as DeepSeek / GLM ship it: a copy of the last layer + enorm, hnorm, eh_proj, shared_head
        n = cfg.num_hidden_layers
        state = load_file(str(out / "model.safetensors"))
        last, new = f"model.layers.{n - 1}.", f"model.layers.{n}."
        state.update({new + k[len(last):]: v.clone() for k, v in list(state.items()) if k.startswith(last)})
        g = torch.Generator().manual_seed(seed)
        state.update({new + "enorm.weight": torch.ones(64), new + "hnorm.weight": torch.ones(64),
                      new + "eh_proj.weight": torch.randn(64, 128, generator=g) * 0.1,
                      new + "shared_head.norm.weight": torch.ones(64),
                      new + "shared_head.head.weight": torch.randn(VOCAB, 64, generator=g) * 0.1,
                      new + "embed_tokens.weight": state["model.embed_tokens.weight"].clone()})
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if arch == "gpt-oss-mxfp4":
        mxfp4_experts(out, seed)
    save_fixture_tokenizer(out)
    return out


def mxfp4_experts(hf: Path, seed: int) -> None:
    """Rewrite a saved gpt-oss checkpoint's float experts as the released checkpoints store them:
    OCP MXFP4 blocks uint8 [E, out, in / 32, 16] and E8M0 scales [E, out, in / 32] (random bytes:
    only the layout is compared), with config.json's quantization_config saying so."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = hf / "model.safetensors"
    state = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(name).shape
        blocks = (experts, outputs, inputs // 32)
        state[f"{name}_blocks"] = torch.randint(0, 256, (*blocks, 16), dtype=torch.uint8, generator=g)
        state[f"{name}_scales"] = torch.randint(118, 128, blocks, dtype=torch.uint8, generator=g)
    save_file(state, str(path), metadata={"format": "pt"})
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (hf / "config.json").write_text(json.dumps(cfg))


def run_llama_cpp(llama: Path, hf: Path, out: Path, arch: str, pre: str,
                  no_mtp: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUNNER, str(llama), pre, arch, str(hf), "--outfile", str(out),
                           "--outtype", "f32", *(["--no-mtp"] if no_mtp else [])],
                          capture_output=True, text=True, timeout=600)


def _meta(reader) -> dict:
    from colibri.io.gguf.reader import _metadata

    return _metadata(reader)


def compare(theirs: Path, ours: Path, arch: str) -> dict:
    """Differences between llama.cpp's file and tools.gguf_writer's, as lists of one-line strings."""
    import gguf

    from colibri.io.gguf import read_gguf

    rt, ro = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    tt, to = {t.name: t for t in rt.tensors}, {t.name: t for t in ro.tensors}
    tensors = [f"only in llama.cpp's: {n}" for n in sorted(tt.keys() - to.keys())]
    tensors += [f"only in ours: {n}" for n in sorted(to.keys() - tt.keys())]
    for name in sorted(tt.keys() & to.keys()):
        a, b = tt[name], to[name]
        if list(a.shape) != list(b.shape) or a.tensor_type != b.tensor_type:
            tensors.append(f"{name}: llama.cpp {a.tensor_type.name} {list(a.shape)}, ours {b.tensor_type.name} "
                           f"{list(b.shape)}")
        elif not np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)):
            tensors.append(f"{name}: bytes differ")
    mt, mo = _meta(rt), _meta(ro)
    read = lambda k: k.startswith(arch + ".") or (k.startswith("tokenizer.ggml.") and k != "tokenizer.ggml.pre") \
        or k == "general.architecture"
    meta = []
    for key in sorted({k for k in mt if read(k)} | {k for k in mo if read(k)}):
        a, b = mt.get(key), mo.get(key)
        same = (np.float32(a) == np.float32(b)) if isinstance(a, float) and isinstance(b, float) else a == b
        if not same:
            short = lambda v: (repr(v)[:60] + "...") if len(repr(v)) > 60 else repr(v)
            meta.append(f"{key}: llama.cpp {short(a)}, ours {short(b)}")
    config = []
    try:
        ct, co = read_gguf(theirs).config, read_gguf(ours).config
        config = [f"{k}: llama.cpp {ct.get(k)!r}, ours {co.get(k)!r}" for k in sorted(ct.keys() | co.keys())
                  if k != "_name_or_path" and ct.get(k) != co.get(k)]
    except Exception as e:  # noqa: BLE001 (reported, not raised: the report is the point)
        config = [f"read_gguf failed: {' '.join(str(e).split())}"]
    return {"tensors_compared": len(tt.keys() & to.keys()), "tensors": tensors, "metadata": meta, "config": config,
            "same": not (tensors or meta or config)}


def main() -> None:
    from tools.gguf_writer import PRE_OF, write_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source directory (with convert_hf_to_gguf.py)")
    ap.add_argument("--arch", nargs="*", default=sorted(MODELS), choices=sorted(MODELS))
    ap.add_argument("--workdir", type=Path, help="keep the models and files here (default: a temporary directory)")
    add_json_arg(ap)
    a = ap.parse_args()
    print(machine_line())
    if a.llama_cpp is None or not (a.llama_cpp / "convert_hf_to_gguf.py").is_file():
        print(f"no llama.cpp converter at {a.llama_cpp} (pass --llama-cpp DIR): nothing to compare against")
        write_json(a.json, {"skipped": "no llama.cpp converter", "archs": {}}, args=a)
        return
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = a.workdir or Path(tmp)
        for arch in a.arch:
            d = root / arch
            d.mkdir(parents=True, exist_ok=True)
            hf = tiny_model(arch, d / "hf")
            (ours,) = write_gguf(hf, d / "ours.gguf")
            theirs = d / "llama_cpp.gguf"
            gguf_arch = GGUF_ARCH.get(arch, arch)
            # the hybrids' converter counts an MTP block unless told there is none
            p = run_llama_cpp(a.llama_cpp, hf, theirs, gguf_arch, PRE_OF[gguf_arch],
                              no_mtp=arch in ("qwen35moe", "qwen3next"))
            if p.returncode != 0:
                tail = " | ".join(p.stderr.strip().splitlines()[-3:])
                report[arch] = {"same": False, "error": f"convert_hf_to_gguf.py failed: {tail}"}
                print(f"{arch:10s} llama.cpp's converter failed: {tail}")
                continue
            r = compare(theirs, ours, gguf_arch)
            report[arch] = r
            verdict = "SAME" if r["same"] else "DIFFERENT"
            print(f"{arch:10s} {verdict}: {r['tensors_compared']} tensors compared; "
                  f"{len(r['tensors'])} tensor, {len(r['metadata'])} metadata, {len(r['config'])} config differences")
            for line in r["tensors"] + r["metadata"] + r["config"]:
                print(f"           {line}")
    write_json(a.json, {"archs": report}, args=a)
    if not all(r["same"] for r in report.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
