#!/usr/bin/env bash
# The test command: starts a throwaway PostgreSQL, RabbitMQ and NATS (JetStream) on loopback
# (installing them from Debian's packages if needed), runs every test of the workspace against
# them (and against SQLite), then stops them.
#
#   scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

trap 'scripts/brokers.sh stop; scripts/pg.sh stop' EXIT
DATABASE_URL=$(scripts/pg.sh start)
export DATABASE_URL
echo "test.sh: PostgreSQL at $DATABASE_URL"
eval "$(scripts/brokers.sh start)"
echo "test.sh: RabbitMQ at $AMQP_URL, NATS at $NATS_URL"

cargo test --workspace --all-targets "$@"
cargo test --workspace --doc "$@"
