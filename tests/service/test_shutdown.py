"""What SIGTERM does to the listener: after its accept window it answers no new handshake, takes the
connections the kernel completed, and only then closes. A listening socket closed with connections in
its queue resets them: each had connected and sent its request, and would be lost unanswered (CI once
saw one of test_workers' clients reset so; `python bench/sigterm_drops.py` counts them under load)."""

import signal
import socket

import service.http.server as server_module
from service.http.app import create_app
from service.http.server import refuse_handshakes
from tests.server import free_port, graceful_in_thread


def connects(port: int, timeout: float = 0.3) -> bool | None:
    """Whether a new connection is established (True), refused (False), or left unanswered (None)."""
    with socket.socket() as s:
        s.settimeout(timeout)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return False
        except TimeoutError:
            return None
        return True


def test_a_listener_that_refuses_handshakes_keeps_its_queue():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        queued = socket.create_connection(("127.0.0.1", port))
        assert refuse_handshakes(listener)
        assert connects(port) is None  # its SYN dropped: no connection to reset later
        accepted, _ = listener.accept()  # the one completed before is still there, and works both ways
        with queued, accepted:
            queued.sendall(b"ping")
            assert accepted.recv(4) == b"ping"
            accepted.sendall(b"pong")
            assert queued.recv(4) == b"pong"
    assert connects(port) is False  # closed: the client's next SYN is refused


def test_shutdown_answers_what_was_queued_and_refuses_the_rest(settings, monkeypatch):
    app = create_app(settings.model_copy(update={"port": free_port()}))
    port = app.state.settings.port
    seen = []

    def refusing(listener: socket.socket) -> bool:
        # On the server's loop, its accept window over: a connection completed now waits in the queue
        # (the loop is here), with its request sent. Then the handshakes are refused.
        queued = socket.create_connection(("127.0.0.1", port))
        queued.sendall(b"GET /health/live HTTP/1.1\r\nHost: attend\r\nConnection: close\r\n\r\n")
        refused = refuse_handshakes(listener)
        seen.append((listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN), refused, connects(port), queued))
        return refused

    monkeypatch.setattr(server_module, "refuse_handshakes", refusing)
    with graceful_in_thread(app) as (server, thread):
        loop = app.state.dataplane.scheduler.loop
        loop.call_soon_threadsafe(server.handle_exit, signal.SIGTERM, None)
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert len(seen) == 1, seen  # the one listener
    listening, refused, connected, queued = seen[0]
    # Still listening when the handshakes were refused; a connection tried then was not established.
    assert (listening, refused, connected) == (1, True, None)
    with queued:  # the queued connection was taken in and answered, not reset at the close
        queued.settimeout(5)
        answer = b"".join(iter(lambda: queued.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert connects(port) is False


def test_elsewhere_the_listener_closes_as_before(monkeypatch):
    monkeypatch.setattr(server_module.sys, "platform", "darwin")  # no socket filters there
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        assert refuse_handshakes(listener) is False
        assert connects(listener.getsockname()[1]) is True
