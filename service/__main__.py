"""`python -m service`: uvicorn with the settings of the environment (ATTEND_*).

The models are loaded before uvicorn starts, so a repository that cannot be served stops the
process with a one-line reason and exit code 1, before any port is open.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from service.app import create_app, load_registry
from service.config import get_settings
from service.middleware import RequestIdFilter
from service.runtime import StartupError

log = logging.getLogger("service")


def main() -> int:
    settings = get_settings()
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])
    try:
        registry = load_registry(settings)
    except StartupError as e:
        log.critical("cannot start: %s", e)
        return 1
    # Our access log (service.access) carries the request ID; uvicorn's would repeat it without.
    common = {"host": settings.host, "port": settings.port, "log_level": settings.log_level, "access_log": False}
    if settings.workers == 1:
        uvicorn.run(create_app(settings, registry), **common)
    else:
        # Each worker process loads its own sessions; the load above was the check.
        del registry
        uvicorn.run("service.app:create_app_from_env", factory=True, workers=settings.workers, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
