#!/usr/bin/env sh
# Launch this machine's TensorTurn agent. It only makes outbound connections (Redis, the store).
#   TENSORTURN_JOIN=tt1....  ./workers/tensorturn-agent.sh [NAME]     (the line `tensorturn up` printed)
# or
#   TENSORTURN_BROKER_URL=redis://:PASSWORD@coordinator:6379/0 \
#   TENSORTURN_STORE_URL=s3://bucket/prefix ./workers/tensorturn-agent.sh [NAME]
set -eu
if [ -z "${TENSORTURN_JOIN:-}" ] && [ -z "${TENSORTURN_BROKER_URL:-}" ]; then
    echo "set TENSORTURN_JOIN (from \`tensorturn up\`) or TENSORTURN_BROKER_URL to the pool's Redis URL" >&2
    exit 2
fi
exec tensorturn agent --name "${1:-$(hostname -s)}"
