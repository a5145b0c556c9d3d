"""Dynamic batching is exact; the queue is bounded; deadlines and gone clients are honoured."""

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
import torch
from fastapi.testclient import TestClient

from service.core.batching import BatchLimits, Job, Scheduler
from service.core.cost import answer
from service.core.errors import ClientGone, DeadlineExceeded, NotFinite, Overloaded
from service.core.merge import merge, product_sum, run_batch, run_terms, same_shapes
from service.core.metrics import Metrics
from service.core.request import Request, finite
from service.core.runcost import RunCost
from service.core.runtime import Registry
from service.http.app import create_app
from service.http.guard import BusyConnections
from service.http.schemas import toy_request
from service.protocols.attend import attend, decode_body, encode_attend
from tests import book

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def registry(repository):
    return Registry.load(repository, "cpu", 1)


class Reference:
    """/attend decoded, and answered, in this thread with no queue (service.protocols.attend): each
    test's reference."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def decode(self, body: bytes) -> Request:
        return decode_body(body, self.registry)

    def attend(self, body: bytes) -> bytes:
        return attend(body, self.registry)


@pytest.fixture(scope="module")
def reference(registry):
    return Reference(registry)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _lens(rng, form, batch, n_q, n_k):
    if form == "absent":
        return None
    shape = (batch,) if form == "1d" else (batch, n_q)
    return rng.integers(0, n_k + 1, size=shape).tolist()


def make_body(kind, rng, batch, n_q, n_k, form, d=None, v=None):
    def arr(*shape):
        return rng.normal(size=shape).round(5).tolist()

    if kind == "self_attention":
        body = {"model": kind, "queries": arr(batch, n_q, 100)}
        n_k = n_q
    elif kind == "positional_encoding":  # no lengths; even feature sizes, grouped by size
        return json.dumps({"model": kind, "queries": arr(batch, n_q, d or 6)}).encode()
    elif kind == "masked_softmax":
        body = {"model": kind, "scores": arr(batch, n_q, n_k)}
    elif kind == "multi_head":
        body = {"model": kind, "queries": arr(batch, n_q, 100), "keys": arr(batch, n_k, 100),
                "values": arr(batch, n_k, 100)}
    elif kind == "additive":
        body = {"model": kind, "queries": arr(batch, n_q, 20), "keys": arr(batch, n_k, 2),
                "values": arr(batch, n_k, v or 3)}
    else:
        d = d or 4
        body = {"model": kind, "queries": arr(batch, n_q, d), "keys": arr(batch, n_k, d),
                "values": arr(batch, n_k, v or 5)}
    lens = _lens(rng, form, batch, n_q, n_k)
    if lens is not None:
        body["valid_lens"] = lens
    return json.dumps(body).encode()


def mixed_bodies(kind, count, seed=0):
    """Different batch sizes, n_q and n_k, every lens form (lengths 0 to n_k), and where the graph leaves
    them free different feature sizes: dot_product's d and value size, additive's value size."""
    rng = np.random.default_rng(seed)
    forms = ["absent", "1d", "2d"]
    return [make_body(kind, rng, int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 9)),
                      forms[i % 3], d=int(rng.integers(1, 17)) if kind == "dot_product" else None,
                      v=int(rng.integers(1, 9))) for i in range(count)]


def assert_same(batched: bytes, single: bytes):
    got, want = orjson.loads(batched), orjson.loads(single)
    assert got["model"] == want["model"] and set(got) == set(want)
    for key in ("outputs", "attention_weights", "P"):
        if key not in want or want[key] is None:
            assert got.get(key) is None
            continue
        a, b = np.array(got[key]), np.array(want[key])
        assert a.shape == b.shape, key
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
        if key == "attention_weights":
            assert np.array_equal(a == 0, b == 0)  # exactly the same masked keys


# --- merge and slice: exact ------------------------------------------------------------------

def like_bodies(kind, count, seed=0):
    """The same n_q and n_k (nothing to pad: stacked, service.batching's same-lengths path), different
    batch sizes and lens forms, some without the weights."""
    rng = np.random.default_rng(seed)
    forms = ["absent", "1d", "2d"]
    bodies = [make_body(kind, rng, int(rng.integers(1, 4)), 5, 7, forms[i % 3]) for i in range(count)]
    return [b[:-1] + b', "return_weights": false}' if i % 4 == 3 else b for i, b in enumerate(bodies)]


@pytest.mark.parametrize("lengths", ["mixed", "same"])
@pytest.mark.parametrize("kind", ["dot_product", "additive", "multi_head", "self_attention", "masked_softmax",
                                  "positional_encoding"])
def test_one_merged_run_equals_separate_runs(reference, kind, lengths):
    bodies = (mixed_bodies if lengths == "mixed" else like_bodies)(kind, 12, seed=len(kind))
    requests = [reference.decode(b) for b in bodies]
    jobs = [Job(r, deadline=float("inf"), encode=encode_attend) for r in requests]
    assert same_shapes(jobs) == (lengths == "same")
    feed = merge(requests[0].model, jobs)
    first = requests[0].model.inputs()[0].name  # queries, or scores
    assert feed[first].shape[0] == sum(j.rows for j in jobs)  # really one run for all
    batched, _ = run_batch(requests[0].model, jobs, Metrics())
    for body, result in zip(bodies, batched, strict=True):
        assert_same(result, reference.attend(body))


def test_merged_weights_are_exactly_zero_on_padding(reference):
    rng = np.random.default_rng(3)
    short = reference.decode(make_body("dot_product", rng, 1, 2, 3, "absent"))
    long = reference.decode(make_body("dot_product", rng, 1, 7, 8, "absent"))
    jobs = [Job(short, float("inf")), Job(long, float("inf"))]
    feed = merge(short.model, jobs)
    result = short.model.run(feed)
    outputs, weights = result["outputs"], result["attention_weights"]
    assert weights.shape == (2, 7, 8)
    assert np.all(weights[0, :, 3:] == 0)  # the short request's padded keys
    # Its padded query rows repeat its length (3, all its keys): one length a row, as each request's, so
    # the CPU graph takes the lengths per example (export.fused) rather than build a mask.
    assert feed["valid_lens"].tolist() == [[3] * 7, [8] * 7]
    np.testing.assert_allclose(weights[0, 2:, :3], 1 / 3)  # zero queries: even weights, sliced off
    assert np.all(outputs[0, 2:] == outputs[0, 2])


def _overflowing(body: bytes) -> bytes:
    """`body` (dot_product) with queries and keys of 1e38: finite float32, but q·k is past 1e76, and the answer NaN."""
    data = json.loads(body)
    data["queries"] = np.full(np.shape(data["queries"]), 1e38).tolist()
    data["keys"] = np.full(np.shape(data["keys"]), 1e38).tolist()
    return json.dumps(data).encode()


@pytest.mark.parametrize("lengths", ["mixed", "same"])
def test_a_job_whose_outputs_overflow_is_refused_and_the_rest_of_its_batch_answered(reference, lengths):
    bodies = (mixed_bodies if lengths == "mixed" else like_bodies)("dot_product", 6, seed=5)
    bodies[2] = _overflowing(bodies[2])
    jobs = [Job(reference.decode(b), deadline=float("inf"), encode=encode_attend) for b in bodies]
    assert same_shapes(jobs) == (lengths == "same")
    model = jobs[0].request.model
    results, _ = run_batch(model, jobs, Metrics())
    assert isinstance(results[2], NotFinite) and results[2].status == 422
    for i, (body, result) in enumerate(zip(bodies, results, strict=True)):
        if i != 2:
            assert_same(result, reference.attend(body))
    with pytest.raises(NotFinite, match="the outputs of dot_product for these inputs are not finite"):
        run_batch(model, jobs[2:3], Metrics())


def test_queries_the_merge_scales_past_float32_are_answered_as_alone(reference):
    """A d of 2 merged with a d of 8 has its queries scaled by 2 (service.core.merge.merge): 3e38 becomes
    infinite there, though its own scores (6e35) are finite. Its answer is the one it gets alone."""
    rng = np.random.default_rng(7)
    large = json.dumps({"model": "dot_product", "queries": [[[3e38, 3e38]]], "keys": [[[1e-3, 1e-3], [2e-3, 1e-3]]],
                        "values": [[[1.0, 2.0], [3.0, 4.0]]]}).encode()
    other = make_body("dot_product", rng, 2, 3, 2, "1d", d=8, v=2)
    jobs = [Job(reference.decode(b), deadline=float("inf"), encode=encode_attend) for b in (large, other)]
    model = jobs[0].request.model
    assert not finite(model.run(merge(model, jobs))["outputs"][0])  # in the merged run: NaN
    results, _ = run_batch(model, jobs, Metrics())
    assert_same(results[0], reference.attend(large))
    assert orjson.loads(results[0])["outputs"] == [[[3.0, 4.0]]]
    assert_same(results[1], reference.attend(other))


def _torch(x, dtype=torch.float32):
    return None if x is None else torch.tensor(np.array(x), dtype=dtype)


@pytest.mark.parametrize("kind", ["dot_product", "masked_softmax"])
def test_a_mixed_batch_gives_the_books_numbers(reference, kind):
    """Requests of every size merged into one run (dot_product: d from 1 to 16 padded, queries scaled),
    each answer against the book's PyTorch module run on that request alone. Lengths 1 to n_k and
    absent (the book fills a length of 0 with -1e6 and answers uniform weights where ours are 0: the
    alone answer is the reference of those, in test_one_merged_run_equals_separate_runs)."""
    rng = np.random.default_rng(11)
    bodies = []
    for i in range(14):
        b, n_q, n_k = (int(x) for x in rng.integers(1, 9, size=3))
        body = json.loads(make_body(kind, rng, b, n_q, n_k, ["absent", "1d", "2d"][i % 3], d=int(rng.integers(1, 17)),
                                    v=int(rng.integers(1, 9))))
        if "valid_lens" in body:
            body["valid_lens"] = np.maximum(np.array(body["valid_lens"]), 1).tolist()
        if i == 0:
            body["valid_lens"] = [n_k] * b  # full
        bodies.append(json.dumps(body).encode())
    jobs = [Job(reference.decode(b), float("inf"), encode_attend) for b in bodies]
    model = jobs[0].request.model
    if kind == "dot_product":
        assert len({j.axes["d"] for j in jobs}) > 1 and len({j.axes["value_size"] for j in jobs}) > 1
    batched, _ = run_batch(model, jobs, Metrics())
    for body, result in zip(bodies, batched, strict=True):
        sent, got = json.loads(body), orjson.loads(result)
        lens = _torch(sent.get("valid_lens"), torch.int64)
        with torch.no_grad():
            if kind == "dot_product":
                module = book.DotProductAttention(0.0).eval()
                outputs = module(_torch(sent["queries"]), _torch(sent["keys"]), _torch(sent["values"]), lens)
            else:
                outputs = book.masked_softmax(_torch(sent["scores"]), lens)
                module = type("Weights", (), {"attention_weights": outputs})
        np.testing.assert_allclose(got["outputs"], outputs.numpy(), rtol=TOLERANCE, atol=TOLERANCE)
        np.testing.assert_allclose(got["attention_weights"], module.attention_weights.numpy(), rtol=TOLERANCE,
                                   atol=TOLERANCE)
        assert_same(result, reference.attend(body))


def test_jobs_merge_unless_a_size_is_fixed_by_the_graph(reference):
    """A request's key holds only the sizes no batch pads: none for dot_product (lengths, d and value
    size all padded), the feature size d for the positional encoding (P depends on it)."""
    rng = np.random.default_rng(0)

    def key(kind="dot_product", **kw):
        args = {"batch": 1, "n_q": 2, "n_k": 3, "form": "absent"} | kw
        return Job(reference.decode(make_body(kind, rng, **args)), 0.0).key

    assert key() == key(n_k=4, batch=3) == key(d=7, v=2) == key(n_q=100, n_k=300) == ()
    assert key("additive", v=2) == key("additive", v=8, n_k=50) == ()
    assert key("positional_encoding", d=6) == key("positional_encoding", d=6, n_q=40) == (6,)
    assert key("positional_encoding", d=8) == (8,)


def test_a_jobs_elements_are_its_runs(reference, registry):
    """Job.elements (what RunCost prices) is the elements of the request's run, inputs and outputs, and
    the batcher's count of a merged run's is that of the merged feed and its outputs; Job.cost (what its
    memory is priced at) is service.core.cost.answer of its inputs, outputs and attention weights, additive
    attention's hidden units (the book's 8), and whether the weights are in the answer (less when not)."""
    rng = np.random.default_rng(4)
    for kind in ("dot_product", "additive", "multi_head", "self_attention", "masked_softmax", "positional_encoding"):
        jobs = [Job(reference.decode(b), 0.0) for b in mixed_bodies(kind, 5, seed=int(rng.integers(100)))]
        model = jobs[0].request.model
        hidden = 8 if kind == "additive" else 0
        for job in jobs:
            outputs = model.run(job.request.feed)
            inputs = sum(a.size for a in job.request.feed.values())
            assert job.elements == inputs + sum(a.size for a in outputs.values())
            weights = outputs["attention_weights"].size if "attention_weights" in outputs else 0
            sent = job.request.return_weights
            assert job.cost == answer(inputs, sum(a.size for a in outputs.values()), weights, hidden, sent)
            other = Job(dataclasses.replace(job.request, return_weights=not sent), 0.0).cost
            assert (other < job.cost if sent else other > job.cost) if weights else other == job.cost
        feed = merge(model, jobs)
        widest = tuple(max(s) for s in zip(*(j.shape for j in jobs), strict=True))
        batched, unbatched = run_terms(model)
        assert sum(j.rows for j in jobs) * product_sum(batched, widest) + product_sum(unbatched, widest) == sum(
            a.size for a in feed.values()) + sum(a.size for a in model.run(feed).values())


def test_run_cost_fits_the_warm_up_and_follows_the_runs(registry):
    """The warm-up's two timed sizes give a fixed part and a slope; runs of one size, slower, scale both
    (the padding worth a run stays); runs of spread sizes fit both again."""
    model = registry.get("dot_product")
    assert len(model.run_times) == 2 and model.run_times[0][0] < model.run_times[1][0]
    cost = RunCost([(100, 20e-6), (10_100, 40e-6)])
    assert cost.known and cost.fixed == pytest.approx(19.8e-6) and cost.per_element == pytest.approx(2e-9)
    assert cost.padding_limit() == pytest.approx(9900)
    for _ in range(300):  # three times slower, all of one size: the slope cannot be told, the line scales
        cost.observe(1000, 3 * 21.8e-6)
    assert cost.predict(1000) == pytest.approx(3 * 21.8e-6, rel=1e-3)
    assert cost.per_element == pytest.approx(6e-9, rel=1e-3) and cost.padding_limit() == pytest.approx(9900)
    for _ in range(300):
        for elements in (1000, 5000):  # 10 us + 10 ns an element
            cost.observe(elements, 10e-6 + 10e-9 * elements)
    assert cost.per_element == pytest.approx(10e-9, rel=1e-3) and cost.fixed == pytest.approx(10e-6, rel=1e-3)
    unknown = RunCost()
    assert not unknown.known and unknown.padding_limit() == 0
    unknown.observe(500, 30e-6)
    assert unknown.known and unknown.predict(500) == pytest.approx(30e-6) and unknown.padding_limit() == 0
    assert RunCost([(100, 20e-6), (10_100, 10e-6)]).padding_limit() == 0  # a slope below 0: noise, not a cost


def test_jobs_of_one_layout_share_their_sizes_and_they_are_their_own(reference, registry):
    """A layout's requests (service.protocols.attend's plans, made when the layout comes a second time) carry
    one memo, where the first Job leaves the sizes the others then take: the same as each request's own, and
    another layout's are its own."""
    from service.core.jobs import job_sizes

    rng = np.random.default_rng(1)
    for kind in ("dot_product", "additive", "multi_head", "self_attention"):
        registry.get(kind).body_plans.clear()
        registry.get(kind).body_layouts_seen.clear()
        bodies = [make_body(kind, rng, batch=2, n_q=3, n_k=5, form="1d") for _ in range(4)]
        first, *requests = [reference.decode(b) for b in bodies]
        assert first.memo is None  # the layout's first: no plan yet
        assert requests[0].memo is not None and all(r.memo is requests[0].memo for r in requests)
        jobs = [Job(r, 0.0) for r in requests]
        assert requests[0].memo["job sizes"] is not None
        for job, request in zip(jobs, requests, strict=True):
            sizes = job_sizes(request)
            assert (job.axes, job.rows, job.n_q, job.n_k, job.key, job.shape, job.elements) == sizes[:5] + sizes[6:8]
            assert job.cost == sizes[5][0 if request.return_weights else 1]
            assert job.text == sizes[8][0 if request.return_weights else 1]  # /attend: its answer is JSON
            assert (job.rows, job.n_q, job.n_k) == (2, 3, 3 if kind == "self_attention" else 5)
        other = reference.decode(make_body(kind, rng, batch=1, n_q=9, n_k=9, form="1d"))
        assert other.memo is not requests[0].memo
        assert (Job(other, 0.0).rows, Job(other, 0.0).n_q) == (1, 9)


