#!/usr/bin/env bash
# WAL and server CPU per delivery of the inbox row, against the naive inbox (issue 19).
#
#   scripts/wal-probe.sh URL [DELIVERIES] [CLIENTS]
#
# URL is a PostgreSQL superuser URL of a throwaway server (e.g. the one printed by
# `INBOX_PG_PORT=54342 INBOX_PG_DIR=/tmp/probe-pg scripts/pg.sh start`); the script creates and
# drops its own databases `walprobe_*` on it. DELIVERIES (default 20000) new-key transactions
# are run by pgbench (-M prepared, CLIENTS clients, default 1) for each variant:
#
#   naive   BEGIN; INSERT INTO inbox (consumer, key) VALUES (…) ON CONFLICT DO NOTHING;
#           UPDATE accounts SET balance = balance + … WHERE id = …; COMMIT
#           (a table with only a primary key on (consumer, key))
#   v5      the runtime's statements at the 0005 schema (migrations 0001-0005 of
#           inbox-runtime/migrations/postgres): the claim, the same UPDATE, the verification
#           SELECT, COMMIT
#   current the runtime's statements of this checkout, on every migration of the directory
#
# The claim statements are copied here from inbox-runtime/src/store/postgres.rs (`CLAIM`) with
# their parameters as pgbench variables and literals (no source: NULLs; mode 'deliver'); keep them
# in step with it. For each variant it prints WAL bytes, records and full-page images per delivery
# (pg_stat_wal deltas over the run, CHECKPOINT before: the accounts' pages' first images count in
# every variant alike) and the server's CPU per delivery (postmaster with its reaped backends and
# live children, from /proc), then a breakdown by record type of the run's WAL (pg_waldump
# --stats=record, when the data directory is readable) and by relation (heap, each index), and
# the size of each index per million keys after 1,000,000 rows inserted by generate_series
# (processed rows, 36-character keys, one consumer).
#
# The tables start empty: a generic plan cached on an empty table would read the growing table
# whole, so pgbench's sessions plan each statement for its parameters (plan_cache_mode =
# force_custom_plan, in every variant alike); the CPU figures include that planning. The WAL
# does not depend on it.
#
# The figures depend on the machine and settings; the ratios between variants are what matter.
set -euo pipefail

URL=${1:?usage: scripts/wal-probe.sh URL [DELIVERIES] [CLIENTS]}
N=${2:-20000}
CLIENTS=${3:-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)
MIG=$HERE/inbox-runtime/migrations/postgres
BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
PSQL=(psql -X -q -v ON_ERROR_STOP=1 -At)
ACCOUNTS=1000
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

db_url() { echo "${URL%/*}/$1"; }
q() { "${PSQL[@]}" "$(db_url "$1")" -c "$2"; }

# A 36-character key from a pgbench integer, and a 64-hex-digit fingerprint.
KEY="lpad(:k::text, 36, 'k')"
HASH="'9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'"

V5_CLAIM="WITH claim AS ( INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, status, attempts, received_at, processed_at, source, source_partition, source_offset) VALUES ('bench', $KEY, 'payments.captured', $HASH, 'processed', 1, now(), now(), NULL, NULL, NULL) ON CONFLICT (consumer, message_key) DO UPDATE SET status = 'processed', attempts = inbox_messages.attempts + 1, processed_at = now(), next_attempt_at = NULL, payload = NULL WHERE inbox_messages.payload_hash = excluded.payload_hash AND ((inbox_messages.status = 'failed' AND ('deliver' <> 'deliver' OR (inbox_messages.next_attempt_at IS NULL OR inbox_messages.next_attempt_at <= now()))) OR (inbox_messages.status = 'dead' AND 'deliver' = 'replay') OR (inbox_messages.status = 'parked' AND 'deliver' IN ('resume', 'release'))) RETURNING attempts) SELECT 'claimed' AS status, NULL::text AS payload_hash, attempts, NULL::bigint AS retry_in_ms FROM claim UNION ALL SELECT status, payload_hash, attempts, CASE WHEN status = 'failed' AND next_attempt_at > now() THEN CEIL(EXTRACT(EPOCH FROM (next_attempt_at - now())) * 1000)::bigint END FROM inbox_messages WHERE consumer = 'bench' AND message_key = $KEY AND NOT EXISTS (SELECT 1 FROM claim)"

