#!/usr/bin/env bash
# Starts or stops a throwaway SQS-compatible server (moto in server mode) on loopback for the SQS
# source's and sink's tests.
#
#   scripts/sqs.sh start   # install if missing, start, wait until it answers, print
#                          #   export AWS_ENDPOINT_URL=http://127.0.0.1:5011 SQS_ENDPOINT=… …
#                          # (use as: exports=$(scripts/sqs.sh start) && eval "$exports")
#   scripts/sqs.sh stop    # stop it and delete its directory
#   scripts/sqs.sh install # only install moto[server] from PyPI if `moto_server` is missing
#
# Port: $INBOX_SQS_PORT (default 5011), on 127.0.0.1 only; state in memory only. Its pid file and
# log live in $INBOX_SQS_DIR (default /tmp/inbox-sqs). `moto[server]` is installed with pip if
# `moto_server` is missing (into the user's Python; `--break-system-packages` where Debian's pip
# refuses). Checked with moto 5.2: FIFO deduplication (5-minute window, content-based or by
# MessageDeduplicationId), FIFO groups, and redelivery after the visibility timeout. Moto accepts
# stale receipt handles (a delete with the handle of an earlier receive succeeds): SQS does not.
# The credentials printed are moto's dummies; AWS_REGION is us-east-1.
set -euo pipefail

DIR=${INBOX_SQS_DIR:-/tmp/inbox-sqs}
PORT=${INBOX_SQS_PORT:-5011}
URL="http://127.0.0.1:${PORT}"
MOTO_VERSION=5.2.5

install_missing() {
  command -v moto_server >/dev/null && return 0
  echo "sqs.sh: installing moto[server]==$MOTO_VERSION" >&2
  python3 -m pip install -q "moto[server]==$MOTO_VERSION" >&2 ||
    python3 -m pip install -q --break-system-packages "moto[server]==$MOTO_VERSION" >&2
  hash -r
  command -v moto_server >/dev/null || {
    echo "sqs.sh: moto_server is not on PATH after installing moto[server]" >&2
    return 1
  }
}

answering() {
  # moto's own health endpoint of its server mode (any HTTP answer will do).
  curl -s -o /dev/null --max-time 1 "$URL/moto-api/" 2>/dev/null
}

exports() {
  echo "export AWS_ENDPOINT_URL=$URL SQS_ENDPOINT=$URL AWS_REGION=us-east-1" \
    "AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test"
}

start() {
  install_missing
  if answering; then
    exports
    return 0
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR"
  nohup moto_server -H 127.0.0.1 -p "$PORT" >"$DIR/moto.log" 2>&1 </dev/null &
  echo $! >"$DIR/moto.pid"
  for _ in $(seq 300); do
    if answering; then
      exports
      return 0
    fi
    if ! kill -0 "$(cat "$DIR/moto.pid")" 2>/dev/null; then
      break
    fi
    sleep 0.1
  done
  echo "sqs.sh: moto did not answer on port $PORT within 30 s; its log:" >&2
  tail -n 20 "$DIR/moto.log" >&2 || true
  stop
  return 1
}

stop() {
  if [ -f "$DIR/moto.pid" ]; then
    local pid
    pid=$(cat "$DIR/moto.pid")
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
