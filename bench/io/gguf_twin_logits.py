"""colibri on a synthetic container against llama.cpp on its GGUF twin (tools/gguf_synthetic.py:
the same weights as Q4_0 / Q8_0 / F32, the layout llama.cpp's converter writes): the logits of
every position of one prompt, their largest difference relative to the largest logit, and how
often the greedy tokens agree. A check of the twin writer (names, transforms, metadata) run by
llama.cpp itself; not exact, since llama.cpp quantizes activations to q8_0 for its Q4_0 / Q8_0
matmuls.

    python -m bench.io.gguf_twin_logits --llama-python /work/peer-venv/bin/python \
        [--preset qwen3.6-35b-a3b --layers 4 --width-divisor 8 --tokens 40] [--json OUT]

--container DIR --gguf FILE compare an existing container with any GGUF of it instead, e.g. the
F32 file llama.cpp's converter writes in bench/io/gguf_twin_oracle.py's --workdir: there no
activation is quantized, and the difference is float rounding alone.

llama.cpp runs in a child process under --llama-python (a venv with llama-cpp-python; set
LLAMA_CPP_LIB_PATH to use another build of libllama). Without --llama-python the script says
so and exits 0 (nothing to compare against).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, child_env, machine_line, module_command, write_json


def prompt(n: int) -> list[int]:
    return np.random.default_rng(1).integers(100, 49000, size=n).tolist()


def child_llama(gguf: Path, ids: list[int], out: Path) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), logits_all=True, n_ctx=max(64, len(ids) + 8), n_batch=len(ids),
                n_threads=2, verbose=False)
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[: len(ids)], np.float32))


def compare(ours: np.ndarray, theirs: np.ndarray) -> dict:
    diff = np.abs(ours - theirs)
    scale = float(np.abs(ours).max())
    per_pos = diff.max(axis=1) / np.abs(ours).max(axis=1)
    return {"max_abs_diff": float(diff.max()), "max_abs_logit": scale,
            "rel_max_diff": float(diff.max()) / scale, "rel_max_diff_worst_position": float(per_pos.max()),
            "greedy_agree": float(np.mean(ours.argmax(1) == theirs.argmax(1))), "positions": int(len(ours))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", help="a python with llama-cpp-python installed")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width-divisor", type=int, default=8,
                    help="8 keeps Qwen3.6's two value heads per key head (16 drops it to one)")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--workdir", type=Path, help="keep the model and its twin here (default: a temporary directory)")
    ap.add_argument("--container", type=Path, help="an existing container (with --gguf)")
    ap.add_argument("--gguf", type=Path, help="the GGUF llama.cpp runs (with --container)")
    ap.add_argument("--child-llama", nargs=3, metavar=("GGUF", "IDS_JSON", "OUT_NPY"), help=argparse.SUPPRESS)
    add_json_arg(ap)
    a = ap.parse_args()
    if a.child_llama:
        gguf, ids, out = a.child_llama
        child_llama(Path(gguf), json.loads(ids), Path(out))
        return
    print(machine_line())
    if not a.llama_python:
        print("no --llama-python given: nothing to compare against")
        write_json(a.json, {"skipped": "no llama.cpp"}, args=a)
        return
    from colibri import Engine
    from tools import gguf_synthetic, synthetic_moe

    with tempfile.TemporaryDirectory() as tmp:
        root = a.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = a.container or root / f"{a.preset}-l{a.layers}-w{a.width_divisor}"
        if not (model / "config.json").exists():
            synthetic_moe.write_container(model, a.preset, layers=a.layers, width_divisor=a.width_divisor,
                                          vocab=gguf_synthetic.TOKENIZER_VOCAB, progress=False)
        twin = a.gguf or model.parent / f"{model.name}.gguf"
        if not twin.exists():
            gguf_synthetic.write_gguf(twin, model)
        ids = prompt(a.tokens)
        ours = Engine.load(model, stream_experts=False).logits(ids)
        out = root / "llama_logits.npy"
        p = subprocess.run([*module_command(__spec__.name, a.llama_python), "--child-llama", str(twin),
                            json.dumps(ids), str(out)], capture_output=True, text=True, env=child_env(),
                           timeout=600)
        if p.returncode != 0:
            sys.exit(f"llama.cpp failed on {twin.name}: {' | '.join(p.stderr.strip().splitlines()[-5:])}")
        r = compare(ours, np.load(out))
        arch = gguf_synthetic.ARCH[json.loads((model / "config.json").read_text())["model_type"]]
    r.update(preset=a.preset, arch=arch, layers=a.layers, width_divisor=a.width_divisor, gguf=str(twin))
    what = f"{model.name} against llama.cpp on {twin.name}" if a.gguf else \
        f"{a.preset} as {arch} ({a.layers} layers, width / {a.width_divisor})"
    print(f"{what}, {r['positions']} positions: "
          f"max |colibri - llama.cpp| = {r['max_abs_diff']:.3g} of max |logit| {r['max_abs_logit']:.3g} "
          f"(relative {r['rel_max_diff']:.2e}; worst position {r['rel_max_diff_worst_position']:.2e}); "
          f"greedy tokens agree at {100 * r['greedy_agree']:.0f}% of positions")
    write_json(a.json, r, args=a)


if __name__ == "__main__":
    main()
