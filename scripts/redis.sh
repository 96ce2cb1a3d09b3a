#!/usr/bin/env bash
# Starts or stops a throwaway Redis on loopback for the dedupe cache's tests.
#
#   scripts/redis.sh start   # install if missing, start, wait until it answers, print
#                            #   export REDIS_URL=redis://127.0.0.1:6389/
#                            # (use as: exports=$(scripts/redis.sh start) && eval "$exports")
#   scripts/redis.sh stop    # stop it and delete its directory
#   scripts/redis.sh install # only install Debian's redis-server if it is missing
#
# Port: $INBOX_REDIS_PORT (default 6389), on 127.0.0.1 only; no persistence (no RDB, no AOF).
# Its pid file and log live in $INBOX_REDIS_DIR (default /tmp/inbox-redis). The Debian package
# `redis-server` is installed if `redis-server` is missing (`apt-get update` once, then
# `apt-get install`); the package's own service is not used.
set -euo pipefail

DIR=${INBOX_REDIS_DIR:-/tmp/inbox-redis}
PORT=${INBOX_REDIS_PORT:-6389}
URL="redis://127.0.0.1:${PORT}/"

install_missing() {
  command -v redis-server >/dev/null && return 0
  echo "redis.sh: installing redis-server" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends redis-server >&2
  # The package starts its own service on 6379 where a service manager runs: not ours.
  command -v service >/dev/null && service redis-server stop >/dev/null 2>&1 || true
}

answering() {
  redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null | grep -q PONG
}

start() {
  install_missing
  if answering; then
    echo "export REDIS_URL=$URL"
    return 0
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR"
  redis-server --bind 127.0.0.1 --port "$PORT" --save '' --appendonly no \
    --daemonize yes --pidfile "$DIR/redis.pid" --logfile "$DIR/redis.log" --dir "$DIR" >&2
  for _ in $(seq 100); do
    if answering; then
      echo "export REDIS_URL=$URL"
      return 0
    fi
    sleep 0.1
  done
  echo "redis.sh: Redis did not answer on port $PORT within 10 s; its log:" >&2
  tail -n 20 "$DIR/redis.log" >&2 || true
  return 1
}

stop() {
  if [ -f "$DIR/redis.pid" ]; then
    local pid
    pid=$(cat "$DIR/redis.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
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
  install) install_missing ;;
  *)
    echo "usage: $0 start|stop|install" >&2
    exit 2
    ;;
esac
