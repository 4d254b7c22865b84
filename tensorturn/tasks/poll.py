"""One pacing for every wait of a unit: ask at once, then sleep a short while, doubling to a cap,
with a look between sleeps (a cancel, a hand-back: whatever ``look`` raises ends the wait). A wait
that asks the store or the broker whether something is there costs one round trip per pause, so
a fast answer is seen in tens of milliseconds and a slow one costs about one ask per ``cap``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

FIRST_S = 0.02  # the first pause: most waits end within a few of them
CAP_S = 1.0     # the longest pause


def poll(look: Callable[[], object] | None = None, *, first: float = FIRST_S, cap: float = CAP_S,
         within: float | None = None, sleep: Callable[[float], object] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
    """The pauses of a wait loop: yields the seconds waited so far — at once, then after each
    pause (``first``, doubling to ``cap``), ``look()`` called before each pause. Ends once
    ``within`` seconds have passed (the loop's ``else`` then says it waited in vain); the caller
    ``break``s or returns when what it waits for is there::

        for waited in poll(attempt.look, cap=UPLOAD_LOOK_S, within=EVAL_WAIT_S):
            if store.exists(key):
                break
    """
    began, pause = clock(), first
    while True:
        waited = clock() - began
        if within is not None and waited >= within:
            return
        yield waited
        if look is not None:
            look()
        sleep(pause)
        pause = min(pause * 2, cap)
