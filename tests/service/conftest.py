import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.http.app import create_app


@pytest.fixture(scope="session")
def settings(repository):
    return Settings(model_repository=repository, device="cpu", intra_op_threads=1)


@pytest.fixture(scope="session")
def client(settings):
    with TestClient(create_app(settings)) as client:  # `with`: the lifespan loads the models
        yield client
