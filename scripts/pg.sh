#!/usr/bin/env bash
# Starts or stops a throwaway PostgreSQL 15 server on loopback for the tests and the demo.
#
#   scripts/pg.sh start   # initdb in $INBOX_PG_DIR (default /tmp/inbox-pg), start on $INBOX_PG_PORT
#                         # (default 54329), create database `inbox`, print the DATABASE_URL
#   scripts/pg.sh stop    # stop it and delete the data directory
#   scripts/pg.sh restart # restart the running server (fast shutdown: open connections are cut),
#                         # same data and options; for tests of a database that goes away
#   scripts/pg.sh url     # print the DATABASE_URL
#
# A loaded machine can take minutes to shut down (the shutdown checkpoint writes every dirty
# buffer): `restart` gives a fast shutdown 120 seconds, then shuts down immediately (no
# checkpoint: the start recovers from the WAL, and loses no committed transaction), and waits up
# to $INBOX_PG_TIMEOUT seconds (default 600) for the server to stop and to accept connections
# again. `stop`, which deletes the data anyway, gives a fast shutdown 30 seconds before the
# immediate one, and kills the server if even that does not end it.
#
# wal_level=logical: tests/outbox.rs decodes the outbox's changes from the WAL with pgoutput, as
# Debezium does (a logical replication slot needs it; otherwise the server runs as before).
#
# PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user.
# Installs the Debian package if no PostgreSQL binaries are found.
set -euo pipefail

PG_DIR=${INBOX_PG_DIR:-/tmp/inbox-pg}
PG_PORT=${INBOX_PG_PORT:-54329}
URL="postgres://postgres@127.0.0.1:${PG_PORT}/inbox"
PG_TIMEOUT=${INBOX_PG_TIMEOUT:-600}
PG_OPTS="-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories=$PG_DIR -c max_connections=200 -c fsync=on -c wal_level=logical"

pg_bin() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/pg_ctl" ]; then echo "$dir"; return; fi
  done
  return 1
}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

running() {
  [ -f "$PG_DIR/data/postmaster.pid" ] && as_pg "$1/pg_ctl" -D "$PG_DIR/data" status >/dev/null 2>&1
}

# Starts the server on the existing data directory, waiting up to $PG_TIMEOUT s until it accepts
# connections (after an immediate shutdown, that includes the recovery).
start_server() {
  as_pg "$1/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t "$PG_TIMEOUT" start \
    -o "$PG_OPTS" >/dev/null \
    || { tail -n 50 "$PG_DIR/server.log" >&2; exit 1; }
}

# Stops the running server: a fast shutdown, given $2 seconds; then an immediate one (up to
# $PG_TIMEOUT s); then, if the postmaster is still there, SIGKILL (its backends exit when they see
# it gone).
stop_server() {
  local bin=$1 timeout=$2 pid
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -m fast -w -t "$timeout" stop >/dev/null 2>&1 && return
  running "$bin" || return 0
  echo "pg.sh: fast shutdown not done within ${timeout}s, shutting down immediately" >&2
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -m immediate -w -t "$PG_TIMEOUT" stop >/dev/null 2>&1 && return
  running "$bin" || return 0
  pid=$(head -n 1 "$PG_DIR/data/postmaster.pid" 2>/dev/null || true)
  echo "pg.sh: immediate shutdown failed, killing the postmaster ($pid)" >&2
  if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
}

start() {
  local bin
  if ! bin=$(pg_bin); then
    echo "pg.sh: installing PostgreSQL from Debian's packages" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    bin=$(pg_bin)
  fi
  if running "$bin"; then
    echo "$URL"
    return
  fi
  rm -rf "$PG_DIR"
  mkdir -p "$PG_DIR"
  if [ "$(id -u)" = 0 ]; then chown postgres: "$PG_DIR"; fi
  as_pg "$bin/initdb" -D "$PG_DIR/data" -U postgres -A trust -E UTF8 --no-locale >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; exit 1; }
  start_server "$bin"
  as_pg "$bin/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qAt \
    -c "CREATE DATABASE inbox" >/dev/null
  echo "$URL"
}

restart() {
  local bin
  bin=$(pg_bin) || { echo "pg.sh: no PostgreSQL binaries" >&2; exit 1; }
  if ! running "$bin"; then
    echo "pg.sh: no server running in $PG_DIR (start it first)" >&2
    exit 1
  fi
  stop_server "$bin" 120
  start_server "$bin"
}

stop() {
  local bin
  bin=$(pg_bin) || return 0
  if running "$bin"; then
    stop_server "$bin" 30
  fi
  rm -rf "$PG_DIR"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  restart) restart ;;
  url) echo "$URL" ;;
  *) echo "usage: $0 start|stop|restart|url" >&2; exit 2 ;;
esac
