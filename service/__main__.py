"""`python -m service`: uvicorn with the settings of the environment (ATTEND_*)."""

from __future__ import annotations

import logging

import uvicorn

from service.config import get_settings


def main() -> None:
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        "service.app:create_app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level=settings.log_level,
        # Settings changes need a restart; no reload watcher in a service.
    )


if __name__ == "__main__":
    main()
