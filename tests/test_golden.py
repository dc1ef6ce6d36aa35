"""The fast tier for the model families, without torch: each golden file (tests/data/golden/, made by
`python -m tools.make_golden`) names a tiny config of a tests/models harness case and the seed numpy
draws its weights from; colibri converts the regenerated checkpoint at --bits 32 and 4 and must give
transformers' recorded greedy tokens and final logits within the harness's tolerance (1e-4 of their
max). At --bits 4 the record is transformers running colibri's dequantized weights, as in the harness.

The slow tier (tests/models, `-m slow`) runs transformers itself, on more checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri import Engine
from colibri.io.convert import convert
from colibri.model_types import ALIASES, SUPPORTED, WRAPPERS
from tools.make_golden import GOLDEN_DIR, load, write_checkpoint

FILES = sorted(GOLDEN_DIR.glob("*.json"))
TOLERANCE = 1e-4
CHUNK = 7  # a prefill chunk shorter than the longest prompt (23 tokens)


def check_golden(golden: dict, bits: str, work: Path, model_type: str | None = None) -> None:
    """Regenerate, convert and run one golden case at `bits`; `model_type` rewrites config.json's
    (an alias must behave as the family it names)."""
    hf = write_checkpoint(golden, work / "hf")
    if model_type is not None:
        cfg = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    out = convert(hf, work / f"c{bits}", bits=int(bits), progress=False)
    ref = golden["bits"][bits]
    engine = Engine.load(out)
    name = f"{golden['family']}-{golden['case']} --bits {bits}"
    for prompt, expected, logits in zip(golden["prompts"], ref["tokens"], ref["logits"]):
        got = engine.generate(prompt, max_tokens=golden["new_tokens"], stop_at_eos=False).token_ids
        assert got == expected, f"{name}, prompt {prompt}: tokens differ\n colibri {got}\n golden  {expected}"
        ours, theirs = engine.logits(prompt + got)[-1], np.asarray(logits, dtype=np.float32)
        rel = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
        assert rel < TOLERANCE, f"{name}, prompt {prompt}: final logits differ by {rel:.2e} (relative to max)"
    # the longest prompt again, prefilled in chunks: greedy is a prefix of the same 32 tokens
    prompt, expected = golden["prompts"][-1], ref["tokens"][-1][:8]
    got = Engine.load(out, prefill_chunk=CHUNK).generate(prompt, max_tokens=8, stop_at_eos=False).token_ids
    assert got == expected, f"{name}, chunked prefill: tokens differ\n colibri {got}\n golden  {expected}"


@pytest.mark.parametrize("bits", ["32", "4"])
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_matches_golden(path, bits, tmp_path):
    golden = load(path)
    assert bits in golden["bits"], f"{path.name} has no --bits {bits} record: rerun python -m tools.make_golden"
    check_golden(golden, bits, tmp_path)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_matches_its_family_golden(alias, tmp_path):
    golden = load(sorted(GOLDEN_DIR.glob(f"{ALIASES[alias]}-*.json"))[0])
    if golden["config"]["model_type"] in WRAPPERS:  # the alias names the wrapper's language model:
        check_golden(golden, "32", tmp_path)         # what its conversion writes, and then runs
        assert json.loads((tmp_path / "c32" / "config.json").read_text())["model_type"] == alias
    else:
        check_golden(golden, "32", tmp_path, model_type=alias)


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_supported_family_has_a_golden_file(family):
    assert list(GOLDEN_DIR.glob(f"{family}-*.json")), \
        f"no golden file for {family} in {GOLDEN_DIR}: run python -m tools.make_golden {family}"


def test_golden_tier_runs_without_torch(tmp_path):
    """The whole import chain of this file and one golden case run in a process where importing
    torch or transformers fails."""
    root = Path(__file__).resolve().parent.parent
    code = f"""
import sys
from pathlib import Path
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError('the fast tier imported ' + name)
sys.meta_path.insert(0, Refuse())
sys.path[:0] = [{str(root / 'tests')!r}, {str(root)!r}]
import conftest, test_golden
from tools.make_golden import load
test_golden.check_golden(load(test_golden.GOLDEN_DIR / 'llama-gqa.json'), '32', Path({str(tmp_path)!r}))
bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]
assert not bad, bad
print('ok')
"""
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
