#!/usr/bin/env bash
# The test command: starts a throwaway PostgreSQL on loopback (installing it if needed), runs
# every test of the workspace against it (and against SQLite), then stops it.
#
#   scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

DATABASE_URL=$(scripts/pg.sh start)
export DATABASE_URL
trap 'scripts/pg.sh stop' EXIT
echo "test.sh: PostgreSQL at $DATABASE_URL"

cargo test --workspace --all-targets "$@"
cargo test --workspace --doc "$@"
