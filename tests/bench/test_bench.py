"""`make bench`'s parts: the pools of varied bodies (each accepted by the service, every valid-length
form), the load generator (wrk with bench/pool.lua: a different body a request, each request timed,
against a real server), and the report written into the docs' marked sections from a results file."""

from __future__ import annotations

import hashlib
import json
import sys
import threading

import numpy as np
import pytest

from tests.server import ROOT, free_port, running_service, uvicorn_in_thread

sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402
import pools  # noqa: E402
import run  # noqa: E402

from service.core.runtime import Registry  # noqa: E402
from service.protocols.attend import attend  # noqa: E402

VARIED = [name for name, w in pools.WORKLOADS.items() if not w.replayed]
HAS_LENS = {"W1", "W2", "W3", "W4", "W5", "W6"}


def expected_shapes(body: dict) -> dict[str, tuple]:
    model, q = body["model"], np.shape(body.get("queries", body.get("scores")))
    if model == "masked_softmax":
        return {"outputs": q, "attention_weights": q}
    if model == "positional_encoding":
        return {"outputs": q, "P": q[1:]}
    if model == "self_attention":
        return {"outputs": q, "attention_weights": (q[0], 5, q[1], q[1])}
    n_k = np.shape(body["keys"])[1]
    if model == "multi_head":
        return {"outputs": (q[0], q[1], 100), "attention_weights": (q[0], 5, q[1], n_k)}
    return {"outputs": (q[0], q[1], np.shape(body["values"])[2]), "attention_weights": (q[0], q[1], n_k)}


def form(body: dict) -> str:
    lens = body.get("valid_lens")
    return "absent" if lens is None else f"{np.ndim(lens)}-D"


@pytest.fixture(scope="module")
def registry(repository):
    return Registry.load(repository, "cpu", 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIED)
def test_every_body_form_of_each_pool_is_served(name, registry):
    """The first bodies of each varied pool (the run's own, same seed), through the service's codec and
    the real sessions: every valid-length form the kind takes appears, and each answer has its shapes."""
    bodies = pools.WORKLOADS[name].bodies(count=8 if name == "W2" else 24)
    forms = {form(b) for b in bodies}
    assert forms == ({"absent", "1-D", "2-D"} if name in HAS_LENS else {"absent"}), forms
    shapes = {tuple(np.shape(b[k]) for k in ("queries", "keys", "values", "scores") if k in b) for b in bodies}
    assert len(shapes) > len(bodies) // 2, "shapes are drawn per body"
    for body in bodies:
        path, content, header_length = pools.attend_json(body)
        assert (path, header_length) == ("/attend", 0)
        # Floats as json.dumps writes float32 tensors: full decimals that round-trip through float32.
        numbers = np.asarray(json.loads(content)[next(k for k in ("queries", "scores") if k in body)]).ravel()
        assert np.array_equal(numbers.astype(np.float32).astype(np.float64), numbers)
        assert len(content) > 15 * numbers.size
        answer = json.loads(attend(content, registry))
        for key, shape in expected_shapes(body).items():
            assert np.shape(answer[key]) == shape, (name, key, form(body))
        assert np.isfinite(np.asarray(answer["outputs"])).all()


def test_pools_differ_by_seed_and_replayed_rows_are_one_body():
    a, b = pools.WORKLOADS["W4"].bodies(count=4), pools.WORKLOADS["W4"].bodies(seed=1, count=4)
    assert a == pools.WORKLOADS["W4"].bodies(count=4) and a != b
    assert [len(pools.WORKLOADS[n].bodies()) for n in ("W1r", "W2r", "W3r")] == [1, 1, 1]
    assert run.workloads()["W1"][1] == pools.WORKLOADS["W1r"].bodies()[0]


