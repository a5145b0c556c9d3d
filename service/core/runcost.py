"""What a session run of one model costs in seconds, learnt from its runs: whether padding is worth a
batch, and whether a batch runs on the event loop."""

from __future__ import annotations

import math


class RunCost:
    """What a session run of one model costs, in seconds: `fixed` + `per_element` * the elements of its
    inputs and outputs (padding included).

    Where it starts: a line through the warm-up's timed runs (LoadedModel.run_times: a small and a larger
    input, the fastest of a few each). Then every run of the batcher refines it, older runs weighing
    `_DECAY` times less a run: while the recent runs' sizes spread enough to tell a slope, the line is
    fitted to them by least squares; else the warm-up's line is scaled by how much slower (or faster) the
    recent runs are than it says (a loaded machine slows both parts alike). Without warm-up runs nothing
    is known until a first run, and no slope (so no padding is worth it) until runs of different sizes."""

    __slots__ = ("fixed", "per_element", "sloped", "_base", "_n", "_x", "_y", "_xx", "_xy", "_ratio")
    _DECAY = 0.98
    _MIN_RUNS = 8.0  # (decayed) runs a fitted slope needs

    def __init__(self, points: list[tuple[int, float]] | tuple = ()):
        self.fixed = math.nan
        self.per_element = 0.0
        self.sloped = False
        self._base: tuple[float, float] | None = None  # the warm-up's line (fixed, per element)
        self._n = self._x = self._y = self._xx = self._xy = self._ratio = 0.0
        if points:
            slope, intercept = _line(points)
            if slope > 0 and intercept >= 0:
                self._base, self.sloped = (intercept, slope), True
            else:
                self._base = (sum(y for _, y in points) / len(points), 0.0)
            self.fixed, self.per_element = self._base

    @classmethod
    def of(cls, fixed: float, per_element: float) -> RunCost:
        """A cost known outright (for tests and benchmarks): it does not follow the runs."""
        cost = cls()
        cost.fixed, cost.per_element, cost.sloped = fixed, per_element, True
        cost._n = math.inf  # observe() leaves it as it is
        return cost

    @property
    def known(self) -> bool:
        return self.fixed == self.fixed  # not NaN

    def predict(self, elements: int) -> float:
        return self.fixed + self.per_element * elements

    def padding_limit(self) -> float:
        """The padded elements a run's fixed cost pays for: a request joins a batch where it adds fewer."""
        if not self.sloped:
            return 0.0
        return self.fixed / self.per_element

    def observe(self, elements: int, seconds: float) -> None:
        if self._n == math.inf:
            return
        if self._base is None:  # the first run of a model not warmed up
            self._base = (seconds, 0.0)
        decay = self._DECAY
        self._n = self._n * decay + 1.0
        self._x = self._x * decay + elements
        self._y = self._y * decay + seconds
        self._xx = self._xx * decay + elements * elements
        self._xy = self._xy * decay + elements * seconds
        fixed, per_element = self._base
        self._ratio = self._ratio * decay + seconds / (fixed + per_element * elements)
        n = self._n
        mean_x, mean_y = self._x / n, self._y / n
        spread = self._xx / n - mean_x * mean_x  # the variance of the sizes
        if n >= self._MIN_RUNS and spread > (0.25 * mean_x) ** 2:  # sizes spread by a quarter of their mean
            slope = (self._xy / n - mean_x * mean_y) / spread
            intercept = mean_y - slope * mean_x
            if slope > 0 and intercept > 0:
                self.fixed, self.per_element, self.sloped = intercept, slope, True
                return
        scale = self._ratio / n
        self.fixed, self.per_element = fixed * scale, per_element * scale


def _line(points: list[tuple[int, float]] | tuple) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points; slope 0 where their x are one."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x
