"""TLS on gRPC (ATTEND_GRPC_TLS_*), against the real process with certificates made by openssl (`make tools`):
tritonclient over TLS gives the book's numbers and a plain client is refused, without a log line of grpc's
for its failed handshake; mutual TLS refuses a client
without a certificate; a file that cannot be used stops the start in one line; a connection that never
handshakes is closed after ATTEND_HEADER_TIMEOUT_S, with TLS or without."""

import json
import shutil
import socket
import subprocess
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.http.schemas import toy_request
from tests.server import free_port, running_service
from tests.service.test_grpc import BOOK_OUTPUTS, _inputs
from tests.service.test_settings import _start
from tests.service.test_v2 import _arrays

pytestmark = pytest.mark.slow


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, and a server (for 127.0.0.1) and a client certificate it signed: P-256 keys, valid a day."""
    assert shutil.which("openssl"), "openssl is missing: `make tools` installs it"
    folder = tmp_path_factory.mktemp("tls")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=attend test CA",
             cwd=folder)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, extension in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=attend test {name}",
                 cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "1", *extension, cwd=folder)
    return folder


def _book(client):
    result = client.infer("additive", _inputs(grpcclient, _arrays(json.dumps(toy_request()).encode())[1]))
    np.testing.assert_allclose(result.as_numpy("outputs"), BOOK_OUTPUTS, rtol=1e-6)


def test_tls_serves_the_book_and_refuses_a_plain_client(repository, certs, tmp_path):
    port = free_port()
    log = tmp_path / "service.log"
    # GRPC_VERBOSITY empty, as unset: grpc's own INFO lines would show (this process's import of the service
    # set it for itself and its children).
    with running_service(repository, log_path=log, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_LOG_LEVEL="info", GRPC_VERBOSITY="", ATTEND_GRPC_TLS_CERT=str(certs / "server.crt"),
                         ATTEND_GRPC_TLS_KEY=str(certs / "server.key")):
        address = f"127.0.0.1:{port}"
        _book(grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(certs / "ca.crt")))
        credentials = grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(InferenceServerException) as error:  # plain HTTP/2 to a TLS port
            grpcclient.InferenceServerClient(address).is_server_live(client_timeout=5)
        assert error.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    text = log.read_text()
    assert f"gRPC (Triton's GRPCInferenceService) on 127.0.0.1:{port}, TLS" in text
    # The plain client's failed handshake: grpc's C core logged a line for each (any client could fill the log).
    assert "Handshake failed" not in text, text


def test_mutual_tls_refuses_a_client_without_a_certificate(repository, certs):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_GRPC_TLS_CERT=str(certs / "server.crt"), ATTEND_GRPC_TLS_KEY=str(certs / "server.key"),
                         ATTEND_GRPC_TLS_CLIENT_CA=str(certs / "ca.crt")):
        address = f"127.0.0.1:{port}"
        _book(grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(certs / "ca.crt"),
                                               private_key=str(certs / "client.key"),
                                               certificate_chain=str(certs / "client.crt")))
        with pytest.raises(InferenceServerException) as error:
            grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(certs / "ca.crt")).infer(
                "additive", _inputs(grpcclient, _arrays(json.dumps(toy_request()).encode())[1]), client_timeout=5)
        assert error.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


BAD = [
    ("cert-alone", {"ATTEND_GRPC_TLS_CERT": "server.crt"},
     "ATTEND_GRPC_TLS_KEY: Value error, ATTEND_GRPC_TLS_CERT and ATTEND_GRPC_TLS_KEY go together: set both, or "
     "neither"),
    ("the-clients-key", {"ATTEND_GRPC_TLS_CERT": "server.crt", "ATTEND_GRPC_TLS_KEY": "client.key"},
     "ATTEND_GRPC_TLS_KEY: Value error, the key is not the certificate's (KEY_VALUES_MISMATCH)"),
    ("no-such-file", {"ATTEND_GRPC_TLS_CERT": "nope.crt", "ATTEND_GRPC_TLS_KEY": "server.key"},
     "ATTEND_GRPC_TLS_KEY: Value error, {certs}/nope.crt cannot be read: No such file or directory"),
    ("not-pem", {"ATTEND_GRPC_TLS_CERT": "server.ext", "ATTEND_GRPC_TLS_KEY": "server.key"},
     "ATTEND_GRPC_TLS_KEY: Value error, not a PEM certificate chain and its key (PEM lib)"),
    ("ca-alone", {"ATTEND_GRPC_TLS_CLIENT_CA": "ca.crt"},
     "ATTEND_GRPC_TLS_CLIENT_CA: Value error, needs ATTEND_GRPC_TLS_CERT and ATTEND_GRPC_TLS_KEY: mutual TLS is "
     "TLS first"),
    ("ca-not-pem", {"ATTEND_GRPC_TLS_CERT": "server.crt", "ATTEND_GRPC_TLS_KEY": "server.key",
                    "ATTEND_GRPC_TLS_CLIENT_CA": "server.ext"},
     "ATTEND_GRPC_TLS_CLIENT_CA: Value error, not a PEM CA certificate (NO_CERTIFICATE_OR_CRL_FOUND)"),
]


@pytest.mark.parametrize("case, settings, said", BAD, ids=[c[0] for c in BAD])
def test_a_file_that_cannot_be_used_stops_the_start_in_one_line(repository, certs, case, settings, said):
    result = _start(repository, **{name: str(certs / value) for name, value in settings.items()})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"cannot start: {said.format(certs=certs)}"), lines[0]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_connection_that_never_handshakes_is_closed(repository, certs, tls):
    """grpc's own bound is 120 s: a client could hold ATTEND_MAX_OPEN_CONNECTIONS connections that long."""
    port = free_port()
    settings = {"ATTEND_GRPC_TLS_CERT": str(certs / "server.crt"),
                "ATTEND_GRPC_TLS_KEY": str(certs / "server.key")} if tls else {}
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_HEADER_TIMEOUT_S="1", **settings):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(10)
            start = time.monotonic()
            try:
                while sock.recv(4096):  # what the server sends first (HTTP/2's settings), then its close
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - start < 5
