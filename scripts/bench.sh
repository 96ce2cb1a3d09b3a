#!/usr/bin/env bash
# The benchmark command (issue 6; method and figures in BENCHMARKS.md). Builds the harness
# (`examples/bench`, release mode) and runs it against PostgreSQL and SQLite; the report goes to
# stdout and to target/bench-report.md.
#
#   scripts/bench.sh                  # default set, a few minutes
#   scripts/bench.sh --quick          # about a minute
#   scripts/bench.sh --full           # full sizes (10 M-row inbox, 5-minute memory run)
#   scripts/bench.sh --help           # every option of the harness
#   scripts/bench.sh --only kafka     # Kafka scale-out: 1, 2, 4 consumer processes in one group
#   scripts/bench.sh --only mysql     # MariaDB: bare effect, one message per transaction, batch 100
#   scripts/bench.sh --only dynamodb  # DynamoDB (moto): new keys, duplicates, a 16-task storm;
#                                     # deliveries/s and DynamoDB calls per delivery
#   scripts/bench.sh --only contention  # Worker batches over hot rows: 4 vs 1 batch in flight
#   scripts/bench.sh --only contention --contention-aggregate
#                                     # the same, and with the aggregate (the account) declared:
#                                     # partitioned batches (skipped, saying why, where the
#                                     # Worker has no partition API)
#   scripts/bench.sh --only peers     # the peers' workload: round trips per delivery on the wire,
#                                     # then at 1, 4 and 16 clients pgbench's naive inbox (without
#                                     # and with its retention index), pgbench with the runtime's
#                                     # statements, psycopg2, dispatch_on, the Worker
#   scripts/bench.sh --only peers --peers-clients 4   # the same at 4 clients only
#   scripts/bench.sh --compare REV --only peers --quick
#                                     # the peers section of the harness built at REV and of this
#                                     # tree, rounds interleaved on one server: both sets of ratios
#
# `--compare REV` (any git revision: a commit, a branch, a tag) builds the harness at REV in a
# temporary git worktree under /tmp (removed after the build), in release mode, with its own
# cargo target directory ($INBOX_BENCH_COMPARE_TARGET, default target/bench-compare-build; kept
# and shared by every compared revision, so the dependencies build once; the binary is kept as
# bench-REV there), builds this tree's harness as usual, and runs this tree's harness with
# `--compare-bench` pointing at REV's: it runs the peers section of both binaries one round at a
# time, alternating which goes first, against the same server, and reports both builds' rates
# and ratios side by side (only the rows both revisions print; each child's full report is kept
# in target/bench-compare/). The other options are passed to both binaries, so they must be
# options both revisions know (`--quick`, `--rounds`, `--peers-messages`, …); `--rounds` counts
# the rounds of each build.
#
# Asking for the `peers` section installs psycopg2-binary from PyPI if python3 lacks psycopg2
# (scripts/psycopg2.sh), for its psycopg2 reference consumer.
#
# Asking for the `kafka` section (`--only kafka`, alone or in a list) builds the harness with the
# examples feature `kafka` (librdkafka, built with cmake: scripts/deps.sh installs what it needs);
# otherwise the harness needs nothing but cargo and reports that section as not built.
# Asking for the `dynamodb` section builds the harness with the examples feature `dynamodb` (the
# AWS SDK) and runs it against DYNAMODB_ENDPOINT if set, else against a throwaway serial moto
# started with scripts/sqs.sh on ports of its own ($INBOX_BENCH_SQS_PORT, default 5013, and
# $INBOX_BENCH_DYNAMODB_PORT, default 5014; $INBOX_BENCH_SQS_DIR, default /tmp/inbox-bench-sqs).
#
# PostgreSQL: the server of BENCH_DATABASE_URL or of --database-url if given (the harness works
# in its own database there, `inbox_bench`); otherwise a throwaway PostgreSQL started here with
# scripts/pg.sh on its own data directory and port ($INBOX_BENCH_PG_DIR, default
# /tmp/inbox-bench-pg; $INBOX_BENCH_PG_PORT, default 54330), so that tests running meanwhile do
# not disturb it, and stopped afterwards. That server keeps durability on (fsync=on,
# synchronous_commit=on) and gets shared_buffers=1GB and max_wal_size=4GB (the 10 M-row inbox
# does not fit the 128 MB default), and checkpoint_timeout=1d: the sections that count WAL per
# delivery start every run with a CHECKPOINT of their own, and a timed checkpoint in the middle
# of one run (every 5 min by default) would add full-page images to that run only.
#
# Redis (the dedupe cache's rows): REDIS_URL, else a throwaway one ($INBOX_BENCH_REDIS_PORT,
# default 6390; $INBOX_BENCH_REDIS_DIR, default /tmp/inbox-bench-redis). Brokers (the outbox
# section's relays): AMQP_URL and NATS_URL if either is set, else, when the outbox section runs
# (the default set, or `--only …,outbox`), a throwaway RabbitMQ and NATS started with
# scripts/brokers.sh ($INBOX_BENCH_AMQP_PORT, default 5673; $INBOX_BENCH_NATS_PORT, default
# 4223; $INBOX_BENCH_BROKERS_DIR, default /tmp/inbox-bench-brokers). MySQL/MariaDB (the mysql
# section): MYSQL_URL, else, when that section runs (the default set, or `--only …,mysql`), a
# throwaway MariaDB started with scripts/mariadb.sh ($INBOX_BENCH_MYSQL_PORT, default 33070;
# $INBOX_BENCH_MYSQL_DIR, default /tmp/inbox-bench-mariadb). A run of only sections that need
# no PostgreSQL (mysql, sqlite, cpu) starts neither PostgreSQL nor Redis. Whatever is started
# here is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

