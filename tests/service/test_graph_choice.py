"""The timed choice of graphs (service.core.choice): the warm-up times every graph of a model on a ladder of sizes on
this machine (real sessions, real timing), and a batch runs the fastest for its size; the ladder is monotone
(each graph once, sizes growing) and follows the times measured; every graph answers what model.onnx answers;
GET /models/{name} shows the choice and counts each graph's runs; ATTEND_GRAPH_TIMING_S=0 keeps the fixed one."""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from export.repository import example_feed
from service.core.choice import UNBOUNDED, Graph, SharedTimings, Timings, adopt, candidates, choose, timings_key
from service.core.jobs import Job
from service.core.merge import run_batch
from service.core.metrics import Metrics
from service.core.request import Request
from service.core.runtime import CPU, CUDA, Registry
from service.protocols.attend import encode_attend
from tests.server import running_service

pytestmark = pytest.mark.slow

FUSED = ("dot_product", "multi_head", "self_attention")
TOLERANCE = 1e-5  # as tests/service/test_batching.py's: float32 sums in another order


@pytest.fixture(scope="module")
def timed(repository):
    return Registry.load(repository, "cpu", 1, graph_timing_s=0.5)


def _feed(model, batch, n, form, rng):
    """Random inputs at n queries and keys, lengths 0..n one an example ("1d") or one a query ("2d")."""
    feed = example_feed(model.kind, model.config.hyperparameters,
                        {"batch": batch, "n_q": n, "n_k": n, "n": n, "d": 12, "value_size": 6}, rng)
    if "valid_lens" in feed:
        shape = (batch, 1) if form == "1d" else (batch, n)
        lens = rng.integers(0, n + 1, size=shape)
        lens.flat[0], lens.flat[-1] = 0, n  # attends to nothing, and to every key
        feed["valid_lens"] = np.ascontiguousarray(np.broadcast_to(lens, (batch, n)), dtype=np.int64)
    return feed


def test_the_warm_up_times_every_graph_and_the_ladder_follows_the_times(timed):
    for name in timed.names():
        model = timed.get(name)
        if name not in FUSED:  # one graph on the CPU: nothing to time, nothing to choose
            assert len(model.graphs) == 1 and model.timings is None
            assert model.choice[True] == model.choice[False] == ((UNBOUNDED, model.graphs[0]),)
            continue
        assert [(g.file, g.provider, g.weights) for g in model.graphs] == [
            ("1/model.cpu.onnx", CPU, True), ("1/model.cpu.outputs.onnx", CPU, False), ("1/model.onnx", CPU, True)]
        timings = model.timings
        assert len(timings.elements) >= 2 and timings.elements == sorted(set(timings.elements))
        for weights in (True, False):
            ladder = model.choice[weights]
            bounds, graphs = [up_to for up_to, _ in ladder], [g for _, g in ladder]
            assert bounds == sorted(set(bounds)) and bounds[-1] == UNBOUNDED
            assert len(set(graphs)) == len(graphs)  # each graph once: the choice is monotone in the size
            pool = candidates(model.graphs, weights, True)
            assert set(graphs) <= set(pool) and (not weights or all(g.weights for g in graphs))
            ms = {g: timings.ms[(g, weights and g.weights)] for g in pool}
            for r, elements in enumerate(timings.elements):
                chosen = model.graph_for(weights, elements)
                fastest = min(t[r] for t in ms.values())
                # Within what a change of graph must save (service.core.choice._SWITCH_COST) and the noise.
                assert ms[chosen][r] <= 1.5 * fastest + 0.01, (name, weights, elements, ms)
            always = [g for g in pool if all(ms[g][r] < 0.9 * min(ms[o][r] for o in pool if o is not g)
                                             for r in range(len(timings.elements)))]
            if always:  # one graph the fastest by a tenth at every size timed: it runs them all
                assert all(model.graph_for(weights, e) is always[0] for e in timings.elements)


def _graph(name: str) -> Graph:
    return Graph(name, CPU, None, ["outputs", "attention_weights"], True)  # type: ignore[arg-type]


