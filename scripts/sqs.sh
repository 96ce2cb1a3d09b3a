#!/usr/bin/env bash
# Starts or stops a throwaway SQS-compatible server (moto in server mode) on loopback for the SQS
# source's and sink's tests, and a second moto server for the DynamoDB store's tests
# (tests/dynamodb.rs) that answers one request at a time.
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
#
# DynamoDB: moto's own server (moto_server) is threaded, and its DynamoDB runs concurrent
# TransactWriteItems without isolation: two claims of one key can both pass their condition, and a
# cancelled transaction restores the tables it touched as they were when it began, undoing writes
# that committed meanwhile (checked with moto 5.2: 16 threads × 3 deliveries of 200 keys left
# counters at 2 and lost items). DynamoDB isolates transactions. So the DynamoDB tests get a moto
# of their own, werkzeug with `threaded=False`: one request at a time, every transaction isolated.
# Port $INBOX_DYNAMODB_PORT (default 5012), exported as DYNAMODB_ENDPOINT; its pid file and log
# in $DIR too. Needs moto's `dynamodb` extra (py-partiql-parser, docker's client library).
set -euo pipefail

DIR=${INBOX_SQS_DIR:-/tmp/inbox-sqs}
PORT=${INBOX_SQS_PORT:-5011}
URL="http://127.0.0.1:${PORT}"
MOTO_VERSION=5.2.5
DYNAMODB_PORT=${INBOX_DYNAMODB_PORT:-5012}
DYNAMODB_URL="http://127.0.0.1:${DYNAMODB_PORT}"

install_missing() {
  command -v moto_server >/dev/null && python3 -c "import moto.dynamodb, py_partiql_parser" 2>/dev/null && return 0
  echo "sqs.sh: installing moto[server,dynamodb]==$MOTO_VERSION" >&2
  python3 -m pip install -q "moto[server,dynamodb]==$MOTO_VERSION" >&2 ||
    python3 -m pip install -q --break-system-packages "moto[server,dynamodb]==$MOTO_VERSION" >&2
  hash -r
  command -v moto_server >/dev/null || {
    echo "sqs.sh: moto_server is not on PATH after installing moto[server]" >&2
    return 1
  }
}

answering() {
  # moto's own health endpoint of its server mode (any HTTP answer will do).
  curl -s -o /dev/null --max-time 1 "${1:-$URL}/moto-api/" 2>/dev/null
}

exports() {
  echo "export AWS_ENDPOINT_URL=$URL SQS_ENDPOINT=$URL AWS_REGION=us-east-1" \
    "AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test DYNAMODB_ENDPOINT=$DYNAMODB_URL"
}

# The serial moto for DynamoDB (see above), if it does not answer yet.
start_dynamodb() {
  answering "$DYNAMODB_URL" && return 0
  mkdir -p "$DIR"
  nohup python3 -c '
import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
run_simple(sys.argv[1], int(sys.argv[2]), DomainDispatcherApplication(create_backend_app), threaded=False)
' 127.0.0.1 "$DYNAMODB_PORT" >"$DIR/dynamodb.log" 2>&1 </dev/null &
  echo $! >"$DIR/dynamodb.pid"
  for _ in $(seq 300); do
    answering "$DYNAMODB_URL" && return 0
    kill -0 "$(cat "$DIR/dynamodb.pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "sqs.sh: the DynamoDB moto did not answer on port $DYNAMODB_PORT within 30 s; its log:" >&2
  tail -n 20 "$DIR/dynamodb.log" >&2 || true
  return 1
}

start() {
  install_missing
  if answering; then
    start_dynamodb || { stop; return 1; }
    exports
    return 0
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR"
  nohup moto_server -H 127.0.0.1 -p "$PORT" >"$DIR/moto.log" 2>&1 </dev/null &
  echo $! >"$DIR/moto.pid"
  for _ in $(seq 300); do
    if answering; then
      start_dynamodb || { stop; return 1; }
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
  local name pid
  for name in moto dynamodb; do
    [ -f "$DIR/$name.pid" ] || continue
    pid=$(cat "$DIR/$name.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  done
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