# --- the scheduler: queue bound, deadlines, gone clients, limits ------------------------------

def _job(reference, body=None, timeout=5.0, disconnected=None):
    body = body or json.dumps(toy_request()).encode()
    return Job(reference.decode(body), time.monotonic() + timeout, encode_attend, disconnected)


class Held:
    """Every batcher of a scheduler busy, as while it runs a batch: requests wait in their queues
    until `resume()`."""

    def __init__(self, scheduler: Scheduler):
        self.batchers = list(scheduler.batchers.values())
        for batcher in self.batchers:
            batcher.stepping = True

    def resume(self) -> None:
        for batcher in self.batchers:
            batcher.stepping = False
            batcher.wake()


@contextlib.asynccontextmanager
async def busy(registry, **limits):
    """A started scheduler whose batchers are held: requests wait in its queue until the test calls
    `hold.resume()`."""
    metrics = Metrics()
    scheduler = Scheduler([registry.get(n) for n in registry.names()], BatchLimits(**limits), 1, metrics)
    scheduler.start()
    try:
        yield scheduler, metrics, Held(scheduler)
    finally:
        await scheduler.stop()


def runs(metrics, model):
    return sum(b.get() for b in metrics.batch_requests.labels(model)._buckets)


@pytest.mark.anyio
async def test_full_queue_refuses_at_once_with_retry_after(registry, reference):
    async with busy(registry, max_queue=2) as (scheduler, _, hold):
        waiting = [asyncio.create_task(scheduler.submit(_job(reference))) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert waiting[2].done()
        with pytest.raises(Overloaded) as refused:
            waiting[2].result()
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        hold.resume()
        results = await asyncio.gather(*waiting[:2])
        assert all(orjson.loads(r)["outputs"][0] == [[2.0, 3.0, 4.0, 5.0]] for r in results)
        assert scheduler.queued == 0


@pytest.mark.anyio
async def test_deadline_passing_in_the_queue_is_504_and_the_job_is_dropped(registry, reference):
    async with busy(registry) as (scheduler, metrics, hold):
        start = time.monotonic()
        late = asyncio.create_task(scheduler.submit(_job(reference, timeout=0.05)))
        patient = asyncio.create_task(scheduler.submit(_job(reference, timeout=5)))
        with pytest.raises(DeadlineExceeded):
            await late
        assert time.monotonic() - start < 1.0  # answered at its deadline, not when a slot frees
        hold.resume()
        assert orjson.loads(await patient)["model"] == "additive"
        assert metrics.batch_requests.labels("additive")._sum.get() == 1  # only the patient one ran


@pytest.mark.anyio
async def test_gone_client_is_dropped_before_its_batch_runs(registry, reference):
    async def gone():
        return True

    async with busy(registry) as (scheduler, metrics, hold):
        task = asyncio.create_task(scheduler.submit(_job(reference, disconnected=gone)))
        await asyncio.sleep(0.01)
        hold.resume()
        with pytest.raises(ClientGone):
            await task
        assert metrics.batch_requests.labels("additive")._sum.get() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("limits, expected_runs", [
    ({"max_rows": 4}, 3),  # 2 + 2 rows, 2 + 2 rows, 2 rows
    ({"max_elements": 2 * 3 * 3 * 2}, 3),  # two requests' padded weights fit, a third does not
    ({"max_elements": 2 * 3 * 3}, 5),  # one request alone already fills a run
    ({}, 1),
])
async def test_batches_respect_row_and_element_limits(registry, reference, limits, expected_runs):
    rng = np.random.default_rng(0)
    bodies = [make_body("dot_product", rng, 2, 3, 3, "absent") for _ in range(5)]
    async with busy(registry, **limits) as (scheduler, metrics, hold):
        tasks = [asyncio.create_task(scheduler.submit(_job(reference, b))) for b in bodies]
        await asyncio.sleep(0.01)
        hold.resume()
        results = await asyncio.gather(*tasks)
        for body, result in zip(bodies, results, strict=True):
            assert_same(result, reference.attend(body))
        assert metrics.batch_rows.labels("dot_product")._sum.get() == 10
        assert runs(metrics, "dot_product") == expected_runs


async def _held_runs(registry, reference, bodies, cost=None):
    """`bodies` queued together in a held scheduler, then let go: each answer checked against its own
    alone, and the session runs they took."""
    async with busy(registry) as (scheduler, metrics, hold):
        model = reference.decode(bodies[0]).model
        if cost is not None:
            scheduler.batcher_for(model).run_cost = cost
        tasks = [asyncio.create_task(scheduler.submit(_job(reference, b))) for b in bodies]
        await asyncio.sleep(0.01)
        hold.resume()
        results = await asyncio.gather(*tasks)
        for body, result in zip(bodies, results, strict=True):
            assert_same(result, reference.attend(body))
        assert scheduler.queued == 0
        return runs(metrics, model.name)


@pytest.mark.anyio
@pytest.mark.parametrize("fixed_us, runs_expected", [(100, 1), (1, 2)])
async def test_padding_is_refused_when_it_costs_more_than_a_run(registry, reference, fixed_us, runs_expected):
    """A request of 2 x 2 queries and keys (d 4, value size 5) and one of 6 x 6: padding the short one
    adds 1 x (6 x 4 + 6 x 4 + 6 x 5 + 6 + 6 x 5 + 6 x 6) - 62 = 118 elements, at 100 ns an element 11.8 us: a
    run's fixed cost of 100 us pays for it (one run), one of 1 us does not (two)."""
    rng = np.random.default_rng(5)
    bodies = [make_body("dot_product", rng, 1, 2, 2, "absent"), make_body("dot_product", rng, 1, 6, 6, "1d")]
    assert await _held_runs(registry, reference, bodies, RunCost.of(fixed_us * 1e-6, 100e-9)) == runs_expected


@pytest.mark.anyio
async def test_the_measured_cost_merges_small_requests_and_not_a_small_with_a_large_one(registry, reference):
    """With the cost the model's warm-up measured: twelve small requests of every shape (d and value
    size too) take one run; a 1 x 1 x 1 request does not pad to 256 x 256 x 64 (~131K elements a row,
    where a run's fixed cost pays for some 10-30K), and the small one after the large one merges with the
    first."""
    small = mixed_bodies("dot_product", 12, seed=3)
    assert await _held_runs(registry, reference, small) == 1
    rng = np.random.default_rng(6)
    mixed = [make_body("dot_product", rng, 1, 1, 1, "absent", d=1, v=1),
             make_body("dot_product", rng, 2, 256, 256, "1d", d=64, v=64),
             make_body("dot_product", rng, 1, 2, 2, "absent", d=2, v=1)]
    assert await _held_runs(registry, reference, mixed) == 2  # the two small ones after the large one


@pytest.mark.anyio
@pytest.mark.parametrize("warmed", [True, False])
@pytest.mark.parametrize("alone_limit, on_thread", [(1.0, False), (0.0, True)])
async def test_a_request_alone_runs_on_the_loop_under_its_own_limit(registry, reference, alone_limit, on_thread,
                                                                   warmed):
    """Batches never run on the loop here (inline_run_s 0); a request the server says is alone does,
    once its run is predicted to take less than alone_inline_run_s: from the model's warm-up runs, or
    without them (a cost not known) from the second on. Seen from the thread its encoder runs on."""
    where = []

    def encode(model, outputs, weights):
        where.append(threading.current_thread().name.startswith("inference"))
        return encode_attend(model, outputs, weights)

    scheduler = Scheduler([registry.get(n) for n in registry.names()],
                          BatchLimits(inline_run_s=0.0, alone_inline_run_s=alone_limit), 1, Metrics())
    scheduler.start()
    if not warmed:
        scheduler.batcher_for(registry.get("additive")).run_cost = RunCost()
    try:
        body = json.dumps(toy_request()).encode()
        first = await scheduler.submit(Job(reference.decode(body), time.monotonic() + 5, encode), alone=True)
        second = await scheduler.submit(Job(reference.decode(body), time.monotonic() + 5, encode), alone=True)
    finally:
        await scheduler.stop()
    assert first == second == reference.attend(body)
    assert where == [on_thread if warmed else True, on_thread]


@pytest.mark.anyio
@pytest.mark.parametrize("text, on_thread", [(True, True), (False, False)])
async def test_an_answer_of_many_numbers_in_json_is_written_on_a_thread(registry, reference, text, on_thread):
    """A run predicted as short, whose answer writes 2 x 128 x 128 weights and its outputs as JSON (~0.9 ms
    at 25 ns a number, past the 0.5 ms limits): on an inference thread, alone or batched. The same answer in
    bytes (binary tensors, gRPC) is as short as its run: on the loop. Seen from the thread its encoder runs on."""
    where = []

    def encode(model, outputs, weights):
        where.append(threading.current_thread().name.startswith("inference"))
        return encode_attend(model, outputs, weights)

    scheduler = Scheduler([registry.get(n) for n in registry.names()],
                          BatchLimits(inline_run_s=0.0005, alone_inline_run_s=0.0005), 1, Metrics())
    scheduler.start()
    scheduler.batcher_for(registry.get("dot_product")).run_cost = RunCost.of(1e-6, 1e-12)
    body = make_body("dot_product", np.random.default_rng(0), 2, 128, 128, "1d", d=8, v=8)
    try:
        for alone in (True, False):
            request = reference.decode(body)
            request.text_answer = text
            job = Job(request, time.monotonic() + 5, encode)
            assert job.text == (2 * 128 * 128 + 2 * 128 * 8 if text else 0)
            assert await scheduler.submit(job, alone=alone) == reference.attend(body)
    finally:
        await scheduler.stop()
    assert where == [on_thread, on_thread]


def test_busy_connections_count_the_clients_with_a_recent_request_not_idle_ones():
    busy = BusyConnections(window_s=0.05)
    a, b, c = object(), object(), object()  # and idle connections, which never begin a request
    now = time.monotonic()
    busy.touch(a, now - 0.045)  # 5 ms left in the window
    busy.touch(b, now)
    busy.touch(b, now)  # the same client again: one
    assert len(busy) == 2
    time.sleep(0.02)
    assert len(busy) == 1  # a's request is older than the window
    busy.touch(a, time.monotonic())
    busy.touch(c, time.monotonic())
    assert len(busy) == 3
    time.sleep(0.06)
    busy.touch(c, time.monotonic())
    assert len(busy) == 1 and len(busy._starts) == 1  # what expired is gone, not only uncounted


@pytest.mark.anyio
@pytest.mark.parametrize("busy_clients, waits", [(2, False), (3, True)])
async def test_a_batch_waits_for_busy_clients_only(registry, reference, busy_clients, waits):
    """Two requests queued at once, max_wait 0.3 s: with two busy clients (and any number of idle
    connections) the batch has all it can expect and runs at once; with a third busy client it
    waits for that one's request, up to max_wait."""
    metrics = Metrics()
    scheduler = Scheduler([registry.get(n) for n in registry.names()], BatchLimits(max_wait_s=0.3), 1, metrics)
    scheduler.start()
    scheduler.busy_clients = busy = BusyConnections(window_s=5.0)
    for _ in range(busy_clients):
        busy.touch(object(), time.monotonic())
    try:
        start = time.monotonic()
        results = await asyncio.gather(*[scheduler.submit(_job(reference)) for _ in range(2)])
        took = time.monotonic() - start
    finally:
        await scheduler.stop()
    assert all(orjson.loads(r)["outputs"][0] == [[2.0, 3.0, 4.0, 5.0]] for r in results)
    assert runs(metrics, "additive") == 1  # merged either way
    assert (took >= 0.25) if waits else (took < 0.2), took


async def _trickle(registry, reference, busy_clients, count, gap_s, max_wait_s):
    """`count` requests, one every `gap_s`, to a scheduler with `busy_clients` busy clients: the
    seconds from each submit to its answer, and the session runs."""
    metrics = Metrics()
    scheduler = Scheduler([registry.get(n) for n in registry.names()], BatchLimits(max_wait_s=max_wait_s), 1, metrics)
    scheduler.start()
    scheduler.busy_clients = busy = BusyConnections(window_s=30.0)
    for _ in range(busy_clients):
        busy.touch(object(), time.monotonic())

    async def one(i):
        await asyncio.sleep(i * gap_s)
        start = time.monotonic()
        body = await scheduler.submit(_job(reference, timeout=30))
        assert orjson.loads(body)["outputs"][0] == [[2.0, 3.0, 4.0, 5.0]]
        return time.monotonic() - start

    try:
        took = await asyncio.gather(*[one(i) for i in range(count)])
    finally:
        await scheduler.stop()
    return took, runs(metrics, "additive")


@pytest.mark.anyio
async def test_a_batch_waits_while_requests_keep_coming(registry, reference):
    """Seven requests 50 ms apart (300 ms from the first to the last), max_wait 200 ms, eight busy
    clients: each came within max_wait of the one before, so all seven share one run, which starts
    max_wait after the last (the eighth never comes)."""
    took, count = await _trickle(registry, reference, busy_clients=8, count=7, gap_s=0.05, max_wait_s=0.2)
    assert count == 1
    assert 0.45 <= took[0] < 0.9 and 0.15 <= took[-1] < 0.6, took


@pytest.mark.anyio
async def test_a_batch_waits_at_most_five_times_max_wait(registry, reference):
    """Requests 100 ms apart for 1.3 s, max_wait 200 ms, twenty busy clients: the first batch runs
    at the cap (five times max_wait after its first request), not when they stop."""
    took, count = await _trickle(registry, reference, busy_clients=20, count=14, gap_s=0.1, max_wait_s=0.2)
    assert count >= 2
    assert 0.95 <= took[0] < 1.3, took


@pytest.mark.anyio
async def test_batching_off_runs_one_request_at_a_time(registry, reference):
    async with busy(registry, enabled=False) as (scheduler, metrics, hold):
        tasks = [asyncio.create_task(scheduler.submit(_job(reference))) for _ in range(4)]
        await asyncio.sleep(0.01)
        hold.resume()
        await asyncio.gather(*tasks)
        assert runs(metrics, "additive") == 4


# --- over HTTP: many different concurrent requests, each equal to its own unbatched answer ----

def test_concurrent_requests_are_merged_and_each_gets_its_own_answer(settings, reference):
    # TestClient's requests reach the app one by one as often as not: each alone in the server, which the
    # warm-up's cost says runs at once. Never at once here, so that they queue and wait for each other.
    wait = settings.model_copy(update={"max_batch_wait_us": 20_000, "inference_threads": 1, "alone_inline_run_us": 0})
    bodies = [b for kind in ("dot_product", "additive", "multi_head", "self_attention", "masked_softmax",
                             "positional_encoding") for b in mixed_bodies(kind, 10, seed=7)]
    with TestClient(create_app(wait)) as client:
        def send(body):
            return client.post("/attend", content=body, headers={"content-type": "application/json"})

        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(send, bodies))
        metrics = client.get("/metrics").text
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        assert_same(response.content, reference.attend(body))
    # Some session runs really merged several requests.
    runs = sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("attend_batch_requests_count"))
    assert runs < len(bodies)


