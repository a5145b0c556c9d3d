import os
import shutil

import pytest

# Every service a test starts serves gRPC only where the test gives it a port (tests/service/test_grpc.py
# gives a free one): the default, 8001, would be wanted by every run on the machine at once.
os.environ.setdefault("ATTEND_GRPC_PORT", "0")
# The tests' own setting, taken out of the environment the services they start inherit: a service refuses to
# start on an ATTEND_* variable that is not one of its settings.
TEST_REPOSITORY = os.environ.pop("ATTEND_TEST_REPOSITORY", "")


@pytest.fixture(scope="session")
def repository(tmp_path_factory):
    """The default model repository, exported once for the whole run (the real exporter); or a copy of
    ATTEND_TEST_REPOSITORY, one exported elsewhere (a GPU machine whose torch is not the export extra's)."""
    from export.cli import main

    path = tmp_path_factory.mktemp("repo") / "model_repository"
    if TEST_REPOSITORY:
        shutil.copytree(TEST_REPOSITORY, path)
        return path
    assert main(["--repository", str(path)]) == 0
    return path


def installed(program: str, package: str) -> str:
    """The path of `program`, one `make tools` installs (Debian's `package`): without it the test fails,
    saying so, rather than skip on a machine that should run it (`make test` runs `make tools` first)."""
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed: `make tools` (which `make test` runs) installs it "
                    f"(apt-get install {package})", pytrace=False)
    return path


@pytest.fixture(scope="session")
def strace():
    """strace, for the tests that count a process's system calls."""
    return installed("strace", "strace")


@pytest.fixture(scope="session")
def wrk():
    """wrk, the load generator of bench/loadgen.py and the bench scripts that use it."""
    return installed("wrk", "wrk")
