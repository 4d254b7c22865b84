"""Runs as a user handles them: submit, follow, cancel, resume, list and remove (the functions the
CLI, tests and benchmarks call), and the figures of a finished run."""
