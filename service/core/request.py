"""Tensors -> a validated `Request`: the one place where every protocol's arrays are checked against
the model's signature (shapes bound, float32 finite, valid lengths whole and within n_k) and the
per-request limits (ATTEND_MAX_*). /attend's codec and the Open Inference Protocol's both end here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from export.repository import NAME_RULE, TensorSpec, valid_lens_2d, valid_name
from service.core.errors import InvalidRequest, InvalidShape, ModelNotFound, ModelUnavailable, PayloadTooLarge, excerpt
from service.core.runtime import LoadedModel, Registry


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (ATTEND_MAX_*); beyond it: 413 naming the limit."""

    batch: int = 1024
    sequence: int = 4096
    features: int = 4096
    weight_elements: int = 4 * 1024 * 1024


@dataclass
class Request:
    model: LoadedModel
    feed: dict[str, np.ndarray]  # the graph's inputs, valid_lens already 2-D int64
    return_weights: bool
    # What depends only on the body's layout, shared by the requests of one plan (see _Plan), for the
    # stages after the decode to keep what they work out from the shapes alone (service.core.batching.Job).
    memo: dict[str, Any] | None = None
    held: int = 0  # bytes of the body its feed still reads (binary tensors read in place), for its cost
    timeout_s: float | None = None  # the body's own bound from its arrival (the protocol's `timeout` parameter)
    text_answer: bool = True  # its answer's numbers are written as text (JSON), not as bytes: see Job.text


SEQUENCE_AXES = frozenset({"n", "n_q", "n_k"})


_F32_MAX = float(np.finfo(np.float32).max)
# The most axes an array of a request may have, in any protocol: the models take 3 or 4; deeper nesting
# (or a longer shape) is refused before it is walked.
MAX_DIMS = 8


# Zeros to take a dot product with (`finite`): as many as a small body has numbers, or W2's outputs.
_ZEROS = np.zeros(1 << 16, dtype=np.float32)
_ZEROS.flags.writeable = False
# Its NaN is the answer, not a fault: NumPy's warning about it would only repeat it.
warnings.filterwarnings("ignore", message="invalid value encountered in dot", category=RuntimeWarning,
                        module=r"service\.core\.request")


def finite(array: np.ndarray) -> bool:
    """Every number of a float32 array finite (numbers beyond float32's range were cast to inf): x * 0 is 0
    for those, NaN for inf and NaN, so one dot product with zeros, where isfinite takes two calls and a
    Python wrapper (docs/archive.md weighs them)."""
    flat = array.reshape(-1)
    if flat.size > _ZEROS.size:
        return bool(np.isfinite(flat).all())
    return bool(flat.dot(_ZEROS[:flat.size]) == 0)


def pattern(model: LoadedModel, field: str, bound: dict[str, int] | None = None) -> list[int | str]:
    spec = next(s for s in model.inputs() if s.name == field)
    bound = bound or {}
    return [bound.get(d, d) if isinstance(d, str) else d for d in spec.shape]


def _float32(arr: np.ndarray, field: str, model: LoadedModel, checked: bool = False) -> np.ndarray:
    if arr.ndim != 3:
        raise InvalidShape(f"{field} must be 3-D (batch, n, features), got {arr.ndim}-D", field=field,
                           expected=pattern(model, field), received=list(arr.shape))
    if arr.size == 0:
        raise InvalidShape(f"{field} must not be empty", field=field, expected=pattern(model, field),
                           received=list(arr.shape))
    if checked:
        return arr
    out = arr.astype(np.float32, copy=False)  # beyond float32's range becomes inf, refused just below
    if not finite(out):
        raise InvalidRequest(f"{field} must hold finite float32 numbers (|x| <= {_F32_MAX:.4g})", field=field)
    return out


