#!/usr/bin/env sh
# Launch this machine's TensorTurn agent. It only makes outbound connections (Redis, the store).
#   TENSORTURN_JOIN_FILE=/path/to/join  ./workers/tensorturn-agent.sh [NAME]   (the file `tensorturn up` wrote)
# or
#   TENSORTURN_BROKER_URL=redis://default:PASSWORD@coordinator:6379/0 TENSORTURN_POOL_KEY=ttk1.... \
#   TENSORTURN_STORE_URL=s3://bucket/prefix ./workers/tensorturn-agent.sh [NAME]
# Secrets come from the environment or the join file, never from this command line.
set -eu
if [ -z "${TENSORTURN_JOIN_FILE:-}" ] && [ -z "${TENSORTURN_JOIN:-}" ] && [ -z "${TENSORTURN_BROKER_URL:-}" ]; then
    echo "set TENSORTURN_JOIN_FILE (the join file from \`tensorturn up\`) or TENSORTURN_BROKER_URL to the pool's Redis URL" >&2
    exit 2
fi
exec tensorturn agent --name "${1:-$(hostname -s)}"