def test_choose_switches_where_the_lines_cross_and_extends_them_past_the_ladder():
    a, b, c = _graph("a"), _graph("b"), _graph("c")
    elements = [64, 128, 256, 512]
    crossing = Timings(elements, {(a, True): [1.0, 2.0, 4.0, 8.0], (b, True): [2.0, 2.5, 3.0, 3.5]})
    # a wins at 64 and 128, b at 256 and 512: the lines through 128 and 256 cross at 128 + 128 * 0.5 / 1.5
    assert choose(crossing, [a, b], True) == ((170, a), (UNBOUNDED, b))
    beyond = Timings(elements, {(a, True): [1.0, 2.0, 3.0, 4.0], (b, True): [3.0, 3.5, 4.0, 4.5]})
    # a wins on the ladder; b's line, flatter, crosses below a's at 512 + 0.5 / (1 / 256 - 0.5 / 256)
    assert choose(beyond, [a, b], True) == ((768, a), (UNBOUNDED, b))
    # a back and forth within noise: one graph, not a, b, a
    noisy = Timings(elements, {(a, True): [1.0, 1.02, 1.0, 1.0], (b, True): [1.01, 1.0, 1.01, 1.01]})
    assert choose(noisy, [a, b], True) == ((UNBOUNDED, a),)
    # a graph that failed (out of memory) from a size on: the others run from there
    failing = Timings(elements, {(a, True): [1.0, 1.0, math.inf, math.inf], (b, True): [2.0, 2.0, 2.0, 2.0],
                                 (c, True): [3.0, 3.0, 3.0, 3.0]})
    assert choose(failing, [a, b, c], True) == ((128, a), (UNBOUNDED, b))
    # a graph that keeps no scores (CUDA's fused one, without the weights) runs every batch past the ladder
    fused = Graph("f", CUDA, None, ["outputs"], False, None, True)  # type: ignore[arg-type]
    pinned = Timings(elements, {(a, False): [1.0, 1.0, 1.0, 1.0], (fused, False): [2.0, 2.0, 2.0, 2.0]})
    assert choose(pinned, [a, fused], False) == ((512, a), (UNBOUNDED, fused))


def test_a_loader_takes_the_times_another_process_shared_and_chooses_by_them(repository, timed, tmp_path):
    """ATTEND_WORKERS: the start's check times the graphs, and every worker takes its times from the folder they
    share (service.core.choice.SharedTimings)."""
    first = Registry.load(repository, "cpu", 1, graph_timing_s=0.3, timings_folder=str(tmp_path))
    assert all(not first.get(name).timings.adopted for name in FUSED)
    assert len(list(tmp_path.glob("*.json"))) == len(FUSED)  # a file a timed model version
    shared = SharedTimings(tmp_path)
    for name in FUSED:  # times no machine measures: model.onnx the fastest at every size, with weights or not
        elements, rows = first.get(name).timings.export()
        shared.store(timings_key(first.get(name)), (elements, [
            (f, p, w, [1.0 if f.endswith("/model.onnx") else 9.0] * len(t)) for f, p, w, t in rows]))
    loaded = Registry.load(repository, "cpu", 1, graph_timing_s=0.5, timings_folder=str(tmp_path))
    for name in FUSED:
        model = loaded.get(name)
        with shared.turn(timings_key(model)) as stored:
            assert model.timings.adopted and json.loads(json.dumps(model.timings.export())) == stored
        assert [(up_to, g.file) for up_to, g in model.choice[True]] == [(UNBOUNDED, "1/model.onnx")]
        assert [(up_to, g.file) for up_to, g in model.choice[False]] == [(UNBOUNDED, "1/model.onnx")]
    # Times of other graphs (another version's, files gone or added) are not taken: the loader times its own.
    elements, rows = timed.get("dot_product").timings.export()
    graphs = loaded.get("dot_product").graphs
    assert adopt((elements, rows), graphs, True) is not None
    assert adopt((elements, rows[:-1]), graphs, True) is None
    assert adopt((elements[:-1], rows), graphs, True) is None
    assert adopt((elements, rows), graphs[:-1], True) is None
    other = tmp_path / "other"
    other.mkdir()
    for name in FUSED:  # the same times, filed as another version's
        model = first.get(name)
        SharedTimings(other).store(timings_key(model).replace(" 1 ", " 2 ", 1), model.timings.export())
    fresh = Registry.load(repository, "cpu", 1, graph_timing_s=0.3, timings_folder=str(other))
    assert all(not fresh.get(name).timings.adopted for name in FUSED)


def _adopted(repository: str, folder: str) -> dict[str, tuple[bool, list]]:
    """A process's load (test_processes_that_load_at_once_time_each_model_once): each model's times, and whether
    it took them from another process."""
    registry = Registry.load(Path(repository), "cpu", 1, graph_timing_s=0.3, timings_folder=folder)
    return {name: (registry.get(name).timings.adopted, json.loads(json.dumps(registry.get(name).timings.export())))
            for name in FUSED}


