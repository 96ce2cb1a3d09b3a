#!/usr/bin/env bash
# Starts or stops throwaway message brokers on loopback for the tests and the demo: RabbitMQ
# (AMQP 0-9-1) and NATS with JetStream.
#
#   scripts/brokers.sh start   # install if missing, start both, wait until they answer, print
#                              #   export AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f
#                              #   export NATS_URL=nats://127.0.0.1:4222
#                              # (use as: exports=$(scripts/brokers.sh start) && eval "$exports")
#   scripts/brokers.sh stop    # stop both and delete their data directories
#   scripts/brokers.sh urls    # print the two export lines
#   scripts/brokers.sh rabbitmqctl ARGS…   # run rabbitmqctl against the test node
#
# Ports: $INBOX_AMQP_PORT (default 5672), $INBOX_NATS_PORT (default 4222); the RabbitMQ node's
# Erlang distribution port is $INBOX_AMQP_PORT + 20000 and epmd's is 4369, all on 127.0.0.1.
# Data and logs live in $INBOX_BROKERS_DIR (default /tmp/inbox-brokers).
#
# The Debian packages `rabbitmq-server` and `nats-server` are installed if their programs are
# missing (`apt-get update` once, then `apt-get install`). RabbitMQ runs as the `rabbitmq` user
# when started as root, with no plugins, a fresh database and the default `guest` user (which
# RabbitMQ accepts from loopback only).
set -euo pipefail

DIR=${INBOX_BROKERS_DIR:-/tmp/inbox-brokers}
AMQP_PORT=${INBOX_AMQP_PORT:-5672}
NATS_PORT=${INBOX_NATS_PORT:-4222}
DIST_PORT=$((AMQP_PORT + 20000))
NODE="inbox-${AMQP_PORT}@localhost"
AMQP_URL="amqp://guest:guest@127.0.0.1:${AMQP_PORT}/%2f"
NATS_URL="nats://127.0.0.1:${NATS_PORT}"
RABBIT_BIN=/usr/lib/rabbitmq/bin
STARTUP_TIMEOUT=${INBOX_BROKERS_TIMEOUT:-60}

urls() {
  echo "export AMQP_URL=$AMQP_URL"
  echo "export NATS_URL=$NATS_URL"
}

install_missing() {
  local missing=()
  [ -x "$RABBIT_BIN/rabbitmq-server" ] || missing+=(rabbitmq-server)
  command -v nats-server >/dev/null 2>&1 || missing+=(nats-server)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "brokers.sh: installing ${missing[*]} from Debian's packages" >&2
    apt-get update -qq >&2
    # policy-rc.d (where present) keeps the package from starting its own system-wide server.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

# The environment both the RabbitMQ server and its CLI tools need to find this node.
rabbit_env() {
  echo HOME=/var/lib/rabbitmq \
    RABBITMQ_NODENAME="$NODE" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$AMQP_PORT" \
    RABBITMQ_DIST_PORT="$DIST_PORT" \
    ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_MNESIA_BASE="$DIR/rabbitmq/mnesia" \
    RABBITMQ_LOG_BASE="$DIR/rabbitmq/log" \
    RABBITMQ_CONFIG_FILE="$DIR/rabbitmq/rabbitmq.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/rabbitmq/enabled_plugins" \
    RABBITMQ_PID_FILE="$DIR/rabbitmq/rabbitmq.pid" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="'-kernel inet_dist_use_interface {127,0,0,1}'"
}

as_rabbit() {
  # shellcheck disable=SC2046
  if [ "$(id -u)" = 0 ]; then
    eval runuser -u rabbitmq -- env $(rabbit_env) '"$@"'
  else
    eval env $(rabbit_env) '"$@"'
  fi
}

rabbitmqctl() {
  as_rabbit "$RABBIT_BIN/rabbitmqctl" -n "$NODE" "$@"
}

tcp_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

start_rabbitmq() {
  if [ -f "$DIR/rabbitmq/rabbitmq.pid" ] && rabbitmqctl -q status >/dev/null 2>&1; then
    return
  fi
  rm -rf "$DIR/rabbitmq"
  mkdir -p "$DIR/rabbitmq/mnesia" "$DIR/rabbitmq/log"
  echo "[]." >"$DIR/rabbitmq/enabled_plugins"
  cat >"$DIR/rabbitmq/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$AMQP_PORT
log.console = false
log.file.level = warning
EOF
  if [ "$(id -u)" = 0 ]; then chown -R rabbitmq: "$DIR/rabbitmq"; fi
  as_rabbit "$RABBIT_BIN/rabbitmq-server" -detached >"$DIR/rabbitmq-start.log" 2>&1 || {
    cat "$DIR/rabbitmq-start.log" >&2
    exit 1
  }
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  # `await_startup` needs the node to be reachable; poll until the AMQP port answers first.
  until tcp_open "$AMQP_PORT"; do
    if [ $SECONDS -ge $deadline ]; then
      echo "brokers.sh: RabbitMQ did not open port $AMQP_PORT within ${STARTUP_TIMEOUT}s" >&2
      tail -n 50 "$DIR"/rabbitmq/log/*.log "$DIR/rabbitmq-start.log" >&2 2>/dev/null || true
      exit 1
    fi
    sleep 0.2
  done
  rabbitmqctl -q await_startup --timeout "$STARTUP_TIMEOUT" >/dev/null
}

start_nats() {
  if [ -f "$DIR/nats.pid" ] && kill -0 "$(cat "$DIR/nats.pid")" 2>/dev/null; then
    return
  fi
  rm -rf "$DIR/nats"
  mkdir -p "$DIR/nats"
  nohup nats-server -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$DIR/nats/jetstream" \
    -P "$DIR/nats.pid" -l "$DIR/nats/server.log" >/dev/null 2>&1 &
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until tcp_open "$NATS_PORT"; do
    if [ $SECONDS -ge $deadline ]; then
      echo "brokers.sh: nats-server did not open port $NATS_PORT within ${STARTUP_TIMEOUT}s" >&2
      tail -n 50 "$DIR/nats/server.log" >&2 2>/dev/null || true
      exit 1
    fi
    sleep 0.1
  done
}

start() {
  install_missing
  mkdir -p "$DIR"
  # Start NATS while RabbitMQ's Erlang VM boots.
  start_nats
  start_rabbitmq
  urls
}

stop() {
  if [ -f "$DIR/nats.pid" ]; then
    local pid
    pid=$(cat "$DIR/nats.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  if [ -f "$DIR/rabbitmq/rabbitmq.pid" ] && [ -x "$RABBIT_BIN/rabbitmqctl" ]; then
    local pid
    pid=$(cat "$DIR/rabbitmq/rabbitmq.pid")
    rabbitmqctl -q stop >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    # The Erlang VM started epmd for the node; with no node left it has nothing to do.
    as_rabbit epmd -kill >/dev/null 2>&1 || true
  fi
  rm -rf "$DIR"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  urls) urls ;;
  rabbitmqctl) shift; rabbitmqctl "$@" ;;
  *) echo "usage: $0 start|stop|urls|rabbitmqctl ARGS…" >&2; exit 2 ;;
esac