# The servers started here, stopped on exit (last started, first stopped).
started=()
stop_started() {
  local i
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do
    "scripts/${started[$i]}.sh" stop || true
  done
}
trap stop_started EXIT

# `--compare REV` is this script's (see above); every other argument goes to the harness.
args=()
compare=
previous=
for arg in "$@"; do
  if [ "$previous" = --compare ]; then
    compare=$arg
  elif [ "$arg" != --compare ]; then
    case "$arg" in
      --compare=*) compare=${arg#--compare=} ;;
      *) args+=("$arg") ;;
    esac
  fi
  previous=$arg
done
if [ "$previous" = --compare ]; then
  echo "bench.sh: --compare needs a git revision" >&2
  exit 2
fi
if [ -n "$compare" ]; then
  # The comparison is of the peers section.
  args+=(--only peers)
fi
set -- "${args[@]}"
given=${BENCH_DATABASE_URL:-}
# The sections asked for: every `--only A,B` (the option repeats) joined, empty for the default
# set; and whether the harness only prints its help or version.
only=
help=
previous=
for arg in "$@"; do
  case "$arg" in
    --database-url | --database-url=*) given=given ;;
    --only=*) only="$only,${arg#--only=}" ;;
    -h | --help | -V | --version) help=yes ;;
  esac
  case "$previous" in --only) only="$only,$arg" ;; esac
  previous=$arg
done
# Whether section $1 runs: named in an `--only`, or (with $2 = default) in the default set.
runs() {
  [ -z "$help" ] || return 1
  case "$only," in
    *",$1,"*) return 0 ;;
    ",") [ "${2:-}" = default ] ;;
    *) return 1 ;;
  esac
}
# Whether PostgreSQL (and Redis) is needed: unless every section asked for runs without it.
needs_pg=yes
if [ -n "$only" ] && [ -z "$help" ]; then
  needs_pg=
  for section in ${only//,/ }; do
    case "$section" in
      mysql | sqlite | cpu | dynamodb) ;;
      *) needs_pg=yes ;;
    esac
  done
fi
features=()
if runs kafka; then
  features=(--features kafka)
  scripts/deps.sh
fi
if runs dynamodb; then
  features+=(--features dynamodb)
fi

# --compare REV: the harness built at REV, in a temporary worktree with its own target directory.
compare_tree=
remove_compare_tree() {
  if [ -n "$compare_tree" ]; then
    git worktree remove --force "$compare_tree/src" 2>/dev/null || true
    rm -rf "$compare_tree"
    compare_tree=
  fi
}
trap 'remove_compare_tree; stop_started' EXIT
if [ -n "$compare" ] && [ -z "$help" ]; then
  rev=$(git rev-parse --short=12 --verify "$compare^{commit}")
  # One target directory for every compared revision: the dependencies build once.
  compare_target=${INBOX_BENCH_COMPARE_TARGET:-$PWD/target/bench-compare-build}
  compare_tree=$(mktemp -d "/tmp/inbox-bench-$rev-XXXXXX")
  git worktree add --quiet --detach "$compare_tree/src" "$rev"
  echo "bench.sh: building the harness at $rev (target $compare_target)" >&2
  # Its own target directory and nothing of this tree's cargo configuration: the two builds of
  # the workspace's crates never share an artifact.
  (cd "$compare_tree/src" &&
    env -u CARGO_BUILD_BUILD_DIR CARGO_TARGET_DIR="$compare_target" \
      cargo build --quiet --release -p inbox-examples "${features[@]}" --example bench)
  remove_compare_tree
  # A copy per revision: the next comparison's build overwrites release/examples/bench.
  cp "$compare_target/release/examples/bench" "$compare_target/bench-$rev"
  set -- "$@" --compare-bench "$compare_target/bench-$rev" --compare-label "$rev" \
    --build-label "$(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD 2>/dev/null || echo +changes)"
  args=("$@")