@pytest.mark.parametrize("value", ["0", "-1", "-inf", "inf", "nan", "soon", ""])
def test_a_timeout_header_that_is_not_a_positive_number_is_a_400(client, value):
    response = client.post("/attend", json=toy_request(), headers={"X-Request-Timeout-Ms": value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_header"
    assert response.json()["error"]["field"] == "X-Request-Timeout-Ms"


def test_timeout_header_shortens_the_deadline(client):
    response = client.post("/attend", json=toy_request(), headers={"X-Request-Timeout-Ms": "0.001"})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert client.post("/attend", json=toy_request(), headers={"X-Request-Timeout-Ms": "5000"}).status_code == 200


# --- the endpoint itself: a gone client, a deadline, on the real request path (no TestClient) --

async def _asgi(app, body, receive_after_body=None, headers=()):
    """Call the app as a server would; returns the messages sent."""
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        if receive_after_body is not None:
            return await receive_after_body()
        await asyncio.sleep(3600)

    return await _call(app, receive, headers)


async def _call(app, receive, headers=()):
    """POST /attend through the ASGI app with this receive: the messages it sends."""
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/attend", "raw_path": b"/attend", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "state": {}}
    await app(scope, receive, send)
    return sent


@contextlib.asynccontextmanager
async def _started(settings):
    app = create_app(settings)
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.get_running_loop().create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                      inbox.get, outbox.put))
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield app
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task


