"""How long the main thread waits for the GIL while another thread works: what the event loop would wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def longest_wait(work: Callable[[], Any]) -> tuple[float, float, Any]:
    """(the longest the main thread, ticking, waited between two ticks, `work`'s time), in seconds, and its
    result, `work` running on a thread of its own."""
    done, gaps, result = threading.Event(), [0.0], []
    worker = threading.Thread(target=lambda: (result.append(work()), done.set()))
    started = last = time.perf_counter()
    worker.start()
    while True:  # a tick after the work too: a worker that ran to its end before the first tick held it all
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if done.is_set():
            break
        time.sleep(0)
    worker.join()
    return max(gaps), time.perf_counter() - started, result[0]
