"""What runs on the agents: the one attempt protocol (:mod:`.attempt`, the executor; :mod:`.unit`,
what a unit is given and implements; :mod:`.ending`, how an attempt was delivered and ended;
:mod:`.poll`, the one pacing of a unit's waits) and per-process helpers.

Each mode's Celery tasks live in ``tensorturn.modes.<mode>.tasks`` and go through
:func:`tensorturn.tasks.attempt.execute`.
"""
