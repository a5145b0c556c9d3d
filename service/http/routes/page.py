"""GET /: the page that shows attention (service/static: plain HTML, CSS and ES modules served by the
service itself; no CDN and no build step, so it works on a machine without internet).

The page is public, as /docs is: it holds no data. The JSON endpoints it calls keep their API keys; the page
asks for the key and keeps it in the tab's sessionStorage.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
# The page loads nothing from any other host, and the browser holds it to that. The favicon is a data: URL
# (no request for /favicon.ico).
_CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    # no-cache: a browser revalidates (ETag), so a new version of the service shows its new page.
    return FileResponse(STATIC_DIR / "index.html",
                        headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"})


def install(app: FastAPI) -> None:
    """GET / and the page's files under /static; neither needs an API key."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(router)