def test_the_protocol_encoders_ask_for_the_outputs_the_body_asks_for():
    """pools.v2_binary and pools.grpc_raw (tests/load/hostile.py's mix sends them too): every output by
    default, as /attend answers; `outputs` alone where the body says `return_weights: false`."""
    from tritonclient.grpc import service_pb2

    body = {"model": "dot_product", "queries": [[[1.0, 0.0]]], "keys": [[[1.0, 0.0], [0.0, 1.0]]],
            "values": [[[1.0], [2.0]]]}
    for weights, v2_asked, grpc_asked in ((None, None, []), (False, [{"name": "outputs", "parameters":
                                                                      {"binary_data": True}}], ["outputs"])):
        sent = body if weights is None else body | {"return_weights": weights}
        _, content, head = pools.v2_binary(sent)
        header = json.loads(content[:head])
        assert header.get("outputs") == v2_asked and len(content) - head == 4 * (2 + 4 + 2), header
        message = service_pb2.ModelInferRequest.FromString(pools.grpc_raw(sent)[1])
        assert [o.name for o in message.outputs] == grpc_asked and len(message.raw_input_contents) == 3


def test_pool_files_hold_whole_requests(tmp_path):
    encoded = [pools.attend_json(b) for b in pools.WORKLOADS["W1"].bodies(count=3)]
    index = pools.write_pool(tmp_path, "W1", encoded)
    lines = index.read_text().splitlines()
    data = (tmp_path / "W1.pool").read_bytes()
    assert lines[0] == str(tmp_path / "W1.pool") and len(lines) == 4
    for line, (_, content, _) in zip(lines[1:], encoded, strict=True):
        offset, length = map(int, line.split())
        head, _, body = data[offset:offset + length].partition(b"\r\n\r\n")
        assert body == content
        assert head.startswith(b"POST /attend HTTP/1.1\r\n") and f"Content-Length: {len(content)}".encode() in head


needs_wrk = pytest.mark.usefixtures("wrk")  # tests/conftest.py: fails, naming `make tools`, where it is missing


@needs_wrk
def test_the_load_generator_sends_a_different_body_a_request_and_times_each(tmp_path):
    """wrk with bench/pool.lua against an app that records every body: each request is one of the
    pool's, the connections walk the whole pool, and there is one time a response."""
    seen: list[bytes] = []
    lock = threading.Lock()

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        with lock:
            seen.append(hashlib.sha1(body).digest())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    encoded = [pools.attend_json(b) for b in pools.WORKLOADS["W6"].bodies(count=40)]
    index = pools.write_pool(tmp_path, "W6", encoded)
    with uvicorn_in_thread(app, "httptools") as port:
        point = loadgen.measure("wrk", port, index, 4, 1, load_cpu=None)
    sent = {hashlib.sha1(content).digest() for _, content, _ in encoded}
    assert point.ok and point.requests == len(point.latencies_us) > 40
    assert len(seen) >= point.requests  # requests in flight at the end are served but not timed
    assert set(seen) == sent  # every body of the pool, nothing else
    assert (point.latencies_us > 0).all() and point.percentile(99) >= point.percentile(50) > 0
    # The times cover each connection's whole cycle (Little's law), the client's own gaps aside.
    busy = point.latencies_us.sum() / 1e6 / (point.seconds * 4)
    print(f"busy fraction {busy:.3f}")
    assert 0.6 < busy < 1.05


@pytest.mark.slow
@needs_wrk
def test_the_service_answers_each_pool_under_the_load_generator(tmp_path, repository):
    """A short point of each transport against the real service: every answer a 200."""
    bodies = pools.WORKLOADS["W4"].bodies(count=64)
    made = {"W4": pools.write_pool(tmp_path, "W4", [pools.attend_json(b) for b in bodies]),
            "W4bin": pools.write_pool(tmp_path, "W4bin", [pools.v2_binary(b) for b in bodies]),
            "W3r": pools.make_pools(tmp_path, ["W3r"])["W3r"]["index"]}
    grpc_index = pools.write_pool(tmp_path, "W4grpc", [pools.grpc_raw(b) for b in bodies], http=False)
    grpc_port = free_port()
    with running_service(repository, ATTEND_INTRA_OP_THREADS="1", ATTEND_GRPC_PORT=str(grpc_port)) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        for name, index in made.items():
            point = loadgen.measure("wrk", port, index, 2, 1, load_cpu=None)
            assert point.ok, (name, point.failed, point.statuses, point.errors)
            assert point.requests > 5
        point = loadgen.measure("grpc", grpc_port, grpc_index, 2, 1, load_cpu=None)
        assert point.ok, ("W4grpc", point.failed, point.statuses, point.errors)
        assert point.requests > 5 and len(point.latencies_us) == point.requests and point.percentile(99) > 0
        # A pool of bodies the service refuses (an unknown model) is counted as failed, by status.
        refused = pools.write_pool(tmp_path, "bad", [pools.grpc_raw(b | {"model": "nope"}) for b in bodies[:4]],
                                   http=False)
        point = loadgen.measure("grpc", grpc_port, refused, 1, 1, load_cpu=None)
        assert not point.ok and point.requests == 0 and point.failed > 0 and set(point.statuses) == {"NOT_FOUND"}


