"""The dashboard: a single page (chat + live expert telemetry) served by `colibri serve` at `/`,
from files shipped inside the package (static/; vendored libraries in static/vendor/ with their
versions and licences). The page talks to the server only through its public API: the OpenAI
chat route for answers and /v1/telemetry/stream (colibri/serve/telemetry.py) for the live view.

The page and its files are public (they hold no secrets: with --api-key the page asks for the
key and keeps it in the tab's sessionStorage); every API call it makes needs the key as any
client's does. A strict Content-Security-Policy keeps model output, already sanitized by
DOMPurify, from running scripts or loading anything from elsewhere.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
PUBLIC_PREFIX = "/web/"

# Scripts and styles only from this server; connections only back to it; no frames, no plugins.
# 'unsafe-inline' for styles: highlight.js and the heat map's legend set style attributes.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


def is_public(path: str) -> bool:
    """The page and its files: reachable without the API key (the API calls it makes are not)."""
    return path == "/" or path.startswith(PUBLIC_PREFIX)


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/web", StaticFiles(directory=STATIC), name="web")