fi

# The peers section's psycopg2 reference consumer: psycopg2-binary from PyPI if missing (never
# fails: without it the harness reports those rows as skipped, saying why).
if runs peers; then
  scripts/psycopg2.sh
fi

if [ -z "$needs_pg" ]; then
  :
elif [ -z "$given" ]; then
  export INBOX_PG_DIR=${INBOX_BENCH_PG_DIR:-/tmp/inbox-bench-pg}
  export INBOX_PG_PORT=${INBOX_BENCH_PG_PORT:-54330}
  started+=(pg)
  url=$(scripts/pg.sh start)
  bin=$(dirname "$(ls -d /usr/lib/postgresql/*/bin/pg_ctl | sort -V | tail -n 1)")
  as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
  as_pg "$bin/psql" -h 127.0.0.1 -p "$INBOX_PG_PORT" -U postgres -d postgres -qAt \
    -c "ALTER SYSTEM SET shared_buffers = '1GB'" -c "ALTER SYSTEM SET max_wal_size = '4GB'" \
    -c "ALTER SYSTEM SET checkpoint_timeout = '1d'" >/dev/null
  as_pg "$bin/pg_ctl" -D "$INBOX_PG_DIR/data" -l "$INBOX_PG_DIR/server.log" -w -t 60 -m fast restart >/dev/null
  echo "bench.sh: throwaway PostgreSQL at $url" >&2
  args+=(--database-url "$url")
elif [ "$given" != given ]; then
  args+=(--database-url "$given")
fi

# The dedupe cache's Redis rows: a throwaway Redis on its own port unless REDIS_URL names one.
if [ -n "$needs_pg" ] && [ -z "${REDIS_URL:-}" ]; then
  export INBOX_REDIS_DIR=${INBOX_BENCH_REDIS_DIR:-/tmp/inbox-bench-redis}
  export INBOX_REDIS_PORT=${INBOX_BENCH_REDIS_PORT:-6390}
  started+=(redis)
  # Not `eval "$(…)"`: that would hide a failed start (eval of nothing succeeds).
  exports=$(scripts/redis.sh start)
  eval "$exports"
  export REDIS_URL
fi

# The outbox section's brokers: only when that section runs and no broker URL is given.
if runs outbox default && [ -z "${AMQP_URL:-}${NATS_URL:-}" ]; then
  export INBOX_BROKERS_DIR=${INBOX_BENCH_BROKERS_DIR:-/tmp/inbox-bench-brokers}
  export INBOX_AMQP_PORT=${INBOX_BENCH_AMQP_PORT:-5673}
  export INBOX_NATS_PORT=${INBOX_BENCH_NATS_PORT:-4223}
  started+=(brokers)
  exports=$(scripts/brokers.sh start)
  eval "$exports"
  export AMQP_URL NATS_URL
  echo "bench.sh: throwaway RabbitMQ at $AMQP_URL, NATS at $NATS_URL" >&2
fi

# The mysql section's server: a throwaway MariaDB on its own port unless MYSQL_URL names one.
if runs mysql default && [ -z "${MYSQL_URL:-}" ]; then
  export INBOX_MYSQL_DIR=${INBOX_BENCH_MYSQL_DIR:-/tmp/inbox-bench-mariadb}
  export INBOX_MYSQL_PORT=${INBOX_BENCH_MYSQL_PORT:-33070}
  started+=(mariadb)
  exports=$(scripts/mariadb.sh start)
  eval "$exports"
  export MYSQL_URL
  echo "bench.sh: throwaway MariaDB at $MYSQL_URL" >&2
fi

# The dynamodb section's server: a throwaway serial moto unless DYNAMODB_ENDPOINT names one.
if runs dynamodb && [ -z "${DYNAMODB_ENDPOINT:-}" ]; then
  export INBOX_SQS_DIR=${INBOX_BENCH_SQS_DIR:-/tmp/inbox-bench-sqs}
  export INBOX_SQS_PORT=${INBOX_BENCH_SQS_PORT:-5013}
  export INBOX_DYNAMODB_PORT=${INBOX_BENCH_DYNAMODB_PORT:-5014}
  started+=(sqs)
  exports=$(scripts/sqs.sh start)
  eval "$exports"
  export DYNAMODB_ENDPOINT AWS_REGION AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
  echo "bench.sh: throwaway moto (DynamoDB) at $DYNAMODB_ENDPOINT" >&2
fi

mkdir -p target
cargo run --quiet --release -p inbox-examples "${features[@]}" --example bench -- "${args[@]}" |
  tee target/bench-report.md