def _bind(spec: TensorSpec, arr: np.ndarray, bound: dict[str, int], first_seen: dict[str, str],
          model: LoadedModel) -> None:
    """Match `arr.shape` to `spec.shape`: fixed sizes must be equal, a named axis takes the size
    of its first occurrence (batch, n_k, d ...) and every later occurrence must agree."""
    for axis, (want, got) in enumerate(zip(spec.shape, arr.shape, strict=True)):
        if want.__class__ is int:
            if got != want:
                raise InvalidShape(
                    f"{spec.name} must have {want} features (axis {axis}) for model {model.name}, got {got}",
                    field=spec.name, expected=pattern(model, spec.name, _before(spec, bound, first_seen)),
                    received=list(arr.shape))
        elif want in bound:
            if got != bound[want]:
                other = first_seen[want]
                raise InvalidShape(
                    f"{spec.name} has {want} = {got} on axis {axis}, but {other} has {want} = {bound[want]}",
                    field=spec.name, expected=pattern(model, spec.name, _before(spec, bound, first_seen)),
                    received=list(arr.shape))
        else:
            bound[want] = got
            first_seen[want] = spec.name


def _before(spec: TensorSpec, bound: dict[str, int], first_seen: dict[str, str]) -> dict[str, int]:
    """What the fields before `spec` fixed: the expected shape of an error is stated with those."""
    return {axis: size for axis, size in bound.items() if first_seen[axis] != spec.name}


def check_valid_lens(lens: np.ndarray | None, batch: int, n_q: int, n_k: int) -> np.ndarray:
    """(batch, n_q) int64 from absent, (batch,) or (batch, n_q) whole numbers in 0..n_k."""
    if lens is None:
        return valid_lens_2d(None, batch, n_q, n_k)
    field = "valid_lens"
    if lens.shape not in ((batch,), (batch, n_q)):
        raise InvalidShape(f"valid_lens must have shape [batch] or [batch, n_q], got {list(lens.shape)}", field=field,
                           expected=f"null, [batch] = [{batch}] or [batch, n_q] = [{batch}, {n_q}]",
                           received=list(lens.shape))
    if lens.size <= 64:  # a few lengths: plain Python is several times faster than NumPy's calls
        values = lens.ravel().tolist()
        whole = all(map(float.is_integer, values)) if lens.dtype.kind == "f" else True
        low, high = (min(values), max(values)) if values else (0, 0)
    else:
        whole = lens.dtype.kind != "f" or bool((lens == np.floor(lens)).all())
        low, high = lens.min(), lens.max()
    if not whole:
        bad = float(lens[lens != np.floor(lens)].flat[0])
        raise InvalidRequest(f"valid_lens must be whole numbers, got {bad}", field=field,
                             expected=f"integers from 0 to n_k = {n_k}", received=bad)
    if low < 0 or high > n_k:
        bad = low if low < 0 else high
        bad = int(bad) if -2**63 <= bad < 2**63 else float(bad)  # int64 prints whole, a larger number as JSON read it
        raise InvalidRequest(f"valid_lens must be between 0 and n_k = {n_k}, got {bad}", field=field,
                             expected=f"0 <= valid_len <= {n_k}", received=bad)
    out = np.empty((batch, n_q), dtype=np.int64)
    out[...] = lens[:, None] if lens.ndim == 1 else lens
    return out


def _check_limits(limits: RequestLimits, model: LoadedModel, batch: int, n_q: int, n_k: int,
                  feed: dict[str, np.ndarray]) -> None:
    def refuse(what: str, got: int, limit: int, setting: str, field: str = "queries") -> None:
        raise PayloadTooLarge(f"{what} is {got}, over this service's limit of {limit} ({setting})", field=field,
                              expected=f"<= {limit}", received=got)

    first = model.inputs()[0].name  # queries, or scores
    if batch > limits.batch:
        refuse("batch", batch, limits.batch, "ATTEND_MAX_BATCH", first)
    if n_q > limits.sequence:
        refuse("n_q", n_q, limits.sequence, "ATTEND_MAX_SEQUENCE", first)
    if n_k > limits.sequence:
        refuse("n_k", n_k, limits.sequence, "ATTEND_MAX_SEQUENCE", "keys" if "keys" in feed else first)
    for spec in model.inputs():
        if spec.name in feed and spec.shape[-1] not in SEQUENCE_AXES and feed[spec.name].shape[-1] > limits.features:
            size = feed[spec.name].shape[-1]
            refuse(f"the feature size of {spec.name}", size, limits.features, "ATTEND_MAX_FEATURES", spec.name)
    if "attention_weights" not in model.output_names:
        return
    elements = batch * int(model.config.hyperparameters.get("num_heads", 1)) * n_q * n_k
    if elements > limits.weight_elements:
        refuse("batch * heads * n_q * n_k (the attention weights)", elements, limits.weight_elements,
               "ATTEND_MAX_WEIGHT_ELEMENTS", first)


