"""Triton's system shared memory (service.core.shm) against the real process, with Triton's own clients and
their shared memory module (tritonclient.utils.shared_memory): every kind and both forms of valid lengths
give /attend's numbers with the tensors in regions, over HTTP and gRPC; the register, status and unregister
calls; refusals that name the field; an object shrunk after it was registered; off by default; the admin
key; the workers share the regions; the in-flight budget and the request limits hold for a tensor in a region.
"""

import contextlib
import os
import uuid

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.server import free_port, running_service
from tests.service.test_v2 import _arrays, _bodies, _check, _expected

pytestmark = pytest.mark.slow

KEY, ADMIN = "shm-key", "shm-admin"


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    """(HTTP URL, gRPC address) of one service with shared memory on; a decode on the event loop reads at
    most 4 KiB of it (more is read on a decode thread). Its log, at the end: no traceback."""
    port = free_port()
    log = tmp_path_factory.mktemp("shm") / "service.log"
    with running_service(repository, log_path=log, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_SHARED_MEMORY="true", ATTEND_INLINE_DECODE_BYTES="4096") as (url, _):
        yield url, f"127.0.0.1:{port}"
    assert "Traceback" not in log.read_text()


def _client(protocol, server):
    url, address = server
    return httpclient.InferenceServerClient(url.removeprefix("http://")) if protocol == "http" else \
        grpcclient.InferenceServerClient(address)


@contextlib.contextmanager
def _region(byte_size):
    """A new object in /dev/shm (its key), removed afterwards."""
    key = f"/attend-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key, key, byte_size)
    try:
        yield handle, key
    finally:
        shm.destroy_shared_memory_region(handle)


def _put(handle, tensors, module, region):
    """The inputs, one after another in the region, each named by its offset; their total size."""
    inputs, offset = [], 0
    for name, array in tensors.items():
        shm.set_shared_memory_region(handle, [array], offset=offset)
        tensor = module.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
        tensor.set_shared_memory(region, array.nbytes, offset=offset)
        inputs.append(tensor)
        offset += array.nbytes
    return inputs


