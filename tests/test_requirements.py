"""COLIBRI_REQUIRE=1 (CI) turns a skip for a missing requirement into a failure: a tiny test file,
run by pytest in a subprocess with and without the variable."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CASE = '''
import pytest
from requirements import missing, needs

@pytest.fixture
def thing():
    missing("the thing is not installed")

def test_fixture(thing):
    pass

@needs(False, "the tool is not installed")
def test_decorated(tmp_path):
    pass

@needs(True, "never missing")
def test_present(tmp_path):
    assert tmp_path.is_dir()
'''


def run_case(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(CASE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_REQUIRE"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # a quicker start; the case needs no plugin
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if require is not None:
        env["COLIBRI_REQUIRE"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_case.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_missing_requirement_skips_by_default(tmp_path):
    r = run_case(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 2 skipped" in r.stdout and "the tool is not installed" in r.stdout, r.stdout


def test_require_0_still_skips(tmp_path):
    assert run_case(tmp_path, "0").returncode == 0


def test_colibri_require_turns_missing_requirements_into_failures(tmp_path):
    r = run_case(tmp_path, "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed, 1 error" in r.stdout, r.stdout  # the fixture's failure is an error
    assert "COLIBRI_REQUIRE=1 and a requirement is missing: the thing is not installed" in r.stdout
    assert "COLIBRI_REQUIRE=1 and a requirement is missing: the tool is not installed" in r.stdout