def build_request(model: LoadedModel, tensors: dict[str, np.ndarray], valid_lens: np.ndarray | None,
                  return_weights: bool, limits: RequestLimits, finite_float32: bool = False) -> Request:
    """The request for `model` from its input tensors (any float dtype, checked and made float32,
    unless the caller did: `finite_float32`) and valid lengths (absent, or any numeric dtype): shapes
    bound against the signature, limits."""
    feed, (batch, n_q, n_k) = checked_feed(model, tensors, limits, finite_float32)
    if "valid_lens" in model.input_names:
        feed["valid_lens"] = check_valid_lens(valid_lens, batch, n_q, n_k)
    return Request(model=model, feed=feed, return_weights=return_weights)


@dataclass(frozen=True, slots=True)
class _FeedPlan:
    """A model's float inputs' signature, read once per snapshot (LoadedModel.derived), for the one
    check of a request's shapes that passes (`checked_feed`): the shapes of its inputs one after the other
    (`joined`), what sizes the signature fixes at which places of it, and where each named axis is."""

    names: tuple[str, ...]  # the float inputs (not the valid lengths)
    ndims: tuple[int, ...]
    fixed: tuple[tuple[int, int], ...]  # (place in joined, size)
    same: tuple[tuple[int, int], ...]  # (place, place of the axis' first occurrence): equal sizes
    batch: int  # places of the first occurrence of batch, n_q (or n), n_k (or n); -1: the model has none
    n_q: int
    n_k: int
    d: int | None  # of the positional encoding (even)
    features: tuple[int, ...]  # places of the feature sizes ATTEND_MAX_FEATURES bounds
    heads: int | None  # of the attention weights' elements; None: no weights
    max_len: int | None

    @staticmethod
    def of(model: LoadedModel) -> _FeedPlan:
        plan = model.derived.get("feed")
        if plan is None:
            specs = [s for s in model.inputs() if s.name != "valid_lens"]
            fixed, same, first, features, place = [], [], {}, [], 0
            for spec in specs:
                for size in spec.shape:
                    if size.__class__ is int:
                        fixed.append((place, size))
                    elif size in first:
                        same.append((place, first[size]))
                    else:
                        first[size] = place
                    place += 1
                if spec.shape[-1] not in SEQUENCE_AXES:
                    features.append(place - 1)
            hp = model.config.hyperparameters
            plan = model.derived["feed"] = _FeedPlan(
                tuple(s.name for s in specs), tuple(len(s.shape) for s in specs), tuple(fixed), tuple(same),
                first["batch"], first.get("n_q", first.get("n", -1)), first.get("n_k", first.get("n", -1)),
                first.get("d") if model.kind == "positional_encoding" else None, tuple(features),
                int(hp.get("num_heads", 1)) if "attention_weights" in model.output_names else None,
                hp.get("max_len"))
        return plan

    def check(self, tensors: dict[str, np.ndarray], limits: RequestLimits, finite_float32: bool
              ) -> tuple[dict[str, np.ndarray], tuple[int, int, int]] | None:
        """The feed and (batch, n_q, n_k) where every check passes; None where one does not (the
        caller's long way says which)."""
        feed = {}
        joined: tuple[int, ...] = ()
        for name, ndim in zip(self.names, self.ndims, strict=True):
            arr = tensors[name]
            if arr.ndim != ndim or not arr.size:
                return None
            if not finite_float32:
                arr = arr.astype(np.float32, copy=False)
                if not finite(arr):
                    return None
            feed[name] = arr
            joined += arr.shape
        for place, size in self.fixed:
            if joined[place] != size:
                return None
        for place, other in self.same:
            if joined[place] != joined[other]:
                return None
        batch = joined[self.batch]
        n_q = joined[self.n_q] if self.n_q >= 0 else 0
        n_k = joined[self.n_k] if self.n_k >= 0 else 0
        if batch > limits.batch or n_q > limits.sequence or n_k > limits.sequence \
                or (self.max_len is not None and n_q > self.max_len) or (self.d is not None and joined[self.d] % 2):
            return None
        for place in self.features:
            if joined[place] > limits.features:
                return None
        if self.heads is not None and batch * self.heads * n_q * n_k > limits.weight_elements:
            return None
        return feed, (batch, n_q, n_k)


