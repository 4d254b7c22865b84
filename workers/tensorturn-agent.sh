#!/usr/bin/env sh
# Launch this machine's TensorTurn agent. It only makes outbound connections (Redis, the store).
#   TENSORTURN_BROKER_URL=redis://:PASSWORD@coordinator:6379/0 \
#   TENSORTURN_STORE_URL=s3://bucket/prefix ./workers/tensorturn-agent.sh [NAME]
set -eu
: "${TENSORTURN_BROKER_URL:?set TENSORTURN_BROKER_URL to the pool's Redis URL}"
exec tensorturn agent --name "${1:-$(hostname -s)}"
