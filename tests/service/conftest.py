import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.http.app import create_app
from tests.server import running_service


@pytest.fixture(scope="session")
def settings(repository):
    return Settings(model_repository=repository, device="cpu", intra_op_threads=1)


@pytest.fixture(scope="session")
def app_client(settings):
    with TestClient(create_app(settings)) as client:  # `with`: the lifespan loads the models
        yield client


@pytest.fixture(scope="session")
def client(app_client):
    return app_client


# The same API from three servers: the app in-process (Starlette's TestClient), `python -m service`
# (the service's own HTTP protocol and process), and the plain uvicorn CLI with the app's factory (none
# of the service's protocol: every extension falls back to plain ASGI).
SERVERS = {
    "in-process": None,
    "python -m service": [sys.executable, "-m", "service"],
    "uvicorn --factory": [sys.executable, "-m", "uvicorn", "--factory", "service.asgi:create_app",
                          "--host", "127.0.0.1", "--port", "{port}", "--no-access-log"],
}


@pytest.fixture(scope="session", params=list(SERVERS))
def served(request, repository, app_client):
    """A client of each server in turn (httpx's API: TestClient is an httpx.Client)."""
    command = SERVERS[request.param]
    if command is None:
        yield app_client
        return
    with running_service(repository, command=command, ATTEND_INTRA_OP_THREADS="1") as (url, _), \
            httpx.Client(base_url=url, timeout=30) as http:
        yield http
