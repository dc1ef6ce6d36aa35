"""Golden files for the fast test tier (tests/test_golden.py): for every family in
colibri.model_types.SUPPORTED and every tiny config its harness test (tests/models/test_<family>.py)
checks, transformers' greedy tokens and final logits on weights numpy draws from a seed.

    python -m tools.make_golden            # writes tests/data/golden/<family>-<case>.json

Only `main` needs torch and transformers (imported there); `write_checkpoint`, which regenerates the
checkpoint from a golden file, is numpy + safetensors, so the fast tier runs without torch.

What a file holds: the saved config.json, the checkpoint's tensor names and shapes, the seed, a
sha256 of the generated weights (a numpy RNG that changed would fail loudly, not as a token
mismatch), the prompts, and per --bits (32, and 4 with transformers running colibri's dequantized
weights, as the harness does) the 32 greedy tokens and the final-position logits for each prompt.
Regenerate after a deliberate change to a reference (the int4 quantizer, a harness config).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden"
MODELS_TESTS = Path(__file__).resolve().parent.parent / "tests" / "models"
NEW_TOKENS = 32
BITS = (32, 4)
INIT_STD = 0.1


def weights(tensors: list, seed: int, config: dict | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's float32 tensors, drawn in the listed order from one numpy generator: RMSNorm
    weights near 1 (1 + 0.1 N), routing-correction biases 0.2 N (so they steer the choice), the rest
    N(0, INIT_STD), as tests/models/harness.py initializes with torch. A hash router's token -> expert
    table (DeepSeek V4's `tid2eid`, int64) holds distinct experts of config's n_routed_experts."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensors:
        if name.endswith("tid2eid"):
            experts = int((config or {}).get("n_routed_experts") or shape[1])
            out[name] = np.argsort(rng.random((shape[0], experts)), axis=1)[:, :shape[1]].astype(np.int64)
            continue
        x = rng.standard_normal(tuple(shape), dtype=np.float32)
        if name.endswith("e_score_correction_bias"):
            x *= np.float32(0.2)
        elif "norm" in name:
            x = np.float32(1.0) + np.float32(0.1) * x
        else:
            x *= np.float32(INIT_STD)
        out[name] = x
    return out


def digest(state: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(state[name]).tobytes())
    return h.hexdigest()


def write_checkpoint(golden: dict, out_dir: Path) -> Path:
    """The golden file's checkpoint (config.json + model.safetensors) regenerated under out_dir."""
    from safetensors.numpy import save_file

    state = weights(golden["tensors"], golden["seed"], golden["config"])
    if digest(state) != golden["sha256"]:
        raise AssertionError("numpy drew different weights than when the golden file was made "
                             "(numpy's generator changed?): rerun python -m tools.make_golden")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(golden["config"], indent=2))
    return out_dir


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _family_module(family: str):
    if str(MODELS_TESTS) not in sys.path:
        sys.path.insert(0, str(MODELS_TESTS))  # the test modules import `harness` as a top-level module
    return importlib.import_module(f"test_{family}")


def _reference(model_cls, ref_dir: Path, prompts: list[list[int]]) -> dict:
    import torch

    from harness import hf_greedy

    ref = model_cls.from_pretrained(ref_dir, attn_implementation="eager", dtype=torch.float32).eval()
    tokens, logits = [], []
    for prompt in prompts:
        got, final = hf_greedy(ref, prompt, NEW_TOKENS)
        tokens.append(got)
        logits.append([float(v) for v in np.asarray(final, dtype=np.float32)])
    return {"tokens": tokens, "logits": logits}


def make_case(family: str, case: str, work: Path) -> dict:
    import transformers
    from safetensors import safe_open

    from colibri.io.convert import convert
    from harness import dequantized_reference, prompts_for

    mod = _family_module(family)
    cfg, seed = mod.config(case), mod.case_seed(case)
    cfg.initializer_range = INIT_STD
    # Which tensors the checkpoint has (tied embeddings, persistent buffers): what save_pretrained writes.
    shape_dir = work / "shapes"
    mod.MODEL(cfg).save_pretrained(shape_dir)
    with safe_open(str(shape_dir / "model.safetensors"), "np") as f:
        tensors = [[name, list(f.get_slice(name).get_shape())] for name in sorted(f.keys())]
    config = json.loads((shape_dir / "config.json").read_text())
    state = weights(tensors, seed, config)
    golden = {"family": family, "case": case, "seed": seed, "transformers": transformers.__version__,
              "new_tokens": NEW_TOKENS, "config": config, "tensors": tensors, "sha256": digest(state),
              "prompts": prompts_for(cfg.get_text_config().vocab_size, seed), "bits": {}}
    hf_dir = write_checkpoint(golden, work / "hf")
    for bits in BITS:
        ref_dir = hf_dir
        if bits != 32:
            out = convert(hf_dir, work / f"c{bits}", bits=bits, progress=False)
            ref_dir = dequantized_reference(hf_dir, out, work / f"hf_deq{bits}")
        golden["bits"][str(bits)] = _reference(mod.MODEL, ref_dir, golden["prompts"])
    return golden


def cases() -> list[tuple[str, str]]:
    from colibri.model_types import SUPPORTED

    return [(family, case) for family in SUPPORTED for case in sorted(_family_module(family).CASES)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="*", help="only these families (default: every SUPPORTED one)")
    p.add_argument("--out", type=Path, default=GOLDEN_DIR)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for family, case in cases():
        if args.families and family not in args.families:
            continue
        with tempfile.TemporaryDirectory() as work:
            golden = make_case(family, case, Path(work))
        path = args.out / f"{family}-{case}.json"
        path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
        print(f"{path}: {path.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
