"""The testbed's emulated machines (testbed.emulate): a step's pace on a fake clock, a battery
file in place of the sensor, a file in place of the owner's CPU share — through the hooks
TensorTurn leaves for them (tensorturn.testbed_hooks), not through its settings."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from tensorturn import config, testbed_hooks
from tensorturn.pool import owner
from testbed import emulate


def test_a_throttle_paces_short_steps_to_its_factor():
    """On a fake clock: 1 ms steps under a 3× throttle take 3× their compute even when every
    sleep oversleeps by 1 ms (a sleep after each step made that ~5×)."""
    clock = {"now": 0.0, "sleeps": 0}

    def sleep(seconds):
        clock["now"] += seconds + 0.001
        clock["sleeps"] += 1

    throttle = emulate.Throttle(3.0, clock=lambda: clock["now"], sleep=sleep)
    for _ in range(1000):
        clock["now"] += 0.001           # one step of work
        throttle.step(0.001)
    assert 2.95 < clock["now"] / 1.0 < 3.05
    assert clock["sleeps"] < 1000 / 10    # sleeps are batched, not one per step


def test_a_simulated_step_takes_its_emulated_time_whatever_the_compute_and_oversleep():
    """On a fake clock: steps of 0.3 ms compute under a 50 ms emulated step, every sleep 2 ms
    late, end at n × 50 ms (the overshoot is paid back); a step whose compute outlasts the
    emulated time is not slowed further."""
    clock = {"now": 0.0}

    def sleep(seconds):
        clock["now"] += seconds + 0.002

    sim = emulate.SimulatedStep(0.05, clock=lambda: clock["now"], sleep=sleep)
    for _ in range(200):
        clock["now"] += 0.0003
        sim.step()
    assert 200 * 0.05 <= clock["now"] <= 200 * 0.05 + 0.0021
    before = clock["now"]
    clock["now"] += 0.08                  # one slow step: 80 ms of compute
    sim.step()
    assert clock["now"] == pytest.approx(before + 0.08)


def test_the_pace_is_read_as_each_loop_starts_and_is_none_unset(monkeypatch):
    monkeypatch.delenv(emulate.SIM_STEP_S, raising=False)
    monkeypatch.delenv(emulate.SLOWDOWN, raising=False)
    assert emulate.step_pacer() is None
    monkeypatch.setenv(emulate.SIM_STEP_S, "0.01")
    assert emulate.step_pacer() is not None
    monkeypatch.setenv(emulate.SLOWDOWN, "2")
    assert emulate.step_pacer() is not None


def test_a_battery_file_stands_in_for_the_sensor(tmp_path, monkeypatch):
    """Installed, the file's word is the reading (no file: no battery); without the variable
    the machine's own sensor answers."""
    monkeypatch.setattr(testbed_hooks, "battery_sensor", None)
    monkeypatch.setattr(owner, "battery_sensor", lambda: False)  # this machine: on mains
    assert owner.on_battery() is False
    monkeypatch.setattr(testbed_hooks, "battery_sensor", emulate.battery_sensor)
    fake = tmp_path / "battery"
    monkeypatch.setenv(emulate.BATTERY_FILE, str(fake))
    fake.write_text("battery\n")
    assert owner.on_battery() is True
    fake.write_text("ac")
    assert owner.on_battery() is False
    fake.unlink()
    assert owner.on_battery() is None
    monkeypatch.delenv(emulate.BATTERY_FILE)
    assert owner.on_battery() is False


def test_no_emulation_is_a_user_setting():
    names = {v.env for v in config.VARIABLES}
    assert not {n for n in names if any(w in n for w in ("SIM_STEP", "SLOWDOWN", "BATTERY_FILE"))}


def test_the_package_neither_reads_the_emulations_nor_installs_them():
    """Only the testbed sets the hooks; the package reads no TESTBED_* variable."""
    root = ROOT / "tensorturn"
    found = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
             if "TESTBED_" in p.read_text() or re.search(r"testbed_hooks\.\w+\s*=[^=]", p.read_text())]
    assert found == []


def test_an_others_cpu_file_stands_in_for_the_watchs_reading(tmp_path, monkeypatch):
    said = tmp_path / "others-cpu"
    monkeypatch.setenv(emulate.OTHERS_CPU_FILE, str(said))
    assert emulate.others_cpu(12.5) == 12.5  # no file yet: the machine's reading
    said.write_text("90")
    assert emulate.others_cpu(12.5) == 90.0
    assert emulate.others_cpu(None) is None  # the watch's first call has nothing to compare
    said.write_text("")
    assert emulate.others_cpu(12.5) == 12.5
    monkeypatch.setattr(testbed_hooks, "others_cpu", emulate.others_cpu)
    said.write_text("75")
    watch = owner.CpuWatch()
    watch.sample()
    assert watch.sample() == 75.0
