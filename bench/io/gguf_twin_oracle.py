"""tools/gguf_synthetic's twin against llama.cpp's own converter: a synthetic container is written
out as the Hugging Face checkpoint it stands for (every tensor's float32 values, experts one per
tensor, the container's config.json and tokenizer), convert_hf_to_gguf.py turns that into an F32
GGUF, and its tensor names, GGUF dims, values and `<arch>.*` metadata are compared with the
twin's (whose Q4_0 blocks hold the same values exactly). colibri then runs llama.cpp's file in
place (colibri/io/gguf_link.py) against the container: the largest logit difference on a prompt
(float32 kernels against int4 ones over the same values).

    python -m bench.io.gguf_twin_oracle --llama-cpp /path/to/llama.cpp [--preset qwen3.6-35b-a3b ...] [--json]

The converter runs in a subprocess with its own gguf-py first on sys.path, told the tokenizer's
pre-tokenizer name (it recognizes pre-tokenizers by hash) and --no-mtp (the slices have no MTP
block). Values are compared as float32 bits; ssm_a = -exp(A_log) may differ by float32 ulps
(torch's exp against numpy's), which the report counts apart. Without --llama-cpp the script
says so and exits 0. Exit status 1 when a preset differs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, machine_line, write_json

PRESETS = ("qwen3.6-35b-a3b", "qwen3-next-80b-a3b", "qwen3-30b-a3b")
_RUNNER = r"""
import runpy, sys
llama, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [llama + "/gguf-py", llama]
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def hf_checkpoint(container: Path, out: Path) -> Path:
    """The container as an HF directory of float32 safetensors (the names are the HF ones already)."""
    import torch
    from safetensors.torch import save_file

    from colibri.formats.qtensor import QTensor, dequantize
    from colibri.io.container import Container

    c = Container(container)
    c.interleave_rows = False
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, spec in c.manifest["tensors"].items():
        t = c.tensor(name)
        values = dequantize(t) if isinstance(t, QTensor) and t.scheme != "f32" else np.asarray(
            t.q if isinstance(t, QTensor) else t, np.float32)
        state[name] = torch.from_numpy(np.ascontiguousarray(values.reshape(spec["shape"]), np.float32))
    for prefix, layout in c.expert_layouts.items():
        path, _, n = c.expert_range(prefix, 0)
        for e in range(layout.num_experts):
            _, off, n = c.expert_range(prefix, e)
            parts = layout.unpack(np.fromfile(path, np.uint8, count=n, offset=off))
            for proj, t in parts.items():
                state[f"{prefix}.experts.{e}.{proj}.weight"] = torch.from_numpy(np.ascontiguousarray(dequantize(t)))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in c.config.items() if k != "colibri_synthetic"}
    if cfg["model_type"] == "qwen3_5_moe":  # the text model's config (the composite one would fill
        cfg["model_type"] = "qwen3_5_moe_text"  # a text_config with its defaults over these fields)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(container / f, out / f)
    return out


def compare(theirs: Path, ours: Path) -> dict:
    import gguf

    from colibri.io.gguf.reader import _metadata

    rt, ro = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    arch = _metadata(ro)["general.architecture"]
    tt, to = {t.name: t for t in rt.tensors}, {t.name: t for t in ro.tensors}
    tensors = [f"only in llama.cpp's: {n}" for n in sorted(tt.keys() - to.keys())]
    tensors += [f"only in the twin: {n}" for n in sorted(to.keys() - tt.keys())]
    ulps = {}
    for name in sorted(tt.keys() & to.keys()):
        a, b = tt[name], to[name]
        if [int(x) for x in a.shape] != [int(x) for x in b.shape]:
            tensors.append(f"{name}: llama.cpp {list(map(int, a.shape))}, twin {list(map(int, b.shape))}")
            continue
        va = gguf.quants.dequantize(a.data, a.tensor_type).astype(np.float32).reshape(-1)
        vb = gguf.quants.dequantize(b.data, b.tensor_type).astype(np.float32).reshape(-1)
        if not np.array_equal(va, vb):
            off = int(np.abs(va.view(np.int32).astype(np.int64) - vb.view(np.int32).astype(np.int64)).max())
            if name.endswith(".ssm_a") and off <= 2:
                ulps[name] = off
            else:
                tensors.append(f"{name}: values differ (max |diff| {np.abs(va - vb).max():.3g})")
    mt, mo = _metadata(rt), _metadata(ro)
    meta = []
    for key in sorted({k for k in mt if k.startswith(arch + ".")} | {k for k in mo if k.startswith(arch + ".")}):
        a, b = mt.get(key), mo.get(key)
        same = np.float32(a) == np.float32(b) if isinstance(a, float) and isinstance(b, float) else a == b
        if not same:
            meta.append(f"{key}: llama.cpp {a!r}, twin {b!r}")
    return {"arch": arch, "tensors_compared": len(tt.keys() & to.keys()), "tensors": tensors, "metadata": meta,
            "ssm_a_ulps": ulps, "same": not (tensors or meta)}