def test_the_plain_server_answers_every_pool_without_onnx_runtimes_warnings(tmp_path, repository):
    """The baseline pays for nothing the service does not: ONNX Runtime's warning at every run of the CPU
    graphs whose weights' n_k it takes for 0 (all three) would be a write a request."""
    import httpx

    log = tmp_path / "plain.log"
    with run.server("plain", repository, {}, log_path=log) as (url, _):
        for name in ("W1", "W3", "W4", "W5", "W6", "W7"):
            for body in pools.WORKLOADS[name].bodies(count=4):
                response = httpx.post(f"{url}/attend", content=pools.attend_json(body)[1],
                                      headers={"content-type": "application/json"}, timeout=30)
                assert response.status_code == 200, (name, response.text[:200])
                if name == "W4":  # dot_product's weights as the service answers them, not with its CPU graph's
                    # axis of its one head (the same JSON to write)
                    shape = (len(body["queries"]), len(body["queries"][0]), len(body["keys"][0]))
                    assert np.array(response.json()["attention_weights"]).shape == shape
    text = log.read_text()
    assert "onnxruntime" not in text and "Expected shape" not in text, text


def test_grpc_pool_holds_each_body_as_a_model_infer_request(tmp_path):
    from tritonclient.grpc import service_pb2

    bodies = pools.WORKLOADS["W1"].bodies(count=8)
    index = pools.write_pool(tmp_path, "W1grpc", [pools.grpc_raw(b) for b in bodies], http=False)
    import grpc_load

    messages = grpc_load.read_pool(index)
    assert len(messages) == 8
    for body, raw in zip(bodies, messages, strict=True):
        request = service_pb2.ModelInferRequest.FromString(raw)
        assert request.model_name == "additive"
        names = [t.name for t in request.inputs]
        assert names == [n for n in ("queries", "keys", "values", "valid_lens") if n in body]
        for tensor, content in zip(request.inputs, request.raw_input_contents, strict=True):
            expected = np.array(body[tensor.name], dtype=np.int64 if tensor.name == "valid_lens" else np.float32)
            assert list(tensor.shape) == list(expected.shape)
            assert content == expected.tobytes()


def results() -> dict:
    points = []
    for rnd, (plain, service) in enumerate([(100.0, 150.0), (120.0, 168.0), (110.0, 121.0)]):
        for row in ("W1", "W2bin", "W2"):
            for c in (1, 16):
                for server, rps in (("plain", plain), ("service", service * (2 if row == "W2bin" else 1))):
                    if server == "plain" and row == "W2bin":
                        continue
                    points.append({"row": row, "concurrency": c, "server": server, "round": rnd, "requests": 500,
                                   "seconds": 3.0, "rps": rps, "p50_ms": 1.0, "cpu_us": 1e6 / rps,
                                   "p99_ms": 8.0 if server == "plain" else 4.0})
    rows = {row: {"workload": pools.ROWS[row][0], "transport": pools.ROWS[row][1],
                  "text": pools.WORKLOADS[pools.ROWS[row][0]].text,
                  "transport_text": pools.TRANSPORTS[pools.ROWS[row][1]].text, "replayed": False, "bodies": 512,
                  "median_bytes": 4000} for row in ("W1", "W2bin", "W2")}
    return {"date": "2026-11-25 11:00 UTC", "minutes": 1.5, "command": "python bench/run.py --rounds 3",
            "machine": "a test machine", "points": points, "rows": rows,
            "settings": {"rounds": 3, "duration_s": 3, "warmup_s": 1, "concurrency": [1, 16],
                         "servers": ["plain", "service"], "seed": 2025, "server_cpu": 0, "load_cpu": 1}}