def _error(call):
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tensors_in_shared_memory_give_attends_numbers(server, protocol):
    client, module = _client(protocol, server), httpclient if protocol == "http" else grpcclient
    url = server[0]
    with _region(1 << 16) as (inputs_handle, inputs_key), _region(1 << 16) as (outputs_handle, outputs_key):
        client.register_system_shared_memory("in", inputs_key, 1 << 16)
        client.register_system_shared_memory("out", outputs_key, 1 << 16)
        try:
            for body in _bodies():
                model, tensors = _arrays(body)
                expected = _expected(url, body)
                names = [o["name"] for o in httpx.get(f"{url}/v2/models/{model}").json()["outputs"]]
                outputs, offsets, offset = [], {}, 0
                for name in names:
                    output = module.InferRequestedOutput(name)
                    output.set_shared_memory("out", 1 << 14, offset=offset)
                    outputs.append(output)
                    offsets[name], offset = offset, offset + (1 << 14)
                result = client.infer(model, _put(inputs_handle, tensors, module, "in"), outputs=outputs)
                for name in names:
                    if expected.get(name) is None:
                        continue
                    answer = result.get_output(name)
                    shape = list(answer["shape"] if protocol == "http" else answer.shape)
                    got = shm.get_contents_as_numpy(outputs_handle, np.float32, shape, offset=offsets[name])
                    np.testing.assert_allclose(got, np.array(expected[name]), rtol=1e-6, atol=1e-7)
                # Nothing of theirs in the answer: an entry without data or parameters (as Triton's), an empty
                # raw_output_contents.
                response = result.get_response()
                if protocol == "http":
                    assert [set(o) for o in response["outputs"]] == [{"name", "datatype", "shape"}] * len(names)
                else:
                    assert list(response.raw_output_contents) == [b""] * len(names)
                # Inputs in a region, outputs in the answer; and one input in the body beside the others.
                inputs = _put(inputs_handle, tensors, module, "in")
                first = next(iter(tensors))
                inputs[0] = module.InferInput(first, list(tensors[first].shape), inputs[0].datatype())
                inputs[0].set_data_from_numpy(tensors[first])
                _check(client.infer(model, inputs), expected)
        finally:
            client.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_large_tensor_in_a_region_is_read_on_a_decode_thread(server, protocol):
    """A small body that names more shared memory than a decode on the event loop may read (4 KiB here)
    is decoded again on a thread: the answer is the one its tensors give in the body."""
    client, module = _client(protocol, server), httpclient if protocol == "http" else grpcclient
    rng = np.random.default_rng(5)
    tensors = {"queries": rng.normal(size=(2, 4, 64)).astype(np.float32),
               "keys": rng.normal(size=(2, 256, 64)).astype(np.float32),
               "values": rng.normal(size=(2, 256, 64)).astype(np.float32), "valid_lens": np.array([100, 256])}
    inline = []
    for name, array in tensors.items():
        tensor = module.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(array)
        inline.append(tensor)
    expected = client.infer("dot_product", inline)
    with _region(1 << 20) as (handle, key):
        client.register_system_shared_memory("big", key, 1 << 20)
        try:
            result = client.infer("dot_product", _put(handle, tensors, module, "big"))
        finally:
            client.unregister_system_shared_memory()
    for name in ("outputs", "attention_weights"):
        np.testing.assert_array_equal(result.as_numpy(name), expected.as_numpy(name))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_register_status_and_unregister(server, protocol):
    client = _client(protocol, server)

    def names():
        status = client.get_system_shared_memory_status()
        return sorted(r["name"] for r in status) if protocol == "http" else sorted(status.regions)

    with _region(64) as (_, key):
        client.register_system_shared_memory("a", key, 32)
        client.register_system_shared_memory("b", key, 32, offset=32)
        assert names() == ["a", "b"]
        one = client.get_system_shared_memory_status("b")
        if protocol == "http":
            assert one == [{"name": "b", "key": key, "offset": 32, "byte_size": 32}]
        else:
            region = one.regions["b"]
            assert (region.name, region.key, region.offset, region.byte_size) == ("b", key, 32, 32)
        assert "registered already" in _error(lambda: client.register_system_shared_memory("a", key, 8)).message()
        client.unregister_system_shared_memory("a")
        client.unregister_system_shared_memory("a")  # none such: nothing to do, as Triton
        assert names() == ["b"]
        error = _error(lambda: client.get_system_shared_memory_status("a"))
        assert "no system shared memory region 'a' is registered" in error.message()
        assert error.status() == ("404" if protocol == "http" else "StatusCode.NOT_FOUND")
        if protocol == "http":  # the routes for every region take no name from the query
            client.register_system_shared_memory("c", key, 32)
            url = server[0]
            assert len(httpx.get(f"{url}/v2/systemsharedmemory/status?name=b").json()) == 2
            assert httpx.post(f"{url}/v2/systemsharedmemory/unregister?name=b").status_code == 200
            assert names() == []
        client.unregister_system_shared_memory()
        assert names() == []


def test_at_most_max_regions_are_registered(server):
    """A bound on what registering holds (a line each of the file the workers share): past it, a 400."""
    from service.core.shm import MAX_REGIONS

    client = _client("http", server)
    with _region(8) as (_, key):
        try:
            for i in range(MAX_REGIONS):
                client.register_system_shared_memory(f"r{i}", key, 8)
            error = _error(lambda: client.register_system_shared_memory("one-more", key, 8))
            assert error.status() == "400" and f"{MAX_REGIONS} regions are registered" in error.message(), error
            assert len(client.get_system_shared_memory_status()) == MAX_REGIONS
        finally:
            client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []


