import pytest


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Routing history goes to the user's cache directory: keep each test's apart (modules that
    stream experts use it for every test: `pytestmark = pytest.mark.usefixtures("private_cache")`)."""
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