def test_the_report_rewrites_the_marked_sections_from_the_results_file(tmp_path):
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text("# Title\n\nprose\n\n<!-- bench -->\nold table 9.99x\n<!-- /bench -->\n\n## Later\nkept\n")
    readme.write_text("intro\n<!-- bench-ratios -->\n| old | 7.77x |\n<!-- /bench-ratios -->\nafter\n")
    file = tmp_path / "results.json"
    file.write_text(json.dumps(results()))
    sys_argv = sys.argv
    sys.argv = ["run.py", "--report", str(file), "--out", str(docs), "--readme", str(readme)]
    try:
        assert run.main() == 0
    finally:
        sys.argv = sys_argv
    text, short = docs.read_text(), readme.read_text()
    assert text.startswith("# Title\n\nprose\n\n<!-- bench -->\nRun 2026-11-25 11:00 UTC on a test machine; "
                           "command: `python bench/run.py --rounds 3`")
    assert text.endswith("<!-- /bench -->\n\n## Later\nkept\n") and "9.99x" not in text
    assert short.startswith("intro\n<!-- bench-ratios -->\nRun 2026-11-25 11:00 UTC") and "7.77x" not in short
    assert short.endswith("<!-- /bench-ratios -->\nafter\n")
    # Medians of the per-round ratios (1.50, 1.40, 1.10) and of p99 (0.5); W2bin against the plain W2.
    row = next(line for line in short.splitlines() if line.startswith("| W1:"))
    assert row.split(" | ")[1:] == ["1.40x", "1.40x", "0.50x", "0.50x |"]
    row = next(line for line in short.splitlines() if line.startswith("| W2bin:"))
    assert row.split(" | ")[1:3] == ["2.80x", "2.80x"]
    full = next(line for line in text.splitlines() if line.startswith("| W1 | 512 varied | 16 |"))
    assert "| 110 | 150 | 1.40x | 1.50 1.40 1.10 |" in full
    # Again: the sections are replaced, not appended to.
    run.report(results(), docs, readme)
    assert docs.read_text().count("<!-- bench -->") == 1 and readme.read_text().count("| W1:") == 1
    # gRPC against HTTP in the same run: none here, so no such table.
    assert "through gRPC" not in text


def test_the_report_weighs_grpc_against_http_in_the_same_run():
    data = results()
    for p in [p for p in data["points"] if p["row"] in ("W1", "W2bin") and p["server"] == "service"]:
        row = "W1grpc" if p["row"] == "W1" else "W2grpc"
        data["points"].append(p | {"row": row, "rps": p["rps"] * (1.25 if row == "W1grpc" else 0.9),
                                   "p99_ms": 2.0})
    for row in ("W1grpc", "W2grpc"):
        data["rows"][row] = data["rows"]["W1"] | {"workload": row[:2], "transport": "grpc",
                                                  "transport_text": pools.TRANSPORTS["grpc"].text}
    section, short = run.render(data)
    doors = [line for line in section if line.startswith("| W1grpc | W1 |") or line.startswith("| W2grpc | W2bin |")]
    assert doors == ["| W1grpc | W1 | 1 | 1.25x | 1.25 1.25 1.25 | 0.50x |",
                     "| W1grpc | W1 | 16 | 1.25x | 1.25 1.25 1.25 | 0.50x |",
                     "| W2grpc | W2bin | 1 | 0.90x | 0.90 0.90 0.90 | 0.50x |",
                     "| W2grpc | W2bin | 16 | 0.90x | 0.90 0.90 0.90 | 0.50x |"]
    assert any(line.startswith("| W2grpc | W2bin | 16 | 0.90x") for line in short)
    # The plain server does not speak gRPC: the rows' ratios are to its JSON row of the same workload.
    assert next(e for e in run.summarise(data) if e["row"] == "W2grpc")["plain_row"] == "W2"