def _status_count(app, model, status):
    return app.state.dataplane.metrics.requests.labels(model, str(status), "http")._value.get()


@contextlib.contextmanager
def _busy(app, model):
    """The model's batcher busy, as while it runs a batch: requests wait in its queue until after."""
    batcher = app.state.dataplane.scheduler.batcher_for(app.state.dataplane.registry.get(model))
    batcher.stepping = True
    try:
        yield
    finally:
        batcher.stepping = False
        batcher.wake()


@pytest.mark.anyio
async def test_a_client_gone_while_queued_is_dropped_and_counted_499(settings, caplog):
    async with _started(settings) as app:
        async def disconnect():
            return {"type": "http.disconnect"}

        body = json.dumps(toy_request()).encode()
        with _busy(app, "additive"):
            task = asyncio.create_task(_asgi(app, body, disconnect))
            await asyncio.sleep(0.05)  # queued, and older than the 2 ms after which clients are asked
        sent = await task
        assert sent == []  # nobody to answer
        assert _status_count(app, "additive", 499) == 1
        assert app.state.dataplane.metrics.batch_requests.labels("additive")._sum.get() == 0  # never ran
    assert "Traceback" not in caplog.text and "unhandled" not in caplog.text


@pytest.mark.anyio
async def test_a_deadline_passing_in_the_queue_is_504_at_the_deadline(settings):
    async with _started(settings) as app:
        body = json.dumps(toy_request()).encode()
        start = time.monotonic()
        with _busy(app, "additive"):
            sent = await _asgi(app, body, headers=[(b"x-request-timeout-ms", b"100")])
        waited = time.monotonic() - start
        assert sent[0]["status"] == 504 and 0.09 < waited < 1.0
        assert json.loads(sent[1]["body"])["error"]["code"] == "deadline_exceeded"
        sent = await _asgi(app, body)
        assert sent[0]["status"] == 200
        assert app.state.dataplane.metrics.batch_requests.labels("additive")._sum.get() == 1  # the late one never ran


