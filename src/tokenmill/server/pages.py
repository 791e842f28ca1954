"""The web pages `tokenmill serve` ships: the playground at `/` and the live dashboard at `/dashboard`,
static HTML/CSS/JS from `server/static` (no build step; uPlot vendored under `static/vendor` with its
licence). They load without the API key; the API calls they make carry it."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/static/"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}


def mount_pages(app: FastAPI) -> None:
    """Serve the pages and /static/* on `app`."""
    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="static")
    for path, name in PAGES.items():
        app.add_api_route(path, _page(STATIC_DIR / name), methods=["GET"], include_in_schema=False)


def _page(file: Path):
    async def page() -> FileResponse:
        return FileResponse(file, media_type="text/html", headers={"Cache-Control": "no-cache"})
    return page
