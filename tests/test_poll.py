"""Waiting for another machine's work: the pauses between looks, and the look between pauses."""

from __future__ import annotations

import pytest

from tensorturn.modes.fused import poll as polling


def test_the_pauses_start_short_and_double_up_to_the_cap(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", slept.append)
    looks = []
    for n in polling.poll(lambda: looks.append(len(slept)), first_s=0.02, cap_s=0.1):
        if n == 5:
            break
    assert slept == [0.02, 0.04, 0.08, 0.1, 0.1]
    assert looks == [0, 1, 2, 3, 4]  # a look before each pause


def test_a_look_that_raises_ends_the_wait(monkeypatch):
    monkeypatch.setattr(polling.time, "sleep", lambda s: None)

    class Cancelled(Exception):
        pass

    def look() -> None:
        raise Cancelled

    with pytest.raises(Cancelled):
        for _ in polling.poll(look):
            pass
