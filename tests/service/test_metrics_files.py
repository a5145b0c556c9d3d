"""With workers, every process's metrics live in files of one folder (prometheus_client's multiprocess mode),
and a scrape reads them all. A worker that dies is replaced; its counters and histograms are folded into the
files of the dead (service.core.metrics.fold_dead_worker), so the totals hold what it counted and a scrape
reads a file a kind, not one for every worker that ever ran."""

from __future__ import annotations

import os
import threading

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from service.core import metrics
from service.core.metrics import Metrics, fold_dead_worker


def _write(folder, kind: str, pid: int, values: dict[tuple[str, str], float]) -> None:
    """A process's file: `values` by (sample name, model label); it appears whole (a scrape meanwhile would read
    it half made: prometheus_client's own race, as a worker starts)."""
    path = folder / f"{kind}_{pid}.db"
    file = MmapedDict(str(path) + ".new")
    family = {"counter": "attend_requests", "histogram": "attend_inference_seconds"}.get(kind,
                                                                                       "attend_requests_in_flight")
    for (name, model), value in values.items():
        labels = {"model": model, "le": "0.5"} if name.endswith("_bucket") else {"model": model}
        file.write_value(mmap_key(family, name, list(labels), list(labels.values()), "help"), value, 0.0)
    file.close()
    os.replace(str(path) + ".new", path)


def _scraped(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) if family.name.startswith("attend")
            for s in family.samples}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics, "MULTIPROCESS", True)
    for pid in (101, 102, 103):  # three workers' counters and histograms; 103 alive, with a live gauge
        _write(tmp_path, "counter", pid, {("attend_requests_total", "additive"): pid,
                                          ("attend_requests_total", f"only_{pid}"): 1.0})
        _write(tmp_path, "histogram", pid, {("attend_inference_seconds_bucket", "additive"): 2.0 * pid,
                                            ("attend_inference_seconds_sum", "additive"): 0.25 * pid})
    _write(tmp_path, "gauge_livesum", 103, {("attend_requests_in_flight", ""): 3.0})
    return tmp_path


def test_dead_workers_fold_into_one_file_a_kind_and_the_totals_hold(folder):
    before = _scraped(Metrics().exposition())
    assert before[("attend_requests_total", (("model", "additive"),))] == 101 + 102 + 103
    _write(folder, "counter", 999, {("attend_requests_total", "stale"): 9.0})  # a fold cut short left its new file
    os.rename(folder / "counter_999.db", folder / "counter_dead.db.new")
    fold_dead_worker(101)
    fold_dead_worker(102)
    assert _scraped(Metrics().exposition()) == before
    assert sorted(os.listdir(folder)) == ["counter_103.db", "counter_dead.db", "fold.lock", "gauge_livesum_103.db",
                                          "histogram_103.db", "histogram_dead.db"]
    fold_dead_worker(103)  # the last: its live gauge is mark_process_dead's, not folded
    assert _scraped(Metrics().exposition()) == before
    assert sorted(os.listdir(folder)) == ["counter_dead.db", "fold.lock", "gauge_livesum_103.db", "histogram_dead.db"]


def test_a_scrape_while_workers_fold_sees_every_count_once(folder):
    """The fold writes the sum, then removes the worker's files: a scrape between the two, unlocked, counted the
    worker twice (or, the other way round, not at all; prometheus_client raised on a counter's file gone)."""
    expected = _scraped(Metrics().exposition())
    seen, errors, done = [], [], threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                seen.append(_scraped(Metrics().exposition()))
            except Exception as e:  # a file gone between the folder's listing and its read
                errors.append(repr(e))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for pid in range(1000, 1200):  # workers that come and go, each counted and folded
            _write(folder, "counter", pid, {("attend_requests_total", "additive"): 1.0})
            expected[("attend_requests_total", (("model", "additive"),))] += 1
            fold_dead_worker(pid)
    finally:
        done.set()
        scraper.join()
    assert _scraped(Metrics().exposition()) == expected
    assert errors == []
    totals = [s[("attend_requests_total", (("model", "additive"),))] for s in seen]
    assert len(totals) > 10 and totals == sorted(totals), "a count went down: a worker counted twice, then once"


def test_a_file_a_worker_has_just_made_is_left_out_of_the_scrape(folder):
    """prometheus_client opens a worker's file, then sizes it: a scrape between the two read an empty file, and
    raised struct.error (the scrape answered 500). Such a file holds no values yet: it is left out."""
    before = _scraped(Metrics().exposition())
    (folder / "counter_104.db").touch()
    assert _scraped(Metrics().exposition()) == before
    assert before[("attend_requests_total", (("model", "additive"),))] == 101 + 102 + 103
