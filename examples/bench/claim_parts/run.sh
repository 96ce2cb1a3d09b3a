#!/usr/bin/env bash
# The claim statement and the row taken apart (BENCHMARKS.md, "The claim statement and the row,
# taken apart"): pgbench runs one script per claim variant, rounds alternating, each run on a
# truncated inbox after a CHECKPOINT, and prints per run transactions/s, the server's CPU per
# transaction (user + system time of every PostgreSQL process, the exited backends through the
# postmaster's reaped-children counters; the server must run on this machine) and WAL bytes per
# transaction.
#
#   URL=postgres://postgres@127.0.0.1:54329 examples/bench/claim_parts/run.sh setup
#   URL=postgres://postgres@127.0.0.1:54329 examples/bench/claim_parts/run.sh 4 10 3 \
#       naive row claim claim_without_cte
#
# `setup` (re)creates the database `claim_parts` on the server of URL: the runtime's PostgreSQL
# inbox migrations, a 1,000-row accounts table and the naive inbox with its retention index.
# Then: clients, seconds per run, rounds, and the variants (the .sql files beside this script).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base=${URL:?set URL to the server, e.g. postgres://postgres@127.0.0.1:54329}
db="$base/claim_parts"
if [ "${1:-}" = setup ]; then
  psql -q "$base/postgres" -c "DROP DATABASE IF EXISTS claim_parts" -c "CREATE DATABASE claim_parts"
  for f in "$here"/../../../inbox-runtime/src/store/postgres/migrations/inbox/*.sql; do
    psql -q "$db" -f "$f"
  done
  psql -q "$db" <<'SQL'
CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 1000) g;
CREATE TABLE naive (consumer text NOT NULL, message_key text NOT NULL,
  received_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_key));
CREATE INDEX ON naive (received_at);
SQL
  exit 0
fi
clients=$1 seconds=$2 rounds=$3
shift 3
cpu() {
  local sum=0 p
  for p in $(pgrep -x postgres); do
    # utime, stime, cutime, cstime (clock ticks)
    read -r u s cu cs < <(cut -d' ' -f14-17 "/proc/$p/stat" 2>/dev/null || echo 0 0 0 0)
    sum=$((sum + u + s + cu + cs))
  done
  echo "$sum"
}
ticks=$(getconf CLK_TCK)
for round in $(seq "$rounds"); do
  for variant in "$@"; do
    psql -qAt "$db" -c "TRUNCATE inbox_messages, naive" -c "CHECKPOINT" >/dev/null
    lsn0=$(psql -qAt "$db" -c "SELECT pg_current_wal_lsn()")
    cpu0=$(cpu)
    out=$(pgbench -M prepared -n -c "$clients" -j 2 -T "$seconds" -f "$here/$variant.sql" "$db" 2>&1)
    cpu1=$(cpu)
    lsn1=$(psql -qAt "$db" -c "SELECT pg_current_wal_lsn()")
    tx=$(echo "$out" | awk '/number of transactions actually processed/ {print $NF}' | cut -d/ -f1)
    tps=$(echo "$out" | awk '/^tps/ {print int($3)}')
    wal=$(psql -qAt "$db" -c "SELECT pg_wal_lsn_diff('$lsn1', '$lsn0')::bigint")
    echo "$variant clients=$clients round=$round tx/s=$tps" \
      "server_cpu_us/tx=$(( (cpu1 - cpu0) * 1000000 / ticks / tx ))" \
      "wal_bytes/tx=$(( wal / tx ))"
  done
done