def test_report_needs_marked_sections(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match="no section"):
        run.report(results(), tmp_path / "results.json", None)


def test_the_decode_bench_times_each_pool_in_two_trees_and_pairs_them(repository):
    """bench/decode.py against this same checkout as the other tree: a row a workload, a time for each tree,
    and paired ratios near 1 (the same code on the same bodies)."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--tree", str(ROOT), "--workloads",
                          "W1,W6", "--rounds", "2", "--passes", "1", "--repository", str(repository)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| W")]
    assert [r[0].strip() for r in rows] == ["W1", "W6"], out
    for _, this, other, ratio, rounds in rows:
        assert 1 < float(this) < 10_000 and 1 < float(other) < 10_000, out
        assert len(rounds.split()) == 2 and 0.3 < float(ratio) < 3, out


def test_the_mask_bench_builds_the_same_mask_in_both_integer_types():
    """bench/mask_dtype.py stops where its int64 and int32 masks differ; a row a size where they agree."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "mask_dtype.py"), "--sizes", "2x7", "1x33",
                          "--calls", "3"], capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line[:3].strip("| ").isdigit()]
    assert [r[0].strip() for r in rows] == ["2 x 7 x 7", "1 x 33 x 33"], out
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), out


def test_the_breakdown_times_both_servers_stage_by_stage_on_the_pools(repository):
    """bench/breakdown.py: a row a pool, each stage a figure for the service and one for the plain server
    (its route called as a function), the totals their sums and the ratio theirs."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "breakdown.py"), "--repository", str(repository),
                          "--workloads", "W1,W4", "--passes", "1", "--bodies", "16"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| W")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("W1", "16"), ("W4", "16")], out
    for row in rows:
        pairs = [[float(x) for x in cell.split(" / ")] for cell in row[2:7]]
        assert all(service > 0 and plain > 0 for service, plain in pairs), out
        *stages, (service, plain) = pairs
        assert service == pytest.approx(sum(s for s, _ in stages), abs=0.3), out
        assert plain == pytest.approx(sum(p for _, p in stages), abs=0.3), out
        assert float(row[7]) == pytest.approx(service / plain, abs=0.01), out


def test_the_breakdown_compares_the_two_servers_answers(repository, monkeypatch):
    """bench/breakdown.py stops unless both servers answer a body with the same numbers: they do on every
    form of every pool it times, and a number changed in one answer is told apart."""
    import breakdown

    monkeypatch.setenv("PLAIN_REPOSITORY", str(repository))  # Plain sets it for plain_server's import: put back after
    service, plain = breakdown.Service(repository), breakdown.Plain(repository)
    for workload in ("W1", "W3", "W4", "W5", "W6", "W7"):
        for body in pools.WORKLOADS[workload].bodies(count=6):
            raw = pools.attend_json(body)[1]
            assert breakdown.same_answers(service.answer(raw), plain.answer(raw)), (workload, body)
    raw = pools.attend_json(pools.WORKLOADS["W1"].bodies(count=1)[0])[1]
    answer = json.loads(service.answer(raw))
    answer["outputs"][0][0][0] += 1e-3
    assert not breakdown.same_answers(json.dumps(answer).encode(), plain.answer(raw))


def test_the_weights_copy_bench_times_each_output_of_the_same_numbers(repository):
    """bench/weights_copy.py: dot_product's CPU graph as exported and with its weights through a Reshape, a
    Squeeze or a Reshape inside the If; it stops where any gives other numbers than the graph's own, the
    head's axis aside. A row a size and form of lengths, each figure a time and its ratio."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "weights_copy.py"), "--repository", str(repository),
                          "--sizes", "2x7", "1x33", "--seconds", "0.2"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line[:3].strip("| ").isdigit()]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (shape, form) for shape in ("2 x 7 x 7 x 64", "1 x 33 x 33 x 64") for form in ("per example", "per query")]
    for row in rows:
        cells = [cell.strip().rstrip("x)").split(" (") for cell in row[2:]]
        assert len(cells) == 4 and all(float(ms) > 0 and float(ratio) > 0 for ms, ratio in cells), out
        assert cells[0][1] == "1.00", out  # the graph as exported, against itself


