"""GET /: the dashboard, plain static files shipped in the package (server/static/).

No build step and nothing fetched from elsewhere: the page is HTML, CSS and
one script; its charts are inline SVG. It reads GET /events and calls the
same routes a client would. The files carry no data, so serving them needs
nothing from the engine or the job store.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from dreamstage.server.errors import APIError

router = APIRouter()

STATIC_DIR = Path(__file__).resolve().parent / "static"
# Only these files are served: a fixed list, so no path from the URL reaches the filesystem.
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=NO_CACHE)


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str):
    media = ASSETS.get(name)
    if media is None:
        raise APIError(404, f"no dashboard file {name!r}", "name", "not_found")
    return FileResponse(STATIC_DIR / name, media_type=media, headers=NO_CACHE)
