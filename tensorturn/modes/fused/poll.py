"""Waiting for what another machine does (an upload, an evaluation): look, pause, look again —
the first pause short (an upload on a LAN takes milliseconds), each next one twice as long up to
a cap, and a look between pauses (the run cancelled?) so that a wait never outlives its run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

FIRST_S = 0.02  # the first pause
CAP_S = 0.5     # the longest


def poll(look: Callable[[], None] = lambda: None, first_s: float = FIRST_S,
         cap_s: float = CAP_S) -> Iterator[int]:
    """Yield 0, 1, 2… — the caller looks at what it waits for and breaks out once it is there —
    and between yields call ``look`` (which raises to stop the wait) and pause, ``first_s`` then
    doubling to ``cap_s``::

        for _ in poll(attempt.check_cancelled):
            if store.exists(key):
                break
    """
    pause, n = first_s, 0
    while True:
        yield n
        look()
        time.sleep(pause)
        pause, n = min(pause * 2, cap_s), n + 1