@needs_wrk
def test_the_gc_bench_times_the_collections_of_the_real_service(repository):
    """bench/gc_cost.py: a row a point, from the file its hook in the service writes (read for every point:
    no file, no table). This checkout's requests leave no reference cycle, so its collections free under
    one object a request (~19 with the cycle 09e5ed5 removed)."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gc_cost.py"), "--rows", "W1", "--concurrency",
                          "1,16", "--seconds", "1", "--repository", str(repository)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| W1")]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [("W1", "1", "."), ("W1", "16", ".")], out
    for row in rows:
        requests, gen0, gen1, gen2, collected, us, slow = (float(x) for x in row[3:])
        assert requests > 100 and gen0 >= 0 and gen1 >= 0 and gen2 >= 0 and us >= 0 and slow >= 0, out
        assert collected < 1, out


@needs_wrk
def test_ab_pairs_two_servers_over_http_and_grpc(repository):
    """bench/ab.py: a row a server and point, over HTTP (wrk) and gRPC (each server with a port of its own),
    the first server the ratios' baseline."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), ".", ".+ATTEND_MAX_BATCH_WAIT_US=0",
                          "--workloads", "W1,W1grpc", "--concurrency", "4", "--rounds", "1", "--seconds", "1",
                          "--repository", str(repository)], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| W1")]
    assert [row[:3] for row in rows] == [[w, "4", server] for w in ("W1", "W1grpc")
                                         for server in (".", ".+ATTEND_MAX_BATCH_WAIT_US=0")], out
    for row in rows:
        rps, p50, p99, cpu_us, ratio = (float(x) for x in row[3:8])
        assert rps > 50 and 0 < p50 <= p99 and cpu_us > 0 and ratio > 0, out
    assert rows[0][7] == rows[2][7] == "1.000", out


def _plain_line(needle: str) -> int:
    """The line of bench/plain_server.py's route that holds `needle`."""
    lines = (ROOT / "bench" / "plain_server.py").read_text().splitlines()
    route = next(i for i, text in enumerate(lines) if text.startswith("async def attend"))
    return next(i for i, text in enumerate(lines[route:], route + 1) if needle in text)


def test_where_tells_each_stage_of_a_sample():
    """bench/where.py's stage of a sample (its frames as py-spy writes them, outermost first): the service's
    by function, the plain server's own lines by their source text, uvloop's C code by the loop's frame
    being the innermost."""
    import where

    loop = ["<module> (/x/service/__main__.py:1)", "Server.run (/v/site-packages/uvicorn/server.py:86)",
            "Runner.run (/usr/lib/python3.11/asyncio/runners.py:118)"]
    asgi = [*loop, "RequestResponseCycle.run_asgi (/v/site-packages/uvicorn/protocols/http/httptools_impl.py:422)"]
    ours = [*asgi, "InferenceEndpoint.__call__ (/x/service/http/endpoint.py:85)",
            "serve (/x/service/core/exchange.py:100)"]
    decode = [*ours, "decode_body (/x/service/protocols/attend.py:530)"]
    batch = [*ours, "Scheduler.submit (/x/service/core/batching.py:740)", "run_batch (/x/service/core/merge.py:90)"]
    plain = str(ROOT / "bench" / "plain_server.py")
    cases = {
        "session run": [*batch, "LoadedModel.run (/x/service/core/runtime.py:136)",
                        "Session.run (/v/site-packages/onnxruntime/capi/onnxruntime_inference_collection.py:395)"],
        "JSON parse": [*decode, "parse (/x/service/protocols/json_arrays.py:160)",
                       "_document (/x/service/protocols/json_arrays.py:148)"],
        "arrays and checks": [*decode, "decode (/x/service/protocols/attend.py:491)",
                              "finite (/x/service/core/request.py:60)"],
        "JSON encode": [*batch, "encode_answer (/x/service/protocols/attend.py:648)",
                        "attend_parts (/x/service/protocols/attend.py:641)"],
        "batching": [*batch, "merge (/x/service/core/merge.py:20)"],
        "socket write": [*ours, "send_body (/x/service/http/extensions.py:122)",
                         "CoalescingTransport.write (/x/service/http/transport.py:40)"],
        "metrics and logs": [*ours, "log_access (/x/service/core/logs.py:187)"],
        "HTTP, ASGI, framework": [*ours, "HttpExchange.__init__ (/x/service/http/endpoint.py:117)"],
        "event loop": loop,
        "other": [*loop, "something (/x/elsewhere.py:1)"],
    }
    for needle, stage in (("orjson.loads", "JSON parse"), ("orjson.dumps", "JSON encode"),
                          ("np.asarray", "arrays and checks")):
        cases[f"plain {stage}"] = [*asgi, "FastAPI.__call__ (/v/site-packages/fastapi/applications.py:1)",
                                   f"attend ({plain}:{_plain_line(needle)})"]
    for name, stack in cases.items():
        assert where.stage_of(stack) == name.removeprefix("plain "), name
    assert where.stage_of([*asgi, "FastAPI.__call__ (/v/site-packages/fastapi/applications.py:1)",
                           f"attend ({plain}:{_plain_line('name = data.get')})"]) == "HTTP, ASGI, framework"
    raw = "\n".join(f"{';'.join(stack)} {n}" for n, stack in enumerate(cases.values(), 1))
    raw += "\n_bootstrap (/usr/lib/python3.11/threading.py:1002);_worker (/x/thread.py:81) 99"  # another thread
    samples = where.main_thread_samples(raw)
    assert sum(samples.values()) == sum(range(1, len(cases) + 1)) and samples["session run"] == 1


