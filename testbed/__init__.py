"""Test and benchmark tooling beside the runtime package: emulated machines (a step's time, a
battery sensor: :mod:`testbed.emulate`), emulated links (:mod:`testbed.netlab`), an S3 endpoint."""
