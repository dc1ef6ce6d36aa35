"""The dashboard (`GET /` of `colibri serve`) driven in a real headless Chromium (Debian's
`chromium` package, through Playwright's driver from PyPI; no browser is downloaded), against a
real server running a small synthetic MoE whose experts stream from disk (--ram-gb below the
model's size): the page loads, a message streams in, Stop cancels on the server, the tier bar and
the expert heat map change while a request runs, the last turn's profile is drawn when it ends,
and with --api-key the page asks for the key.
Screenshots of each step are written to test-artifacts/dashboard/ at the repository root.

The telemetry JSON itself (/v1/telemetry) is checked with plain HTTP, as a script would read it.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from requirements import missing

SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
KEY = "dashboard-test-key"


def _chromium() -> str | None:
    for name in (os.environ.get("COLIBRI_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright import sync_api
    except ImportError:
        missing("playwright is not installed (pip install playwright)")
    exe = _chromium()
    if exe is None:
        missing("no Chromium on this machine (apt-get install chromium, or set COLIBRI_CHROMIUM)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from tools.synthetic_moe import write_container

    return write_container(tmp_path_factory.mktemp("dash") / "small-moe", "small", progress=False)


def _streaming_budget_gb(model_dir: Path) -> str:
    """Dense weights plus a third of the experts: most tokens read some experts from disk."""
    from colibri.io.container import Container

    c = Container(model_dir)
    return f"{(c.dense_bytes + c.expert_bytes / 3) / 2 ** 30:.4f}"


@pytest.fixture(scope="module")
def moe_server(start_server, moe_model):
    return start_server("--max-tokens", "2048", "--no-persist", "--ram-gb", _streaming_budget_gb(moe_model),
                        model_dir=moe_model)


@pytest.fixture()
def page(browser):
    # bypass_csp: Playwright's wait_for_function evaluates strings, which the page's own
    # Content-Security-Policy forbids (test_page_is_public_and_locked_down checks that policy).
    context = browser.new_context(viewport={"width": 1400, "height": 860}, bypass_csp=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.errors = errors
    yield pg
    context.close()


def _shot(pg, name: str) -> None:
    pg.screenshot(path=str(SHOTS / f"{name}.png"))


def _max_tokens(pg, n: int) -> None:
    if not pg.eval_on_selector("#settings", "d => d.open"):
        pg.click("#settings summary")
    pg.fill("#max-tokens", str(n))


def _brain_total(pg) -> int:
    return int(pg.eval_on_selector("#brain", "c => c.dataset.total || '0'"))


def test_telemetry_json_describes_tiers_experts_and_slots(moe_server):
    t = httpx.get(moe_server.url + "/v1/telemetry", timeout=30).json()
    tiers = {x["tier"]: x for x in t["tiers"]}
    assert set(tiers) == {"vram", "ram", "disk"}
    assert 0 < tiers["ram"]["expert_bytes"] < tiers["disk"]["expert_bytes"]  # streaming: RAM holds a part
    assert tiers["ram"]["dense_bytes"] == tiers["disk"]["dense_bytes"] > 0
    e = t["experts"]
    assert len(e["layers"]) == 4 and all(len(l["counts"]) == len(l["places"]) == 16 for l in e["layers"])
    assert set("".join(l["places"] for l in e["layers"])) <= set(e["places"])
    assert t["scheduler"]["slots"][0]["busy"] is False and t["model"]["max_tokens"] == 2048
    # a request, so the store has looked experts up (the start-up warm-up does only when numba compiles)
    httpx.post(moe_server.url + "/v1/completions", json={"model": t["model"]["id"], "prompt": "Hi", "max_tokens": 1},
               timeout=120).raise_for_status()
    small = httpx.get(moe_server.url + "/v1/telemetry", params={"experts": "false"}, timeout=30).json()
    assert "layers" not in small["experts"] and small["experts"]["hit_rate"] is not None


def test_page_is_public_and_locked_down(moe_server):
    r = httpx.get(moe_server.url + "/", timeout=30)
    assert r.status_code == 200 and "<title>colibri</title>" in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    for asset in ("/web/app.js", "/web/app.css", "/web/vendor/marked.umd.js", "/web/vendor/purify.min.js",
                  "/web/vendor/highlight.min.js"):
        assert httpx.get(moe_server.url + asset, timeout=30).status_code == 200, asset
    assert httpx.get(moe_server.url + "/web/../pyproject.toml", timeout=30).status_code == 404


def test_chat_streams_stops_and_telemetry_moves(moe_server, page):
    page.goto(moe_server.url + "/")
    page.wait_for_selector("#conn.live", timeout=20000)
    page.wait_for_function("document.getElementById('brain').dataset.updates >= 1", timeout=20000)
    assert page.locator("#tiers .tier").count() == 3 and "RAM: dense" in page.inner_text("#tiers")
    total_before = _brain_total(page)
    _max_tokens(page, 2000)
    page.fill("#prompt", "Tell me a long story about a hummingbird.")
    page.click("#send")
    # Streamed: text is on the page while the generation still runs (Stop enabled).
    page.wait_for_function("document.querySelector('.msg.assistant:last-child .content').textContent.length > 40"
                           " && !document.getElementById('stop').disabled", timeout=60000)
    # The heat map counts the running request's routing, and the read rate shows the disk.
    page.wait_for_function(f"Number(document.getElementById('brain').dataset.total) > {total_before}"
                           " && !document.getElementById('stop').disabled", timeout=30000)
    page.wait_for_function("parseFloat(document.getElementById('read-mb-s').textContent) > 0"
                           " && !document.getElementById('stop').disabled", timeout=30000)
    _shot(page, "1-streaming")
    cancelled = moe_server.health()["cancelled"]
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:last-child .stats", timeout=30000)
    assert page.inner_text(".msg.assistant:last-child .stats").startswith("stopped after")
    deadline = time.monotonic() + 30
    while moe_server.health()["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.2)
    assert moe_server.health()["cancelled"] == cancelled + 1, "Stop did not cancel the generation on the server"
    assert moe_server.health()["active"] == 0
    _shot(page, "2-stopped")

    # The next turn runs to its end: per-turn stats, and the conversation survives a reload.
    _max_tokens(page, 24)
    page.fill("#prompt", "And a short one?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant:nth-child(4) .stats", timeout=60000)
    stats = page.inner_text(".msg.assistant:nth-child(4) .stats")
    assert "tok/s" in stats and "TTFT" in stats and "prefilled" in stats and "expert hit rate" in stats, stats
    _shot(page, "3-finished")
    # The last turn's panel shows that turn's profile (/v1/profile): its time split by phase
    # (experts stream, so the phase clock ran), the hit rate, and the routing entropy per layer.
    last = httpx.get(moe_server.url + "/v1/profile", params={"limit": 1}, timeout=30).json()["data"][0]
    page.wait_for_function(f"document.getElementById('last-turn').dataset.turn === '{last['turn']}'", timeout=20000)
    assert page.locator("#turn-split i").count() == 7 and "routed experts" in page.inner_text("#turn-legend")
    assert f"#{last['turn']}: " in page.inner_text("#turn-note")
    assert "hit rate: RAM" in page.inner_text("#turn-cache")
    assert page.locator("#turn-entropy i").count() == 4  # the small preset's MoE layers
    page.locator("#last-turn").scroll_into_view_if_needed()
    _shot(page, "3b-last-turn")
    page.reload()
    page.wait_for_selector(".msg.assistant:nth-child(4) .stats", timeout=20000)
    assert page.inner_text(".msg.user:first-child") == "Tell me a long story about a hummingbird."
    assert not page.errors, page.errors


def test_markdown_is_rendered_and_sanitized(moe_server, page):
    """The renderer on its own, fed what a model could write: code is highlighted, markup that
    could run script is removed."""
    page.goto(moe_server.url + "/")
    page.wait_for_selector("#conn.live", timeout=20000)
    html = page.evaluate("""() => { const el = document.createElement('div');
        markdown(el, '# Title\\n\\n```python\\ndef f():\\n    return 1\\n```\\n\\n<img src=x onerror="window.pwned=1">'
                     + '<script>window.pwned=2</script> **bold**');
        document.body.append(el); return el.innerHTML; }""")
    assert "<h1>Title</h1>" in html and "hljs" in html and "<strong>bold</strong>" in html
    assert "onerror" not in html and "<script" not in html
    assert page.evaluate("() => window.pwned === undefined")


def test_heat_map_stays_light_at_kimi_k2_shapes(moe_server, page):
    """64 MoE layers x 384 experts (Kimi-K2's routed experts): a whole telemetry frame (tiers,
    heat map, charts, slots) renders in well under the one second between frames."""
    page.goto(moe_server.url + "/")
    # The first frame drawn (the stream is "live" from its response headers on, a moment earlier)
    page.wait_for_function("document.getElementById('brain').dataset.updates >= 1", timeout=20000)
    ms = page.evaluate("""() => {
        const t = JSON.parse(JSON.stringify(app.telemetry));
        t.experts.layers = [];
        for (let l = 0; l < 64; l++) {
            const counts = [], places = [];
            for (let e = 0; e < 384; e++) { counts.push((l * 7919 + e * 104729) % 5000); places.push('pc-r'[(l + e) % 4]); }
            t.experts.layers.push({prefix: 'model.layers.' + l + '.mlp', counts, places: places.join('')});
        }
        const text = JSON.stringify(t);
        const t0 = performance.now();
        for (let i = 0; i < 20; i++) renderTelemetry(JSON.parse(text));
        return (performance.now() - t0) / 20; }""")
    canvas = page.eval_on_selector("#brain", "c => [c.width, c.height]")
    assert canvas == [384, 64]
    _shot(page, "4-kimi-k2-heat-map")
    assert ms < 100, f"a telemetry frame at 64 x 384 took {ms:.1f} ms to render"


def test_the_page_asks_for_the_api_key(start_server, moe_model, browser, page):
    srv = start_server("--max-tokens", "16", "--no-persist", api_key=KEY, model_dir=moe_model)
    # The page is public and holds no secret; the API behind it is not.
    r = httpx.get(srv.url + "/", timeout=30)
    assert r.status_code == 200 and KEY not in r.text
    assert httpx.get(srv.url + "/v1/telemetry", timeout=30).status_code == 401
    assert httpx.get(srv.url + "/v1/telemetry/stream", timeout=30).status_code == 401
    assert httpx.get(srv.url + "/v1/profile", timeout=30).status_code == 401
    page.goto(srv.url + "/")
    page.wait_for_selector("#key-dialog[open]", timeout=20000)
    page.fill("#key-input", "wrong-key")
    page.click("#key-ok")
    page.wait_for_function("document.getElementById('key-error').textContent.includes('refused')", timeout=20000)
    page.fill("#key-input", KEY)
    page.click("#key-ok")
    page.wait_for_selector("#conn.live", timeout=20000)
    page.fill("#prompt", "Hi")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .stats", timeout=60000)
    assert "tok/s" in page.inner_text(".msg.assistant .stats")
    _shot(page, "5-api-key")
    assert not page.errors, page.errors
