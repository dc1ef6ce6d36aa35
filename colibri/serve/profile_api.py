"""Each turn's profile over HTTP (colibri/engine/turn_profile.py): the `colibri` field the API
routes add to their answers, and the last turns' profiles for the dashboard and for scripts.

    GET /v1/profile           {"object": "list", "data": [the last 120 turns' profiles, oldest first]}
    GET /v1/profile?limit=N   the last N of them
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from colibri.serve.errors import bad_request
from colibri.serve.state import ServerState

router = APIRouter()


def profile_field(generations: list) -> dict | None:
    """A response's `colibri` field: its turn's profile; with n choices (each its own turn),
    {"choices": [each choice's profile]}."""
    if len(generations) == 1:
        return generations[0].profile
    return {"choices": [g.profile for g in generations]}


@router.get("/v1/profile")
async def profiles(request: Request, limit: int | None = None):
    state: ServerState = request.app.state.colibri
    if limit is not None and limit < 0:
        raise bad_request(f"'limit' must be >= 0, not {limit}", param="limit")
    data = state.engine.profiles()
    if limit is not None:
        data = data[len(data) - limit:] if limit else []
    return {"object": "list", "data": data}
