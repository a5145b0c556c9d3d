"""The work of one request, with no HTTP in it: decode -> session run -> encode.

The HTTP route decodes here and queues the request for `service.batching`, which runs and
encodes it (merged with others) in a worker thread. `attend` does the three steps in a row, for
the in-process benchmark and for callers without a queue.
"""

from __future__ import annotations

import time

import numpy as np
import orjson

from service.decode import Request, RequestLimits, decode_body
from service.metrics import Metrics
from service.runtime import Registry

_ORJSON = orjson.OPT_SERIALIZE_NUMPY


class Dataplane:
    def __init__(self, registry: Registry, metrics: Metrics, limits: RequestLimits | None = None):
        self.registry = registry
        self.metrics = metrics
        self.limits = limits or RequestLimits()

    def decode(self, body: bytes) -> Request:
        """Raises ServiceError subclasses for bad input, with `.model` set to the model's name
        once it is known (for the metrics' label)."""
        return decode_body(body, self.registry, self.limits)

    def attend(self, body: bytes) -> bytes:
        """Decode, run and encode one request, in the calling thread."""
        request = self.decode(body)
        model = request.model
        start = time.perf_counter()
        outputs, weights = model.run(request.feed)
        self.metrics.inference.labels(model.name).observe(time.perf_counter() - start)
        return encode(model.name, outputs, weights if request.return_weights else None)


def encode(model: str, outputs: np.ndarray, weights: np.ndarray | None) -> bytes:
    return orjson.dumps({"model": model, "outputs": outputs, "attention_weights": weights}, option=_ORJSON)
