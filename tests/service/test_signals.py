"""The signal handlers take no lock. Python runs a handler in the main thread between two bytecodes of
whatever that thread was doing; a lock that code held, taken again by the handler, never comes free.
prometheus_client's are plain locks: SIGTERM under load once hung a worker of ATTEND_WORKERS=2 for good
(test_workers in CI), its handler setting the readiness gauge while the event loop was counting a request.
Here the interrupted code holds the lock for sure: the handler is called from inside it."""

import signal
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.supervisors import multiprocess

from service.http.app import create_app
from service.http.server import Supervisor
from tests.server import free_port, graceful_in_thread


def test_sigterm_on_a_loop_that_holds_the_metrics_lock_turns_readiness_off(settings):
    app = create_app(settings.model_copy(update={"port": free_port()}))
    url = f"http://127.0.0.1:{app.state.settings.port}"
    with graceful_in_thread(app) as (server, thread):  # not the main thread: no handlers installed
        assert httpx.get(f"{url}/health/ready").status_code == 200
        dataplane = app.state.dataplane
        lock = dataplane.metrics.ready._value._lock  # the readiness gauge's (a MutexValue's)
        returned = threading.Event()

        def counting_when_the_signal_comes() -> None:  # on the event loop, as the handler would be
            with lock:
                server.handle_exit(signal.SIGTERM, None)
                returned.set()

        loop = dataplane.scheduler.loop
        loop.call_soon_threadsafe(counting_when_the_signal_comes)
        if not returned.wait(5):
            lock.release()  # free the loop (a plain lock: any thread may), then fail
            pytest.fail("the SIGTERM handler waited for the lock the code it interrupted held")
        assert server.should_exit
        # Readiness off at the loop's next turn, the gauge with it. (Not asked over HTTP: the server, told
        # to exit, closes its listener 0.5 s on; test_workers asks a real process its readiness after SIGTERM.)
        deadline = time.monotonic() + 5
        while dataplane.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not dataplane.ready and dataplane.metrics.ready._value.get() == 0
    assert not thread.is_alive()


def test_the_supervisors_sigterm_takes_no_lock_and_stops_it(settings):
    handlers = {sig: signal.getsignal(sig) for sig in multiprocess.SIGNALS}  # the supervisor installs its own
    try:
        supervisor = Supervisor(uvicorn.Config("service.asgi:create_app", factory=True, workers=2), sockets=[])
        cond = supervisor.should_exit._cond  # what the supervisor's loop holds around its wait(0.5)
        returned = threading.Event()

        def waiting_when_the_signal_comes() -> None:
            with cond:
                supervisor._stop(signal.SIGTERM, None)
                returned.set()

        helper = threading.Thread(target=waiting_when_the_signal_comes, daemon=True)
        helper.start()
        if not returned.wait(5):
            cond.release()  # Event's condition is over a plain lock: free the helper, then fail
            pytest.fail("the supervisor's SIGTERM handler waited for the lock its loop held")
        helper.join(timeout=5)
        assert not supervisor.should_exit.is_set()  # not yet: its loop's next turn
        supervisor.handle_signals()  # what the loop does after each wait
        assert supervisor.should_exit.is_set()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