@pytest.mark.slow
@needs_wrk
def test_where_splits_each_servers_cpu_a_request_into_its_stages(repository):
    """bench/where.py on both real servers under wrk: a row a stage for each, its figures a split of the
    event loop thread's CPU a request (the rows add up to it; the whole process's is at least as much), and
    the stages every request goes through found in both servers' samples."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "where.py"), "--rows", "W1", "--concurrency", "16",
                          "--seconds", "2", "--repository", str(repository)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    table = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]]
             for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| stage", "| ---"))}
    import where

    assert list(table)[:len(where.STAGES)] == list(where.STAGES), out
    thread, process = table["event loop's thread, in all"], table["the process, in all"]
    for i in range(2):  # plain, service
        assert sum(table[s][i] for s in where.STAGES) == pytest.approx(thread[i], rel=0.02), out
        assert 20 < thread[i] <= process[i] * 1.01 and table["samples of the thread"][i] > 100, out
        for stage in ("session run", "JSON parse", "arrays and checks", "socket write", "HTTP, ASGI, framework"):
            assert table[stage][i] > 0, (stage, out)
    assert table["batching"][0] == 0 < table["batching"][1], out  # the plain server has none
    # The ceiling: the plain server's thread a request over the service's less its session runs and batching.
    free = thread[1] - table["session run"][1] - table["batching"][1]
    line = next(line for line in out.splitlines() if line.startswith("At most "))
    assert float(line.split()[2].rstrip("x")) == pytest.approx(thread[0] / free, abs=0.02), out


def test_the_underflow_bench_times_each_part_with_flush_to_zero_clear_and_set(repository):
    """bench/underflow.py: the Attention node, Softmax and the served graphs, each with MXCSR's flush-to-zero bit
    clear and set, a row each."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "underflow.py"), "--sizes", "1x32", "--calls", "3",
                          "--repository", str(repository)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 x 32")]
    assert len(rows) == 2 * (5 + 4), out.stdout  # one head and five: 5 parts, 2 graphs x 2 forms of lengths
    for row in rows:
        cells = row.strip("| ").split(" | ")[2:]
        clear, set_, ratio = (float(cell) for cell in cells)
        # The ratio is of the times before they were rounded: within what the rounding of each allows.
        half = 0.5 * 10.0 ** -len(cells[0].partition(".")[2])
        assert clear > 0 and set_ > 0
        assert (clear - half) / (set_ + half) * 0.99 <= ratio <= (clear + half) / max(set_ - half, 1e-12) * 1.01, row