# From migration 0006 on: the fingerprint is a BYTEA parameter (32 bytes), and a fresh claim
# leaves processed_at NULL.
CURRENT_CLAIM=${V5_CLAIM//"$HASH"/"decode($HASH, 'hex')"}
CURRENT_CLAIM=${CURRENT_CLAIM//NULL::text AS payload_hash/NULL::bytea AS payload_hash}
CURRENT_CLAIM=${CURRENT_CLAIM//received_at, processed_at, source,/received_at, source,}
CURRENT_CLAIM=${CURRENT_CLAIM//"'processed', 1, now(), now(),"/"'processed', 1, now(),"}

setup() { # db, migrations up to (number; 9999: all)
  local db=$1 upto=$2 f n
  q postgres "DROP DATABASE IF EXISTS $db" >/dev/null
  q postgres "CREATE DATABASE $db" >/dev/null
  if [ "$upto" = naive ]; then
    q "$db" "CREATE TABLE inbox (consumer TEXT NOT NULL, key TEXT NOT NULL, PRIMARY KEY (consumer, key))"
  else
    for f in "$MIG"/[0-9]*.sql; do
      n=$(basename "$f"); n=$((10#${n%%_*}))
      [ "$n" -le "$upto" ] || continue
      "${PSQL[@]}" "$(db_url "$db")" -f "$f" >/dev/null
    done
    q "$db" "ALTER TABLE inbox_messages SET (autovacuum_enabled = off)"
  fi
  q "$db" "CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL) WITH (autovacuum_enabled = off);
           INSERT INTO accounts SELECT i, 0 FROM generate_series(1, $ACCOUNTS) i"
}

script() { # variant -> pgbench script
  local claim=$1
  {
    echo "\\set k random(1, 1000000000000)"
    echo "\\set a random(1, $ACCOUNTS)"
    echo "BEGIN;"
    if [ "$claim" = naive ]; then
      echo "INSERT INTO inbox (consumer, key) VALUES ('bench', $KEY) ON CONFLICT DO NOTHING;"
      echo "UPDATE accounts SET balance = balance + 100 WHERE id = :a;"
    else
      echo "$claim;"
      echo "UPDATE accounts SET balance = balance + 100 WHERE id = :a;"
      echo "SELECT 1 FROM inbox_messages WHERE consumer = 'bench' AND message_key = $KEY;"
    fi
    echo "COMMIT;"
  }
}

ticks() { # sum utime+stime(+cutime+cstime for the postmaster) of the server's processes
  local pm=$1 total=0 pid s
  s=($(cut -d' ' -f14-17 /proc/$pm/stat))
  total=$((s[0] + s[1] + s[2] + s[3]))
  for pid in $(pgrep -P "$pm"); do
    s=($(cut -d' ' -f14-15 /proc/$pid/stat 2>/dev/null || echo "0 0"))
    total=$((total + s[0] + s[1]))
  done
  echo $total
}

DATADIR=$(q postgres "SHOW data_directory")
PM=$(head -n 1 "$DATADIR/postmaster.pid" 2>/dev/null || true)
HZ=$(getconf CLK_TCK)

run() { # name db claim
  local name=$1 db=$2 claim=$3 w0 w1 c0 c1 lsn0 lsn1
  script "$claim" >"$WORK/$name.sql"
  q "$db" "VACUUM ANALYZE" >/dev/null
  q postgres "CHECKPOINT" >/dev/null
  sleep 1
  w0=$(q postgres "SELECT wal_bytes || ' ' || wal_records || ' ' || wal_fpi FROM pg_stat_wal")
  lsn0=$(q postgres "SELECT pg_current_wal_lsn()")
  c0=$([ -n "$PM" ] && ticks "$PM" || echo 0)
  PGOPTIONS="-c plan_cache_mode=force_custom_plan" "$BIN/pgbench" -n -M prepared -c "$CLIENTS" -j "$CLIENTS" -t $((N / CLIENTS)) -f "$WORK/$name.sql" \
    "$(db_url "$db")" >"$WORK/$name.out" 2>&1 || { cat "$WORK/$name.out" >&2; exit 1; }
  sleep 1 # the backends report their WAL counters when they exit
  c1=$([ -n "$PM" ] && ticks "$PM" || echo 0)
  lsn1=$(q postgres "SELECT pg_current_wal_lsn()")
  w1=$(q postgres "SELECT wal_bytes || ' ' || wal_records || ' ' || wal_fpi FROM pg_stat_wal")
  read -r b0 r0 f0 <<<"$w0"; read -r b1 r1 f1 <<<"$w1"
  local done_
  done_=$(q "$db" "SELECT count(*) FROM $( [ "$claim" = naive ] && echo inbox || echo inbox_messages )")
  printf '%-8s deliveries %6d  WAL %7.1f B/delivery  records %5.2f  FPI %6.3f  server CPU %6.1f us/delivery  tps %s\n' \
    "$name" "$done_" "$(echo "($b1 - $b0) / $done_" | bc -l)" "$(echo "($r1 - $r0) / $done_" | bc -l)" \
    "$(echo "($f1 - $f0) / $done_" | bc -l)" "$(echo "($c1 - $c0) * 1000000 / $HZ / $done_" | bc -l)" \
    "$(grep -o 'tps = [0-9.]*' "$WORK/$name.out" | head -n 1)"
  # Right away: later runs' checkpoints recycle the segments.
  breakdown "$name" "$lsn0" "$lsn1" "$db" "$done_"
}

# pg_waldump's statistics as "type records bytes" lines (bytes: record and full-page images).
waldump_stats() { # lsn0 lsn1 [pg_waldump options]
  local lsn0=$1 lsn1=$2
  shift 2
  "$BIN/pg_waldump" -p "$DATADIR/pg_wal" -s "$lsn0" -e "$lsn1" "$@" 2>/dev/null \
    | sed -e 's/([^)]*)//g' -e 's/\[[^]]*\]//g' | awk 'NR > 2 && $1 !~ /^-/ { print $1, $2, $5 }' || true
}

breakdown() { # name lsn0 lsn1 db deliveries
  local name=$1 lsn0=$2 lsn1=$3 db=$4 n=$5 oid rel node
  [ -r "$DATADIR/pg_wal" ] || { echo "  (no breakdown: $DATADIR/pg_wal not readable)"; return; }
  echo "  $name, per delivery by record type (records, bytes with full-page images):"
  waldump_stats "$lsn0" "$lsn1" --stats=record \
    | awk -v n="$n" '$2 > n / 100 { printf "    %-24s %6.2f %8.1f B\n", $1, $2 / n, $3 / n }'
  echo "  $name, per delivery by relation (all record types touching it):"
  node=$(q "$db" "SELECT oid FROM pg_database WHERE datname = current_database()")
  while read -r rel oid; do
    printf '    %-32s %8.1f B\n' "$rel" "$(waldump_stats "$lsn0" "$lsn1" --relation="1663/$node/$oid" --stats \
      | awk -v n="$n" '$1 == "Total" { t = $3 } END { print t / n }')"
  done < <(q "$db" "SELECT c.relname, pg_relation_filenode(c.oid) FROM pg_class c
             JOIN pg_namespace s ON s.oid = c.relnamespace
             WHERE s.nspname = 'public' AND c.relkind IN ('r', 'i')
             ORDER BY c.relkind DESC, c.relname" | tr '|' ' ')
}

sizes() { # db table
  local db=$1
  if [ "$2" = naive ]; then
    q "$db" "TRUNCATE inbox; INSERT INTO inbox SELECT 'bench', lpad(i::text, 36, 'k') FROM generate_series(1, 1000000) i"
  else
    q "$db" "TRUNCATE inbox_messages;
      INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, status, attempts, received_at)
      SELECT 'bench', lpad(i::text, 36, 'k'), 'payments.captured',
             $( [ "$2" = hexhash ] && echo "$HASH" || echo "decode($HASH, 'hex')" ), 'processed', 1,
             now() - (1000000 - i) * interval '1 millisecond'
      FROM generate_series(1, 1000000) i"
  fi
  q "$db" "VACUUM ANALYZE" >/dev/null
  q "$db" "SELECT '    ' || rpad(c.relname, 32) || lpad(pg_size_pretty(pg_relation_size(c.oid)), 10)
                  || CASE WHEN c.relkind = 'i' THEN '  ' || round(pg_relation_size(c.oid)::numeric / 1000000, 1) || ' B/key' ELSE '' END
           FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace
           WHERE s.nspname = 'public' AND c.relname NOT LIKE 'accounts%'
           ORDER BY c.relkind DESC, c.relname"
}

echo "wal-probe: $N new-key deliveries, $CLIENTS client(s), $ACCOUNTS accounts, $(q postgres "SHOW server_version")"
setup walprobe_naive naive
setup walprobe_v5 5
setup walprobe_current 9999
run naive walprobe_naive naive
run v5 walprobe_v5 "$V5_CLAIM"
run current walprobe_current "$CURRENT_CLAIM"
echo "index sizes per million keys (1,000,000 processed rows, VACUUM ANALYZE):"
echo "  naive:"; sizes walprobe_naive naive
echo "  v5:"; sizes walprobe_v5 hexhash
echo "  current:"; sizes walprobe_current "$(q walprobe_current "SELECT CASE WHEN data_type = 'bytea' THEN 'bytes' ELSE 'hexhash' END FROM information_schema.columns WHERE table_name = 'inbox_messages' AND column_name = 'payload_hash'")"
for db in naive v5 current; do q postgres "DROP DATABASE walprobe_$db" >/dev/null; done