@pytest.mark.anyio
async def test_a_deadline_passing_while_the_decode_thread_is_busy_is_504_and_never_decoded(settings):
    """A body large enough for the decode thread, the thread busy: 504 at the deadline, and when the
    thread comes free the decode is not started."""
    small = settings.model_copy(update={"inline_decode_bytes": 100, "inference_threads": 1})
    async with _started(small) as app:
        codec = app.state.attend.codec
        decoded = []
        original = codec.decode
        codec.decode = lambda core, target, headers, body, cost: decoded.append(len(body)) or original(
            core, target, headers, body, cost)
        release = threading.Event()
        app.state.dataplane._decoder.submit(release.wait)  # the one decode thread, busy
        body = json.dumps(toy_request()).encode()
        start = time.monotonic()
        sent = await _asgi(app, body, headers=[(b"x-request-timeout-ms", b"300")])
        assert sent[0]["status"] == 504 and 0.25 < time.monotonic() - start < 1.0
        release.set()
        await asyncio.sleep(0.3)
        assert decoded == []  # its turn came after its deadline: never decoded
        assert (await _asgi(app, body))[0]["status"] == 200 and decoded == [len(body)]


@pytest.mark.anyio
async def test_a_deadline_passing_while_the_body_comes_in_is_504(settings):
    async with _started(settings) as app:
        async def slowly():
            await asyncio.sleep(3600)  # the rest of the body never comes

        body = json.dumps(toy_request()).encode()
        start = time.monotonic()
        sent = await _asgi_partial(app, body[:50], slowly, headers=[(b"x-request-timeout-ms", b"300")])
        assert sent[0]["status"] == 504 and 0.25 < time.monotonic() - start < 1.0
        assert json.loads(sent[1]["body"])["error"]["code"] == "deadline_exceeded"


