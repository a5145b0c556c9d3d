import pytest


@pytest.fixture(scope="session")
def repository(tmp_path_factory):
    """The default model repository, exported once for the whole run (the real exporter)."""
    from export.cli import main

    path = tmp_path_factory.mktemp("repo") / "model_repository"
    assert main(["--repository", str(path)]) == 0
    return path
