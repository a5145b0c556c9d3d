"""The server a user could write instead of this service: the baseline `make bench` compares with.

A FastAPI route reading the raw body, orjson.loads, np.asarray(float32), session.run on the same ONNX
models (one intra-op thread), orjson.dumps with NumPy support; one uvicorn worker; no checks at all (a
bad request is a 500), no limits, no metrics, no batching. It serves every model of the repository, each
from the graph the service runs on the CPU (config.json's CPU variant where there is one, else model.onnx),
the graph's inputs from the body's fields of the same names, absent or 1-D valid lengths made 2-D.
With PLAIN_DEVICE=cuda it runs model.onnx on ONNX Runtime's CUDA execution provider instead (TF32 off,
as the service's default), as a user with a GPU would.

    PLAIN_REPOSITORY=model_repository uvicorn bench.plain_server:app --port 8001
"""

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson
from fastapi import FastAPI, Request, Response

options = ort.SessionOptions()
options.intra_op_num_threads = 1
# Errors only, as the service runs the CPU variant: ONNX Runtime would otherwise warn at every run of one
# that the weights' shape is not the 0 onnx's shape inference gave their n_k
# (export.repository.CPU_GRAPH_LOG_SEVERITY), a line on stderr a request.
options.log_severity_level = 3
cuda = os.environ.get("PLAIN_DEVICE", "cpu") == "cuda"
if cuda:
    ort.preload_dlls()  # CUDA's and cuDNN's libraries from their pip wheels, where they come that way
providers = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
sessions, inputs, outputs, ranks = {}, {}, {}, {}
for folder in Path(os.environ.get("PLAIN_REPOSITORY", "model_repository")).iterdir():
    if (folder / "config.json").exists():
        config = json.loads((folder / "config.json").read_text())
        # The graph the service runs on the device: on the CPU its CPU variant where there is one (an
        # Attention node), on CUDA model.onnx.
        variant = {} if cuda else config.get("variants", {}).get("cpu", {})
        graph = variant.get("file", config["model_file"])
        sessions[config["name"]] = ort.InferenceSession(str(folder / graph), options, providers=providers)
        if cuda and sessions[config["name"]].get_providers()[0] != "CUDAExecutionProvider":
            raise SystemExit("PLAIN_DEVICE=cuda, but ONNX Runtime could not load CUDA")
        inputs[config["name"]] = {i.name for i in sessions[config["name"]].get_inputs()}
        outputs[config["name"]] = [o.name for o in sessions[config["name"]].get_outputs()]
        ranks[config["name"]] = {o["name"]: len(o["shape"]) for o in config["outputs"]}
app = FastAPI()


@app.post("/attend")
async def attend(request: Request) -> Response:
    data = orjson.loads(await request.body())
    name = data.get("model", "dot_product")
    wanted = inputs[name]
    feed = {k: np.asarray(data[k], dtype=np.float32) for k in ("queries", "keys", "values", "scores") if k in wanted}
    if "valid_lens" in wanted:
        first = feed["scores"] if "scores" in feed else feed["queries"]
        n_k = first.shape[2] if "scores" in feed else feed.get("keys", first).shape[1]
        lens = np.asarray(data.get("valid_lens") or [n_k] * len(first), dtype=np.int64)
        if lens.ndim == 1:  # the graph takes one length per query
            lens = np.repeat(lens[:, None], first.shape[1], axis=1)
        feed["valid_lens"] = lens
    answer = dict(zip(outputs[name], sessions[name].run(None, feed), strict=True))
    # dot_product's CPU graph gives its weights with the axis of its one head, which config.json does not declare
    answer = {k: v.reshape(v.shape[:1] + v.shape[2:]) if v.ndim > ranks[name][k] else v for k, v in answer.items()}
    return Response(orjson.dumps({"model": name, **answer}, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json")
