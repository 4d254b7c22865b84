"""The run state on the broker: each Redis structure owned by one small class (the run board, its
rounds, members, attempts and the pool's machines), the client that rides out a restart, and what
is pruned when a run ends. Nothing outside this package talks to the Redis client about runs."""