def colibri_difference(container: Path, gguf: Path, linked: Path) -> float:
    from colibri import Engine
    from colibri.io.gguf_link import link_gguf

    ids = np.random.default_rng(1).integers(100, 49000, size=24).tolist()
    if linked.exists():
        shutil.rmtree(linked)
    want = Engine.load(container, stream_experts=False).logits(ids)
    got = Engine.load(link_gguf(gguf, linked, progress=False), stream_experts=False).logits(ids)
    return float(np.abs(got - want).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source directory (with convert_hf_to_gguf.py)")
    ap.add_argument("--preset", nargs="*", default=list(PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width-divisor", type=int, default=8)
    ap.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary directory)")
    add_json_arg(ap)
    a = ap.parse_args()
    print(machine_line())
    if a.llama_cpp is None or not (a.llama_cpp / "convert_hf_to_gguf.py").is_file():
        print(f"no llama.cpp converter at {a.llama_cpp} (pass --llama-cpp DIR): nothing to compare against")
        write_json(a.json, {"skipped": "no llama.cpp converter", "presets": {}}, args=a)
        return
    from tools import gguf_synthetic, synthetic_moe

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = a.workdir or Path(tmp)
        for preset in a.preset:
            d = root / f"{preset}-oracle"
            d.mkdir(parents=True, exist_ok=True)
            container = synthetic_moe.write_container(d / "container", preset, layers=a.layers, progress=False,
                                                      width_divisor=a.width_divisor, vocab=gguf_synthetic.TOKENIZER_VOCAB) \
                if not (d / "container" / "config.json").exists() else d / "container"
            twin = d / "twin.gguf"
            if not twin.exists():
                gguf_synthetic.write_gguf(twin, container)
            hf = hf_checkpoint(container, d / "hf")
            theirs = d / "llama_cpp.gguf"
            model_type = json.loads((container / "config.json").read_text())["model_type"]
            mtp = ["--no-mtp"] if gguf_synthetic.ARCH[model_type] in gguf_synthetic.HYBRID_ARCHS else []
            p = subprocess.run([sys.executable, "-c", _RUNNER, str(a.llama_cpp), "smollm", str(hf), "--outfile",
                                str(theirs), "--outtype", "f32", *mtp], capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                tail = " | ".join(p.stderr.strip().splitlines()[-3:])
                report[preset] = {"same": False, "error": f"convert_hf_to_gguf.py failed: {tail}"}
                print(f"{preset:20s} llama.cpp's converter failed: {tail}")
                continue
            r = compare(theirs, twin)
            r["colibri_on_llama_cpp_file_max_logit_diff"] = colibri_difference(container, theirs, d / "linked")
            report[preset] = r
            print(f"{preset:20s} {r['arch']:10s} {'SAME' if r['same'] else 'DIFFERENT'}: {r['tensors_compared']} "
                  f"tensors compared; {len(r['tensors'])} tensor, {len(r['metadata'])} metadata differences; "
                  f"ssm_a within {max(r['ssm_a_ulps'].values(), default=0)} ulp in {len(r['ssm_a_ulps'])} tensors; "
                  f"colibri on llama.cpp's file: logits within {r['colibri_on_llama_cpp_file_max_logit_diff']:.2g} "
                  "of the container's")
            for line in r["tensors"] + r["metadata"]:
                print(f"                     {line}")
    write_json(a.json, {"presets": report}, args=a)
    if not all(r["same"] for r in report.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
