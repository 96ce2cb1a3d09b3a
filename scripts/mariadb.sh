#!/usr/bin/env bash
# Starts or stops a throwaway MariaDB on loopback for the MySQL/MariaDB backend's tests and demo.
#
#   scripts/mariadb.sh start   # install if missing, initialise $INBOX_MYSQL_DIR (default
#                              #   /tmp/inbox-mysql), start on $INBOX_MYSQL_PORT (default 33069),
#                              #   wait until it answers, create database `inbox` and user `inbox`,
#                              #   print  export MYSQL_URL=mysql://inbox:inbox@127.0.0.1:33069/inbox
#                              # (use as: exports=$(scripts/mariadb.sh start) && eval "$exports")
#   scripts/mariadb.sh stop    # stop it and delete the data directory
#   scripts/mariadb.sh url     # print the export line
#
# The server listens on 127.0.0.1 only (and a socket in its directory), runs as the `mysql` user
# when started as root, and waits up to $INBOX_MYSQL_TIMEOUT seconds (default 120) to answer.
# The Debian package `mariadb-server` is installed if `mariadbd` is missing (`apt-get update`
# once, then `apt-get install`); the package's own service is not used.
set -euo pipefail

DIR=${INBOX_MYSQL_DIR:-/tmp/inbox-mysql}
PORT=${INBOX_MYSQL_PORT:-33069}
TIMEOUT=${INBOX_MYSQL_TIMEOUT:-120}
URL="mysql://inbox:inbox@127.0.0.1:${PORT}/inbox"
SOCKET="$DIR/mysqld.sock"

server_bin() {
  local bin
  for bin in mariadbd /usr/sbin/mariadbd mysqld /usr/sbin/mysqld; do
    if command -v "$bin" >/dev/null 2>&1; then command -v "$bin"; return; fi
  done
  return 1
}

install_missing() {
  server_bin >/dev/null && return 0
  echo "mariadb.sh: installing mariadb-server" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends mariadb-server >&2
  # The package may start its own service on 3306 where a service manager runs: not ours.
  command -v service >/dev/null && service mariadb stop >/dev/null 2>&1 || true
}

client() {
  mariadb --protocol=socket -S "$SOCKET" -u root "$@"
}

answering() {
  client -e "SELECT 1" >/dev/null 2>&1
}

as_mysql() {
  if [ "$(id -u)" = 0 ]; then runuser -u mysql -- "$@"; else "$@"; fi
}

start() {
  local bin
  install_missing
  bin=$(server_bin)
  if [ -S "$SOCKET" ] && answering; then
    echo "export MYSQL_URL=$URL"
    return 0
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR/data"
  if [ "$(id -u)" = 0 ]; then chown -R mysql: "$DIR"; fi
  as_mysql mariadb-install-db --no-defaults --datadir="$DIR/data" --auth-root-authentication-method=socket \
    --skip-test-db >"$DIR/install.log" 2>&1 \
    || { cat "$DIR/install.log" >&2; exit 1; }
  # Detached: the server outlives this script (the test command stops it).
  as_mysql setsid "$bin" --no-defaults --datadir="$DIR/data" --bind-address=127.0.0.1 --port="$PORT" \
    --socket="$SOCKET" --pid-file="$DIR/mysqld.pid" --log-error="$DIR/server.log" \
    --skip-name-resolve --max-connections=300 --innodb-buffer-pool-size=128M \
    --innodb-log-file-size=64M --innodb-flush-log-at-trx-commit=1 \
    --character-set-server=utf8mb4 --collation-server=utf8mb4_bin \
    </dev/null >/dev/null 2>&1 &
  for _ in $(seq $((TIMEOUT * 10))); do
    if answering; then break; fi
    sleep 0.1
  done
  if ! answering; then
    echo "mariadb.sh: MariaDB did not answer on port $PORT within ${TIMEOUT}s; its log:" >&2
    tail -n 30 "$DIR/server.log" >&2 || true
    exit 1
  fi
  # The tests create and drop a database per test: the user may do anything (a throwaway server
  # on loopback).
  client -e "CREATE DATABASE IF NOT EXISTS inbox; \
    CREATE USER IF NOT EXISTS 'inbox'@'127.0.0.1' IDENTIFIED BY 'inbox'; \
    CREATE USER IF NOT EXISTS 'inbox'@'localhost' IDENTIFIED BY 'inbox'; \
    GRANT ALL PRIVILEGES ON *.* TO 'inbox'@'127.0.0.1'; \
    GRANT ALL PRIVILEGES ON *.* TO 'inbox'@'localhost'; FLUSH PRIVILEGES;" >&2
  echo "export MYSQL_URL=$URL"
}

stop() {
  local pid
  if [ -f "$DIR/mysqld.pid" ]; then
    pid=$(cat "$DIR/mysqld.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 300); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -rf "$DIR"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) echo "export MYSQL_URL=$URL" ;;
  *)
    echo "usage: $0 start|stop|url" >&2
    exit 2
    ;;
esac