def test_refusals_name_the_field(server):
    url, _ = server
    client = _client("http", server)

    def refused(call):
        error = _error(call)
        assert error.status() in ("400", "404"), error
        return error.message()

    with _region(64) as (handle, key):
        assert "key must name one object of /dev/shm" in refused(
            lambda: client.register_system_shared_memory("x", "/../etc/passwd", 8))
        assert "key must name one object of /dev/shm" in refused(
            lambda: client.register_system_shared_memory("x", "a/b", 8))
        assert "cannot open '/attend-none' in /dev/shm: No such file or directory" in refused(
            lambda: client.register_system_shared_memory("x", "/attend-none", 8))
        assert f"offset 60 + byte_size 8 is past the end of '{key}', 64 bytes" in refused(
            lambda: client.register_system_shared_memory("x", key, 8, offset=60))
        response = httpx.post(f"{url}/v2/systemsharedmemory/region/x/register", content=b'{"key": 1}')
        assert response.status_code == 400 and "key" in response.json()["error"], response.text
        client.register_system_shared_memory("r", key, 64)
        try:
            tensors = {"queries": np.ones((1, 1, 2), np.float32), "keys": np.ones((1, 3, 2), np.float32),
                       "values": np.ones((1, 3, 2), np.float32)}

            def infer(change=None, outputs=None):
                inputs = _put(handle, tensors, httpclient, "r")
                if change:
                    change(inputs)
                return refused(lambda: client.infer("dot_product", inputs, outputs=outputs))

            assert "input queries: shared_memory_byte_size is 4 bytes, but shape [1, 1, 2] of FP32 takes 8" in infer(
                lambda inputs: inputs[0].set_shared_memory("r", 4))
            assert "input keys: offset 60 + shared_memory_byte_size 24 is past the end of region 'r', 64 bytes" in \
                infer(lambda inputs: inputs[1].set_shared_memory("r", 24, offset=60))
            assert "no system shared memory region 'nope' is registered" in infer(
                lambda inputs: inputs[2].set_shared_memory("nope", 24))
            small = httpclient.InferRequestedOutput("outputs")
            small.set_shared_memory("r", 4)
            assert "output outputs: shared_memory_byte_size is 4 bytes, the output takes 8" in infer(outputs=[small])
            # Data and a region for one input: refused, naming it.
            body = {"inputs": [{"name": "queries", "shape": [1, 1, 2], "datatype": "FP32", "data": [1, 2],
                                "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]}
            response = httpx.post(f"{url}/v2/models/dot_product/infer", json=body)
            assert response.status_code == 400
            assert response.json() == {"error": "input queries has data and a shared_memory_region: send one"}
        finally:
            client.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_object_shrunk_after_it_was_registered_is_refused_and_the_server_goes_on(server, protocol):
    """A mapping's read past the object's end would be a SIGBUS, the end of the process: the service reads
    by pread, which says how much it found."""
    client, module = _client(protocol, server), httpclient if protocol == "http" else grpcclient
    tensors = {"queries": np.ones((2, 1, 2), np.float32), "keys": np.ones((2, 3, 2), np.float32),
               "values": np.ones((2, 3, 2), np.float32)}
    with _region(256) as (handle, key):
        client.register_system_shared_memory("s", key, 256)
        try:
            inputs = _put(handle, tensors, module, "s")
            os.truncate(f"/dev/shm/{key.lstrip('/')}", 20)
            error = _error(lambda: client.infer("dot_product", inputs))
            assert f"its object '{key}' shrank since it was registered" in error.message()
            assert error.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
            os.truncate(f"/dev/shm/{key.lstrip('/')}", 256)
            np.testing.assert_allclose(client.infer("dot_product", _put(handle, tensors, module, "s")).as_numpy(
                "outputs"), np.ones((2, 1, 2)), rtol=1e-6)
        finally:
            client.unregister_system_shared_memory()


def test_a_tensor_in_a_region_is_held_in_the_budget_and_the_limits(repository):
    """The in-flight budget counts the copy a region's tensor is read into before it is read; the request
    limits hold for its shape."""
    with running_service(repository, ATTEND_SHARED_MEMORY="true", ATTEND_MAX_INFLIGHT_BYTES=str(1 << 20),
                         ATTEND_MAX_SEQUENCE="64") as (url, _), _region(8 << 20) as (handle, key):
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        client.register_system_shared_memory("big", key, 8 << 20)
        big = {"queries": np.ones((1, 1, 4096), np.float32), "keys": np.ones((1, 64, 4096), np.float32),
               "values": np.ones((1, 64, 4096), np.float32)}
        error = _error(lambda: client.infer("dot_product", _put(handle, big, httpclient, "big")))
        assert error.status() == "413" and "over this service's limit of 1048576 (ATTEND_MAX_INFLIGHT_BYTES)" in \
            error.message(), error
        long = {"queries": np.ones((1, 65, 2), np.float32), "keys": np.ones((1, 3, 2), np.float32),
                "values": np.ones((1, 3, 2), np.float32)}
        error = _error(lambda: client.infer("dot_product", _put(handle, long, httpclient, "big")))
        assert error.status() == "413" and "ATTEND_MAX_SEQUENCE" in error.message(), error


def test_off_by_default(repository):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port)) as (url, _), _region(64) as (_, key):
        assert "system_shared_memory" not in httpx.get(f"{url}/v2").json()["extensions"]
        for client in (httpclient.InferenceServerClient(url.removeprefix("http://")),
                       grpcclient.InferenceServerClient(f"127.0.0.1:{port}")):
            error = _error(lambda c=client: c.register_system_shared_memory("r", key, 64))
            assert "system shared memory is off: ATTEND_SHARED_MEMORY=true turns it on" in error.message()
            assert error.status() in ("404", "StatusCode.NOT_FOUND")
        body = {"inputs": [{"name": "queries", "shape": [1, 1, 2], "datatype": "FP32",
                            "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]}
        response = httpx.post(f"{url}/v2/models/dot_product/infer", json=body)
        assert response.status_code == 404
        assert response.json() == {"error": "input queries names shared memory region 'r', but system shared memory "
                                            "is off (ATTEND_SHARED_MEMORY)"}


def test_registering_takes_an_admin_key_where_they_are_set(repository):
    with running_service(repository, ATTEND_SHARED_MEMORY="true", ATTEND_API_KEYS=KEY,
                         ATTEND_ADMIN_KEYS=ADMIN) as (url, _), _region(256) as (handle, key):
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
        for headers in ({}, user):
            error = _error(lambda h=headers: client.register_system_shared_memory("r", key, 256, headers=h))
            assert error.status() == "401", error
            assert _error(lambda h=headers: client.get_system_shared_memory_status(headers=h)).status() == "401"
        client.register_system_shared_memory("r", key, 256, headers=admin)
        tensors = {"queries": np.ones((1, 1, 2), np.float32), "keys": np.ones((1, 3, 2), np.float32),
                   "values": np.ones((1, 3, 2), np.float32)}
        result = client.infer("dot_product", _put(handle, tensors, httpclient, "r"), headers=user)
        np.testing.assert_allclose(result.as_numpy("outputs"), np.ones((1, 1, 2)), rtol=1e-6)
        assert _error(lambda: client.infer("dot_product", _put(handle, tensors, httpclient, "r"))).status() == "401"


def test_the_workers_share_the_regions(repository):
    """A region registered through one worker is there for the others, and gone from all once unregistered:
    requests on new connections reach both workers (SO_REUSEPORT), every one served, then every one refused."""
    tensors = {"queries": np.ones((1, 1, 2), np.float32), "keys": np.ones((1, 3, 2), np.float32),
               "values": np.ones((1, 3, 2), np.float32)}
    with running_service(repository, ATTEND_SHARED_MEMORY="true", ATTEND_WORKERS="2",
                         ATTEND_INTRA_OP_THREADS="1") as (url, _), _region(256) as (handle, key):
        address = url.removeprefix("http://")
        httpclient.InferenceServerClient(address).register_system_shared_memory("w", key, 256)
        for _ in range(24):
            client = httpclient.InferenceServerClient(address)  # a new connection each time
            result = client.infer("dot_product", _put(handle, tensors, httpclient, "w"))
            np.testing.assert_allclose(result.as_numpy("outputs"), np.ones((1, 1, 2)), rtol=1e-6)
            client.close()
        httpclient.InferenceServerClient(address).unregister_system_shared_memory("w")
        for _ in range(24):
            client = httpclient.InferenceServerClient(address)
            error = _error(lambda c=client: c.infer("dot_product", _put(handle, tensors, httpclient, "w")))
            assert "no system shared memory region 'w' is registered" in error.message()
            client.close()


def test_a_decode_on_the_event_loop_leaves_the_parse_of_another_workers_change_to_a_thread(tmp_path):
    """With workers the regions are a file they share; reading it again after another worker changed it parses
    up to MAX_REGIONS regions: a decode on the event loop hands itself to a thread instead (Offload)."""
    import threading

    from service.core.shm import Offload, Regions
    from service.protocols.v2 import SharedReads

    (tmp_path / "object").write_bytes(bytes(64))
    shared = tmp_path / "regions.json"
    mine, another_worker = Regions(shared, tmp_path), Regions(shared, tmp_path)
    on_the_loop = SharedReads(mine, 1 << 20, threading.get_ident())
    on_a_thread = SharedReads(mine, 1 << 20, None)
    assert on_the_loop.of("input x", "r") is mine  # no file yet: nothing to parse
    another_worker.register("r", "object", 0, 64)
    with pytest.raises(Offload):
        on_the_loop.of("input x", "r")
    assert on_a_thread.of("input x", "r") is mine and mine.get("r").byte_size == 64  # the thread parses it
    assert on_the_loop.of("input x", "r") is mine  # parsed: the loop goes on
    assert on_the_loop.tensor("r", 64, 0, "x", [16], "FP32", np.dtype(np.float32), None).shape == (16,)
    another_worker.unregister("r")
    with pytest.raises(Offload):
        on_the_loop.of("input x", "r")
