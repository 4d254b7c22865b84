"""Imported by Python as it starts, in every process whose ``PYTHONPATH`` holds this folder
(``testbed.emulate.reach_children`` puts it there for the processes tests and benchmarks start):
installs the testbed's emulations (:func:`testbed.emulate.install`) into TensorTurn's hooks.
Cheap — neither torch nor Celery is imported — as it runs in every such process."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the repository: testbed/ is not installed
if ROOT not in sys.path:
    sys.path.append(ROOT)

from testbed import emulate  # noqa: E402

emulate.install()
