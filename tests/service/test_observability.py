"""What /metrics exports, against the real process: every family named in docs/observability.md (the list
comes from a live scrape, so the doc cannot miss one), the process metrics and the budget's gauges, and the
connection guard's refusals counted by reason."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.core.dataplane import Dataplane
from service.core.metrics import REFUSALS
from service.http.schemas import toy_request
from tests.server import running_service
from tests.service.test_overload import connect, read_response

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
TOY = json.dumps(toy_request())
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def service(repository):
    """One process for the module: one request in progress at most (the refusal test holds it), a small
    header limit, a budget of its own."""
    with running_service(repository, ATTEND_MAX_CONNECTIONS="1", ATTEND_MAX_HEADER_BYTES="4096",
                         ATTEND_MAX_INFLIGHT_BYTES=str(512 * 2**20), ATTEND_MAX_QUEUE="64",
                         ATTEND_REQUEST_TIMEOUT_S="20") as (url, _):
        yield url


def scrape(url: str) -> dict[str, list]:
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def parse(text: str) -> dict[str, list]:
    """The families of a scrape: name -> its samples."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list], name: str, **labels: str) -> float:
    family = name.removesuffix("_total")
    return next(s.value for s in families[family] if s.name == name and all(s.labels.get(k) == v
                                                                           for k, v in labels.items()))


def test_every_family_of_a_live_scrape_is_documented(service):
    # A request first: the families labelled by model have their samples.
    assert httpx.post(f"{service}/attend", content=TOY, headers=JSON).status_code == 200
    text = httpx.get(f"{service}/metrics", timeout=10).text
    # Every family as the scrape names it (# TYPE: counters with their _total), but the _created gauge
    # prometheus_client adds to each counter and histogram (the doc says so once).
    exported = {name for name, _ in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
                if name.startswith(("attend_", "process_", "python_gc_")) and not name.endswith("_created")}
    assert {"attend_requests_total", "attend_request_duration_seconds", "attend_refused_total",
            "attend_inflight_bytes", "process_resident_memory_bytes", "process_cpu_seconds_total",
            "python_gc_objects_collected_total"} <= exported
    doc = DOC.read_text()
    missing = sorted(name for name in exported if not re.search(rf"`{name}(\{{[^`]*\}})?`", doc))
    assert not missing, f"docs/observability.md does not name: {missing}"


def test_process_metrics_and_the_budget_are_exported(service):
    families = scrape(service)
    assert value(families, "process_resident_memory_bytes") > 10 * 2**20
    assert value(families, "process_cpu_seconds_total") > 0
    assert value(families, "process_open_fds") > 3
    assert abs(value(families, "process_start_time_seconds") - time.time()) < 3600
    assert value(families, "attend_inflight_bytes_limit") == 512 * 2**20
    assert value(families, "attend_inflight_bytes") == 0  # nothing in flight between requests
    assert value(families, "attend_queue_limit") == 64
    assert value(families, "attend_request_timeout_seconds") == 20
    assert {s.labels["reason"] for s in families["attend_refused"]} == set(REFUSALS)  # all from the start


def test_the_budget_gauges_are_read_at_scrape_time(settings):
    """What the requests in flight hold is read when scraped: nothing on the request path sets it."""
    dataplane = Dataplane(settings)
    dataplane.budget.used = 12345
    families = parse(dataplane.metrics.exposition().decode())
    assert value(families, "attend_inflight_bytes") == 12345
    assert value(families, "attend_inflight_bytes_limit") == settings.max_inflight_bytes
    dataplane.budget.used = 0
    assert value(parse(dataplane.metrics.exposition().decode()), "attend_inflight_bytes") == 0


def test_a_guard_refusal_is_counted_by_its_reason(service):
    before = scrape(service)
    with connect(service) as holder:  # the one request in progress, its body pending
        holder.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n{")
        time.sleep(0.3)
        refused = httpx.post(f"{service}/attend", content=TOY, headers=JSON)
        assert refused.status_code == 503 and "ATTEND_MAX_CONNECTIONS" in refused.text
    time.sleep(0.3)
    with connect(service) as big:  # headers over ATTEND_MAX_HEADER_BYTES, still coming: 431
        big.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192)
        assert read_response(big)[0] == 431
    after = scrape(service)
    for reason, more in {"connections": 1, "header_size": 1, "header_timeout": 0, "body_timeout": 0}.items():
        assert value(after, "attend_refused_total", reason=reason) == \
            value(before, "attend_refused_total", reason=reason) + more, reason


def test_a_scrape_is_made_off_the_event_loop(client, monkeypatch):
    """/metrics reads /proc and, with workers, every worker's files: on a thread, never on the loop."""
    import threading

    dataplane = client.app.state.dataplane
    metrics = dataplane.metrics
    where = []

    def exposition():
        where.append(threading.get_ident())
        return type(metrics).exposition(metrics)

    monkeypatch.setattr(metrics, "exposition", exposition)
    assert "attend_requests_in_flight" in client.get("/metrics").text
    assert where and where[0] != dataplane.loop_thread