async def _asgi_partial(app, first, then, headers=()):
    """A request whose body starts with `first` and whose next chunk comes from `then`."""
    chunks = iter([{"type": "http.request", "body": first, "more_body": True}])

    async def receive():
        try:
            return next(chunks)
        except StopIteration:
            return await then()

    return await _call(app, receive, headers)


@pytest.mark.parametrize("wants", [(False,), (False, False, False), (False, True, False), (True,)])
def test_a_batch_runs_the_graph_without_weights_when_no_job_returns_them(reference, wants):
    """The graph without attention_weights (model.cpu.outputs.onnx) runs a batch where no job wants them,
    the CPU graph where any one does; each job gets what it asked for, the outputs the same either way."""
    rng = np.random.default_rng(len(wants))
    bodies = [json.loads(make_body("dot_product", rng, 2, 3 + i, 5, "2d")) | {"return_weights": w}
              for i, w in enumerate(wants)]
    jobs = [Job(reference.decode(json.dumps(b).encode()), float("inf"), encode=encode_attend) for b in bodies]
    model = jobs[0].request.model
    assert model.session_without_weights is not None
    before = [g.runs for g in model.graphs]
    results, _ = run_batch(model, jobs, Metrics())
    ran = [g.file for g, runs in zip(model.graphs, before, strict=True) if g.runs > runs]
    assert ran == ["1/model.cpu.onnx" if any(wants) else "1/model.cpu.outputs.onnx"]  # the fixed choice
    for body, result, wanted in zip(bodies, results, wants, strict=True):
        got = orjson.loads(result)
        alone = orjson.loads(reference.attend(json.dumps(body | {"return_weights": True}).encode()))
        assert (got["attention_weights"] is not None) == wanted
        np.testing.assert_allclose(got["outputs"], alone["outputs"], rtol=1e-6, atol=1e-7)
