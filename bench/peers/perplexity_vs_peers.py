"""SmolLM2 perplexity and KL divergence: colibri, transformers fp32 (the reference: the same GGUF's
weights dequantized) and llama.cpp, on the same tokens with the same windows.

    python -m bench.peers.perplexity_vs_peers [--tokens 20480] [--ctx 512] [--stride 256]
                                        [--peer-python /work/peer-venv/bin/python]
    python -m bench.peers.perplexity_vs_peers --write-text pydoc_topics.txt   # the text alone
    python -m bench.peers.perplexity_vs_peers --export-hf DIR   # the GGUF as a float32 checkpoint

The text ships with Python: pydoc's topic help (pydoc_data.topics), topics in sorted order
joined by blank lines, its first --tokens tokens (SmolLM2's tokenizer). Windows are
colibri/eval.py's (Hugging Face's strided method). KL(transformers || engine) over
transformers' top-256 tokens plus a bucket for the rest (colibri/eval.py says why that is a
lower bound). llama.cpp runs in the peer virtual environment (llama-cpp-python) in a child
process and is skipped when that environment is missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from bench.common import REPO, add_json_arg, child_env, machine_line, module_command, write_json


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class _Rows:
    """score_text's engine interface over a function giving a window's logits [n, V]."""

    def __init__(self, fn, max_context: int):
        self.fn, self.max_context = fn, max_context

    def logit_rows(self, ids):
        yield 0, self.fn(ids)


def run_transformers(gguf: Path, ids, ctx, stride, ev):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

    def logits(window):
        with torch.no_grad():
            return model(torch.tensor([window])).logits[0].numpy()

    return ev.score_text(_Rows(logits, ctx), ids, ctx, stride, keep_top=True)


def export_hf(gguf: Path | None, out: Path) -> None:
    """The GGUF dequantized by transformers, saved as a float32 safetensors checkpoint with the
    embedded model's tokenizer files (transformers refuses to save a GGUF-loaded model itself)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from colibri.default_model import default_gguf, default_model_dir

    gguf = gguf or Path(default_gguf())
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    container = default_model_dir(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (container / name).exists():
            shutil.copy(container / name, out / name)


def child_llama(args) -> None:
    """In the peer environment: llama.cpp's logits for every position, scored like the others."""
    import llama_cpp

    ev = _eval_module()
    data = np.load(args.child_in)
    ids = data["ids"].tolist()
    ref = ev.Scores(data["targets"], data["logprobs"], data["top_ids"], data["top_logprobs"])
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.ctx, n_batch=args.ctx, n_ubatch=args.ctx,
                          n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
    n_vocab = llm.n_vocab()

    def logits(window):
        llm.reset()
        llm.eval(window)
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, i), shape=(n_vocab,))
                         for i in range(len(window))]).copy()

    s = ev.score_text(_Rows(logits, args.ctx), ids, args.ctx, args.stride, reference=ref)
    Path(args.child_out).write_text(json.dumps(s.summary()))


def _eval_module():
    """colibri/eval.py without importing colibri (whose package pulls numba and the engine):
    the peer environment has numpy only."""
    pkg = types.ModuleType("colibri")
    pkg.__path__ = []
    errors = types.ModuleType("colibri.errors")
    exec((REPO / "colibri" / "errors.py").read_text(), errors.__dict__)
    sys.modules.update({"colibri": pkg, "colibri.errors": errors})
    spec = importlib.util.spec_from_file_location("colibri.eval", REPO / "colibri" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["colibri.eval"] = module  # (dataclasses look their module up while it runs)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--peer-python", default="/work/peer-venv/bin/python")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--write-text", metavar="FILE", help="only write the text to FILE (for `colibri perplexity`)")
    ap.add_argument("--export-hf", metavar="DIR", help="only write the GGUF's weights dequantized as a float32 "
                    "Hugging Face checkpoint (for `colibri convert --bits 4|8|32`)")
    add_json_arg(ap)
    ap.add_argument("--child-in", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_in:
        child_llama(args)
        return
    if args.write_text:
        Path(args.write_text).write_text(pydoc_text())
        return
    if args.export_hf:
        export_hf(Path(args.gguf) if args.gguf else None, Path(args.export_hf))
        return

    from colibri import Engine, eval as ev
    from colibri.default_model import default_gguf, default_model_dir

    gguf = Path(args.gguf or default_gguf())
    engine = Engine.load(default_model_dir(), max_context=args.ctx)
    ids = engine.encode_prompt(pydoc_text(), raw=True)[: args.tokens]
    print(machine_line())
    print(f"{len(ids)} tokens of pydoc topics, ctx {args.ctx}, stride {args.stride}")
    rows = []

    t0 = time.perf_counter()
    ref = run_transformers(gguf, ids, args.ctx, args.stride, ev)
    print(f"transformers fp32: {time.perf_counter() - t0:.0f} s")
    rows.append(("transformers fp32 (reference)", ref.summary()))

    colibri = ev.score_text(engine, ids, args.ctx, args.stride, reference=ref)
    rows.append(("colibri", colibri.summary()))
    nll = np.abs(colibri.logprobs - ref.logprobs)
    print(f"colibri: mean |dNLL| vs transformers {nll.mean():.2e}, max {nll.max():.2e}")

    if Path(args.peer_python).exists():
        with tempfile.TemporaryDirectory() as tmp:
            child_in, child_out = Path(tmp) / "in.npz", Path(tmp) / "out.json"
            np.savez(child_in, ids=np.asarray(ids), targets=ref.targets, logprobs=ref.logprobs, top_ids=ref.top_ids,
                     top_logprobs=ref.top_logprobs)
            subprocess.run([*module_command(__spec__.name, args.peer_python), "--gguf", str(gguf), "--ctx", str(args.ctx), "--stride",
                            str(args.stride), "--child-in", str(child_in), "--child-out", str(child_out)], check=True,
                           env=child_env())
            rows.append(("llama.cpp (llama-cpp-python)", json.loads(child_out.read_text())))
    else:
        print(f"llama.cpp skipped: no peer environment at {args.peer_python}")

    print("\n| engine | perplexity | vs transformers | KL mean | KL p99 | top-1 agreement | tok/s |")
    print("|---|---|---|---|---|---|---|")
    base = rows[0][1]["perplexity"]
    for name, r in rows:
        kl = (f"{r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['top1_agreement']:.2%}" if "kl_mean" in r
              else "- | - | -")
        print(f"| {name} | {r['perplexity']:.4f} | {(r['perplexity'] / base - 1) * 100:+.3f}% | {kl} | "
              f"{r['tokens_per_s']:.0f} |")
    write_json(args.json, {"gguf": str(gguf), "tokens": len(ids), "rows": [{"engine": n, **r} for n, r in rows]},
               args=args)


if __name__ == "__main__":
    main()
