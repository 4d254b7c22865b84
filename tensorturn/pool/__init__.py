"""The machines: the Celery app, the agent, leases that keep a live task's message, heartbeats and
telemetry, routing to queues a machine can serve, the memory check, the embedded pool on one
machine, and the coordinator (`tensorturn up`)."""