def test_processes_that_load_at_once_time_each_model_once(repository, tmp_path):
    """Workers that load the same new version at once (SIGHUP): one times it, holding its lock, and the others
    wait and take its times, not timing under each other's load."""
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        loads = [pool.submit(_adopted, str(repository), str(tmp_path)) for _ in range(2)]
        a, b = (load.result(timeout=300) for load in loads)
    for name in FUSED:
        assert sorted([a[name][0], b[name][0]]) == [False, True], (name, a[name][0], b[name][0])
        assert a[name][1] == b[name][1], name  # the same times to the last digit


@pytest.mark.parametrize("form", ["1d", "2d"])
def test_every_graph_answers_what_model_onnx_answers(timed, form):
    rng = np.random.default_rng(len(form))
    for name in FUSED:
        model = timed.get(name)
        reference = next(g for g in model.graphs if g.file == model.config.model_file)
        for batch, n in ((1, 3), (3, 24)):
            feed = _feed(model, batch, n, form, rng)
            want = reference.run(feed)
            for graph in model.graphs:
                got = graph.run(feed, weights=True)
                assert set(got) == set(want) - ({"attention_weights"} if not graph.weights else set())
                for output in got:
                    np.testing.assert_allclose(got[output], want[output], rtol=TOLERANCE, atol=TOLERANCE,
                                               err_msg=f"{name} {graph.label} {output}")


def test_a_batch_runs_the_graph_its_size_chooses(timed):
    """run_batch (service.core.merge) runs the graph of the ladder for the batch's elements, with the weights
    and without, at the smallest and the largest size the ladder timed."""
    model = timed.get("dot_product")
    rng = np.random.default_rng(5)
    for n in (4, 256):
        for weights in (True, False):
            feed = _feed(model, 1, n, "1d", rng)
            job = Job(Request(model, feed, weights), float("inf"), encode=encode_attend)
            chosen = model.graph_for(weights, job.elements)
            runs = chosen.runs
            run_batch(model, [job], Metrics())
            assert chosen.runs == runs + 1


@pytest.fixture
def dot_product_only(repository, tmp_path):
    path = shutil.copytree(repository, tmp_path / "repo")
    for folder in path.iterdir():
        if folder.is_dir() and folder.name != "dot_product":
            shutil.rmtree(folder)
    return path


def _runs(described):
    return {(g["file"], g["provider"]): g["runs"] for g in described["graphs"]}


def test_get_models_shows_the_choice_and_counts_the_runs(dot_product_only):
    body = {"model": "dot_product", "queries": [[[1.0, 0.0]]], "keys": [[[1.0, 0.0], [0.0, 1.0]]],
            "values": [[[1.0], [2.0]]], "valid_lens": [1], "return_weights": False}
    with running_service(dot_product_only, ATTEND_GRAPH_TIMING_S="0.3") as (url, _):
        described = httpx.get(f"{url}/models/dot_product", timeout=10).json()
        for weights in (True, False):
            rows = [g for g in described["graphs"] if g["weights"] is weights]
            assert rows and rows[-1]["up_to_elements"] is None
            assert all(isinstance(r["up_to_elements"], int) for r in rows[:-1])
            assert all(r["provider"] == CPU and r["file"].startswith("1/model.") for r in rows)
        timings = described["graph_timings"]
        assert len(timings) >= 2 and all(len(row["ms"]) == 5 for row in timings[:1])  # 3 graphs, 2 of them twice
        before = _runs(described)
        response = httpx.post(f"{url}/attend", json=body, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == [[[1.0]]]
        after = _runs(httpx.get(f"{url}/models/dot_product", timeout=10).json())
        ran = [key for key in after if after[key] == before[key] + 1]
        assert len(ran) == 1 and sum(after.values()) == sum(before.values()) + 1
        assert any((g["file"], g["provider"]) == ran[0] for g in described["graphs"] if not g["weights"])
    with running_service(dot_product_only, ATTEND_GRAPH_TIMING_S="0") as (url, _):
        described = httpx.get(f"{url}/models/dot_product", timeout=10).json()
        assert described["graph_timings"] is None
        assert [(g["file"], g["weights"], g["up_to_elements"]) for g in described["graphs"]] == [
            ("1/model.cpu.onnx", True, None), ("1/model.cpu.outputs.onnx", False, None)]
