"""Every model_type colibri accepts (colibri.model_types: SUPPORTED and ALIASES) is tested and
documented: a harness test against transformers (tests/models/test_<family>.py, its CASES), a
golden file per case for the fast tier (tests/data/golden/, `python -m tools.make_golden`), and a
row in the README's supported-models table. Read as text and syntax trees: no torch imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from colibri.model_types import ALIASES, SUPPORTED, WRAPPERS
from tools.make_golden import GOLDEN_DIR

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"


def harness_cases(family: str) -> list[str]:
    """The keys of CASES in tests/models/test_<family>.py (string literals), [] where none."""
    path = MODELS / f"test_{family}.py"
    if not path.is_file():
        return []
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CASES" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                return [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    return []


def readme_model_types(readme: Path = ROOT / "README.md") -> list[str]:
    """The backticked names opening each row of the README's "Supported models" table."""
    names, inside = [], False
    for line in readme.read_text().splitlines():
        if line.startswith("#"):
            inside = line.lstrip("#").strip().lower().startswith("supported models")
        elif inside and line.startswith("|"):
            if m := re.match(r"`([A-Za-z0-9_.-]+)`", line.split("|")[1].strip()):
                names.append(m[1])
    return [n for n in names if n != "model_type"]  # the header row


@pytest.mark.parametrize("family", SUPPORTED)
def test_family_has_a_harness_case(family):
    path = MODELS / f"test_{family}.py"
    assert path.is_file(), f"no {path.relative_to(ROOT)} for SUPPORTED model_type {family!r}"
    assert "check_against_transformers" in path.read_text(), f"{path.name} never runs the harness"
    assert harness_cases(family), f"{path.name} has no CASES"


@pytest.mark.parametrize("family", SUPPORTED)
def test_family_has_golden_files(family):
    absent = [c for c in harness_cases(family) if not (GOLDEN_DIR / f"{family}-{c}.json").is_file()]
    assert harness_cases(family) and not absent, \
        f"{family}: no golden file for cases {absent}: run python -m tools.make_golden {family}"


def test_no_stale_golden_files():
    known = {f"{f}-{c}" for f in SUPPORTED for c in harness_cases(f)}
    stale = sorted(p.name for p in GOLDEN_DIR.glob("*.json") if p.stem not in known)
    assert not stale, f"golden files for no current harness case: {stale}"


@pytest.mark.parametrize("model_type", [*SUPPORTED, *ALIASES])
def test_model_type_has_a_readme_row(model_type):
    assert model_type in readme_model_types(), \
        f"README.md's supported-models table has no row starting with `{model_type}`"


def test_readme_lists_only_accepted_model_types():
    extra = set(readme_model_types()) - set(SUPPORTED) - set(ALIASES) - set(WRAPPERS)
    assert not extra, f"README.md lists model_types colibri does not accept: {sorted(extra)}"


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrapper_has_a_harness_case_and_a_readme_row(wrapper):
    """A multimodal wrapper convert unwraps (model_types.WRAPPERS) is run against transformers too."""
    path = MODELS / f"test_{wrapper}.py"
    assert path.is_file() and "check_against_transformers" in path.read_text(), f"no harness test for {wrapper}"
    assert wrapper in readme_model_types()


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_is_tested_through_its_family(alias):
    """The alias's config route: its family's test converts a checkpoint whose config.json names it
    (and tests/test_golden.py runs a golden case of the family under the alias)."""
    target = ALIASES[alias]
    assert target in SUPPORTED
    text = (MODELS / f"test_{target}.py").read_text()
    assert f'"model_type": "{alias}"' in text, f"tests/models/test_{target}.py never loads a {alias!r} config"
    assert list(GOLDEN_DIR.glob(f"{target}-*.json"))
