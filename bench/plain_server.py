"""The server a user could write instead of this service: the baseline `make bench` compares with.

A FastAPI route reading the raw body, orjson.loads, np.asarray(float32), session.run on the same ONNX
models (one intra-op thread), orjson.dumps with NumPy support; one uvicorn worker; no checks at all (a
bad request is a 500), no limits, no metrics, no batching.

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
sessions = {}
for folder in Path(os.environ.get("PLAIN_REPOSITORY", "model_repository")).iterdir():
    if (folder / "config.json").exists():
        config = json.loads((folder / "config.json").read_text())
        sessions[config["name"]] = ort.InferenceSession(str(folder / config["model_file"]), options,
                                                        providers=["CPUExecutionProvider"])
app = FastAPI()


@app.post("/attend")
async def attend(request: Request) -> Response:
    data = orjson.loads(await request.body())
    name = data.get("model", "dot_product")
    queries = np.asarray(data["queries"], dtype=np.float32)
    feed = {"queries": queries}
    if "keys" in data:
        feed["keys"] = np.asarray(data["keys"], dtype=np.float32)
        feed["values"] = np.asarray(data["values"], dtype=np.float32)
    n_k = feed.get("keys", queries).shape[1]
    lens = np.asarray(data.get("valid_lens") or [n_k] * len(queries), dtype=np.int64)
    if lens.ndim == 1:  # the graph takes one length per query
        lens = np.repeat(lens[:, None], queries.shape[1], axis=1)
    feed["valid_lens"] = lens
    outputs, weights = sessions[name].run(None, feed)
    return Response(orjson.dumps({"model": name, "outputs": outputs, "attention_weights": weights},
                                 option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
