"""Triton's trace settings (its trace extension) over OpenTelemetry's spans: which requests are traced.

    trace_level   ["TIMESTAMPS"]: traced; ["OFF"]: none (TENSORS: refused, the spans hold no tensor)
    trace_rate    "N": one request in N is offered to the sampler (OTEL_TRACES_SAMPLER decides as before)
    trace_count   "-1": no limit; "N": N more traces, then none (with workers, N in all)
    trace_file "", log_frequency "0", trace_mode "opentelemetry": the only values (spans leave by OTLP)

A model's settings override the global ones for the requests that name it in their path (the Open Inference
Protocol's, HTTP and gRPC); /attend names its model in the body, after the choice: the global ones apply.
`take` is the request path's one call (tracing.begin). With workers the settings are a file of the start's
shared folder (Dataplane.share) and each count a file of its own, taken under a lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.core.errors import ServiceError
from service.core.logs import escape

log = logging.getLogger("service")

NAMES = ("trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")
_FIXED = {"trace_file": "", "log_frequency": "0", "trace_mode": "opentelemetry"}
_LEVELS = ("OFF", "TIMESTAMPS")
_MAX = 2**62  # a rate or count past this is a typo, and stays an int64


class InvalidTraceSettings(ServiceError):
    """A trace setting that is not one of Triton's, or a value this service cannot take."""

    status, code = 400, "invalid_trace_settings"
    advice = ("Send some of trace_level ([\"TIMESTAMPS\"] or [\"OFF\"]), trace_rate (\"1\" or more) and trace_count "
              "(\"-1\" or more); null clears a model's setting. GET /v2/trace/setting shows them.")


def checked(changes: dict[str, Any], traced: bool) -> dict[str, Any]:
    """`changes` as settings (trace_level a list of str, trace_rate and trace_count int), None where one is
    cleared; InvalidTraceSettings naming the first that cannot be taken. `traced`: OTEL_* turned tracing on."""
    out: dict[str, Any] = {}
    for name, value in changes.items():
        if name not in NAMES:
            raise InvalidTraceSettings(f"{escape(str(name))[:100]} is not a trace setting; they are "
                                       f"{', '.join(NAMES)}", field=str(name)[:100])
        if value is None or value == []:
            out[name] = None
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) or (v.__class__ is int and name != "trace_level") for v in values):
            raise InvalidTraceSettings(f"{name} must be a string" + (" or a list of them" if name == "trace_level"
                                                                     else ""), field=name)
        if name == "trace_level":
            levels = [v.upper() for v in values]
            bad = [v for v in levels if v not in _LEVELS]
            if "TENSORS" in bad:
                raise InvalidTraceSettings("trace_level TENSORS is not traced: the spans hold each stage's times, "
                                           "never a tensor", field=name)
            if bad or len(set(levels)) > 1:
                raise InvalidTraceSettings(f"trace_level must be [\"TIMESTAMPS\"] or [\"OFF\"], not "
                                           f"{escape(str(values))[:100]}", field=name)
            if levels[0] == "TIMESTAMPS" and not traced:
                raise InvalidTraceSettings("trace_level TIMESTAMPS: tracing is off; OTEL_EXPORTER_OTLP_ENDPOINT (or "
                                           "OTEL_TRACES_EXPORTER) at the start turns it on", field=name)
            out[name] = levels[0] == "TIMESTAMPS"
            continue
        if len(values) != 1:
            raise InvalidTraceSettings(f"{name} takes one value", field=name)
        text = str(values[0]).strip()
        if name in _FIXED:
            if text != _FIXED[name]:
                why = ("the service traces through OpenTelemetry" if name == "trace_mode" else
                       "the spans leave through OpenTelemetry's exporter (OTEL_*), never to a file a request names")
                raise InvalidTraceSettings(f"{name} must be \"{_FIXED[name]}\": {why}", field=name)
            continue
        low = 1 if name == "trace_rate" else -1
        try:
            number = int(text) if text.lstrip("-").isascii() and text.lstrip("-").isdigit() else None
        except ValueError:
            number = None
        if number is None or not low <= number <= _MAX:
            raise InvalidTraceSettings(f"{name} must be an integer, {low} or more, as a string (\"{max(low, 1)}\")",
                                       field=name)
        out[name] = number
    return out


class Count:
    """What is left of a trace_count: in this process, or (`path`) in a file its workers share, under a lock."""

    __slots__ = ("left", "fd")

    def __init__(self, left: int, path: Path | None = None):
        self.left = left
        self.fd = None if path is None else os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def add(self, n: int) -> bool:
        """Take one (`n` -1; False where none is left) or give one back (+1)."""
        if self.fd is None:
            if self.left + n < 0:
                return False
            self.left += n
            return True
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # held for a read and a write of 8 bytes
        try:
            left = struct.unpack("<q", os.pread(self.fd, 8, 0))[0] + n
            if left < 0:
                return False
            os.pwrite(self.fd, struct.pack("<q", left), 0)
            return True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def value(self) -> int:
        return self.left if self.fd is None else struct.unpack("<q", os.pread(self.fd, 8, 0))[0]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Scope:
    """The global settings, or a model's: whether its requests are traced, one in how many, and its count
    (None: no limit; a model with no count of its own shares the global one)."""

    __slots__ = ("on", "rate", "seen", "count")

    def __init__(self, on: bool, rate: int, count: Count | None):
        self.on, self.rate, self.seen, self.count = on, rate, 0, count


