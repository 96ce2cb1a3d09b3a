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
# PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user.
# Installs the Debian package if no PostgreSQL binaries are found.
set -euo pipefail

PG_DIR=${INBOX_PG_DIR:-/tmp/inbox-pg}
PG_PORT=${INBOX_PG_PORT:-54329}
URL="postgres://postgres@127.0.0.1:${PG_PORT}/inbox"
PG_OPTS="-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories=$PG_DIR -c max_connections=200 -c fsync=on"

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

start() {
  local bin
  if ! bin=$(pg_bin); then
    echo "pg.sh: installing PostgreSQL from Debian's packages" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    bin=$(pg_bin)
  fi
  if [ -f "$PG_DIR/data/postmaster.pid" ] && as_pg "$bin/pg_ctl" -D "$PG_DIR/data" status >/dev/null 2>&1; then
    echo "$URL"
    return
  fi
  rm -rf "$PG_DIR"
  mkdir -p "$PG_DIR"
  if [ "$(id -u)" = 0 ]; then chown postgres: "$PG_DIR"; fi
  as_pg "$bin/initdb" -D "$PG_DIR/data" -U postgres -A trust -E UTF8 --no-locale >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; exit 1; }
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 start \
    -o "$PG_OPTS" >/dev/null \
    || { cat "$PG_DIR/server.log" >&2; exit 1; }
  as_pg "$bin/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qAt \
    -c "CREATE DATABASE inbox" >/dev/null
  echo "$URL"
}

restart() {
  local bin
  bin=$(pg_bin) || { echo "pg.sh: no PostgreSQL binaries" >&2; exit 1; }
  if ! [ -f "$PG_DIR/data/postmaster.pid" ]; then
    echo "pg.sh: no server running in $PG_DIR (start it first)" >&2
    exit 1
  fi
  as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -m fast -w -t 60 restart \
    -o "$PG_OPTS" >/dev/null \
    || { tail -n 20 "$PG_DIR/server.log" >&2; exit 1; }
}

stop() {
  local bin
  bin=$(pg_bin) || return 0
  if [ -d "$PG_DIR/data" ]; then
    as_pg "$bin/pg_ctl" -D "$PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
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
