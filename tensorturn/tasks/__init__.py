"""What runs on the agents: the one attempt protocol (:mod:`.attempt`) and per-process helpers.

Each mode's Celery tasks live in ``tensorturn.modes.<mode>.tasks`` and go through
:func:`tensorturn.tasks.attempt.execute`.
"""