class TraceSettings:
    """The process's trace settings: the start's, changed by `update`, followed from the shared folder."""

    def __init__(self, traced: bool, folder: str | None = None, share: Callable[[str, Any], None] | None = None):
        self.traced = traced
        self.folder = None if folder is None else Path(folder)
        self.share = share  # writes the settings for the other workers and tells them (Dataplane.share)
        self.start = {"trace_level": traced, "trace_rate": 1, "trace_count": -1}
        self.state: dict[str, Any] = {"global": {}, "models": {}, "counts": {}}  # what `update` changed
        self.scopes: dict[str, Scope] = {}
        self.glob = Scope(traced, 1, None)
        self._counts: dict[str, tuple[Any, Count]] = {}  # a scope's ("": the global one) token and count
        self._made = 0

    def _scope(self, model: str | None) -> Scope:
        return self.scopes.get(model, self.glob) if self.scopes and model else self.glob

    def take(self, model: str | None) -> bool:
        """Whether this request is offered to the sampler; then `give_back` where the sampler dropped it."""
        scope = self._scope(model)
        if not scope.on:
            return False
        if scope.rate > 1:
            scope.seen += 1
            if scope.seen % scope.rate:
                return False
        return scope.count is None or scope.count.add(-1)

    def give_back(self, model: str | None) -> None:
        scope = self._scope(model)
        if scope.count is not None:
            scope.count.add(1)

    def get(self, model: str | None = None) -> dict[str, Any]:
        """Triton's settings as its HTTP answer has them (trace_level a list, the others strings)."""
        merged = {**self.start, **self.state["global"], **(self.state["models"].get(model, {}) if model else {})}
        scope = self._scope(model)
        count = merged["trace_count"] if scope.count is None else scope.count.value()
        return {"trace_file": "", "trace_level": ["TIMESTAMPS" if merged["trace_level"] else "OFF"],
                "trace_rate": str(merged["trace_rate"]), "trace_count": str(count), "log_frequency": "0",
                "trace_mode": "opentelemetry"}

    def update(self, model: str | None, changes: dict[str, Any]) -> dict[str, Any]:
        """`changes` applied (checked: InvalidTraceSettings) to the global settings or to `model`'s, here and
        with workers in them all; the settings after."""
        settings = checked(changes, self.traced)
        state = {"global": dict(self.state["global"]), "models": {m: dict(s) for m, s in self.state["models"].items()},
                 "counts": dict(self.state["counts"])}
        key = model or ""
        target = state["global"] if not model else state["models"].setdefault(model, {})
        for name, value in settings.items():
            if value is None:
                target.pop(name, None)
            else:
                target[name] = value
            if name == "trace_count":
                state["counts"].pop(key, None)  # a count set anew starts from its value
        if model and not target:
            del state["models"][model]
        replaced = self.state["counts"].get(key)
        if "trace_count" in settings and target.get("trace_count", -1) >= 0:
            self._made += 1
            state["counts"][key] = self._made if self.folder is None else self._count_file(target["trace_count"])
        self.apply(state)
        if self.share is not None:
            self.share("trace.json", state)
        if self.folder is not None and replaced is not None and replaced != state["counts"].get(key):
            (self.folder / replaced).unlink(missing_ok=True)  # the workers that still have it open keep it
        return self.get(model)

    def _count_file(self, left: int) -> str:
        with tempfile.NamedTemporaryFile("wb", dir=self.folder, prefix="trace-count-", delete=False) as out:
            out.write(struct.pack("<q", left))
        return Path(out.name).name

    def apply(self, state: dict[str, Any]) -> None:
        """The scopes `state` says (from `update`, or another worker's, read by `follow`). A count not set anew
        keeps what is left of it (its token: a file's name with workers, a number without)."""
        old, counts = self._counts, {}

        def count(key: str, settings: dict[str, Any]) -> Count | None:
            left = settings.get("trace_count", -1)
            token = state["counts"].get(key)
            if left < 0 or token is None:
                return None
            kept = old.get(key)
            if kept is not None and kept[0] == token:
                counts[key] = kept
            else:
                counts[key] = (token, Count(left, None if self.folder is None else self.folder / token))
            return counts[key][1]

        merged = {**self.start, **state["global"]}
        try:
            glob = Scope(merged["trace_level"], merged["trace_rate"], count("", merged))
            scopes = {}
            for model, own in state["models"].items():
                mine = {**merged, **own}
                scopes[model] = Scope(mine["trace_level"], mine["trace_rate"],
                                      count(model, mine) if "trace_count" in own else glob.count)
        except OSError:  # a count file gone: what this opened is closed, the settings stay as they were
            for key, (_, c) in counts.items():
                if old.get(key, (None, None))[1] is not c:
                    c.close()
            raise
        self.state, self.glob, self.scopes, self._counts = state, glob, scopes, counts
        kept = {id(c) for _, c in counts.values()}
        for _, c in old.values():
            if id(c) not in kept:
                c.close()

    def follow(self, state: dict[str, Any] | None) -> None:
        """Another worker's settings (None: none changed them yet)."""
        if state is not None:
            try:
                self.apply(state)
            except FileNotFoundError:  # a count file replaced meanwhile: the newer settings follow (SIGHUP)
                log.warning("trace settings: a count file was replaced while read; the next change follows")