def checked_feed(model: LoadedModel, tensors: dict[str, np.ndarray], limits: RequestLimits, finite_float32: bool
                  ) -> tuple[dict[str, np.ndarray], tuple[int, int, int]]:
    """`build_request`'s feed but the valid lengths, and its (batch, n_q, n_k): the signature's one check
    (`_FeedPlan`), and where it fails the long way, which says why."""
    checked = _FeedPlan.of(model).check(tensors, limits, finite_float32)
    return checked if checked is not None else _checked_feed_long(model, tensors, limits, finite_float32)


def _checked_feed_long(model: LoadedModel, tensors: dict[str, np.ndarray], limits: RequestLimits,
                       finite_float32: bool) -> tuple[dict[str, np.ndarray], tuple[int, int, int]]:
    """`checked_feed` input by input, axis by axis: the first check that fails raises, naming the field."""
    bound: dict[str, int] = {}
    first_seen: dict[str, str] = {}
    feed: dict[str, np.ndarray] = {}
    for spec in model.inputs():
        if spec.name == "valid_lens":
            continue
        arr = _float32(tensors[spec.name], spec.name, model, finite_float32)
        _bind(spec, arr, bound, first_seen, model)
        feed[spec.name] = arr
    batch = bound["batch"]
    n_q = bound.get("n_q", bound.get("n", 0))
    n_k = bound.get("n_k", bound.get("n", 0))
    max_len = model.config.hyperparameters.get("max_len")
    if max_len is not None and n_q > max_len:
        raise InvalidShape(f"queries is a sequence of {n_q} tokens, longer than the model's max_len {max_len}",
                           field="queries", expected=[batch, f"n <= {max_len}", pattern(model, "queries")[-1]],
                           received=list(feed["queries"].shape))
    if model.kind == "positional_encoding" and bound["d"] % 2:
        raise InvalidShape(f"queries must have an even feature size d (sine and cosine in pairs), got {bound['d']}",
                           field="queries", expected=[batch, "n", "d (even)"], received=list(feed["queries"].shape))
    _check_limits(limits, model, batch, n_q, n_k, feed)
    return feed, (batch, n_q, n_k)


def find_model(registry: Registry, name: str, version: int | str | None = None, field: str | None = None,
               version_field: str | None = None) -> LoadedModel:
    """The served version of the model, or the one asked for where it is loaded: the one lookup of every
    protocol and route. `field`, `version_field`: the names an error gives (a body's fields; a path
    names none)."""
    model = registry.get(name)
    if model is None and name in registry.broken:
        raise ModelUnavailable(f"model {excerpt(name)} could not be loaded; see GET /models/{name}", field=field)
    if model is None:
        raise unknown_model(registry, name, field)
    if version is not None:
        text = str(version)  # ASCII digits only: "²" is a digit to str.isdigit, and not to int()
        number = version if version.__class__ is int else int(text) if text.isascii() and text.isdigit() else None
        model = registry.get(name, number) if number is not None else None
        if model is None:
            loaded = ", ".join(map(str, registry.loaded_versions(name)))
            raise ModelNotFound(f"version {excerpt(str(version))} of model {excerpt(name)} is not loaded; loaded: "
                                f"{loaded}", field=version_field)
    return model


def unknown_model(registry: Registry, name: str, field: str | None = None) -> ModelNotFound:
    if not valid_name(name):
        return ModelNotFound(f"{excerpt(name)} is not a model's name (a name is {NAME_RULE}); available: "
                             f"{', '.join(registry.names())}", field=field)
    return ModelNotFound(f"unknown model {excerpt(name)}; available: {', '.join(registry.names())}", field=field)
