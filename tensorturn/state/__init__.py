"""The run state on the broker: each Redis structure owned by one small class, as python-rq's
registries — :mod:`.runs` (each run's hash, the list of runs), :mod:`.rounds`, :mod:`.members`,
:mod:`.attempts`, :mod:`.incidents`, :mod:`.claims`, :mod:`.traffic`, :mod:`.live` (what running
tasks report), :mod:`.workers` (the machines' hashes; :mod:`.roster` reads them, verified),
:mod:`.ledger` (asynchronous runs), :mod:`.adverts` (who serves the outer queues),
:mod:`.refusals`, :mod:`.queues` (Celery's and kombu's own lists and leases) — composed by
:class:`.board.RunBoard`; the client that rides out a restart (:mod:`.broker`), what is pruned
when a run ends (:mod:`.housekeeping`) and a run's records in the store (:mod:`.manifest`).

Nothing outside this package calls the Redis client (``tests/unit/test_layering.py``)."""
