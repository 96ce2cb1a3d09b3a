#!/usr/bin/env bash
# The test command: installs the Debian packages the build and the browser tests need if missing
# (scripts/deps.sh: librdkafka's build tools first, then chromium and chromium-driver, curl, python3
# with pip, the latter while the build runs),
# checks the shipped monitoring files (scripts/monitoring.sh), starts a throwaway
# PostgreSQL, MariaDB, RabbitMQ, NATS (JetStream) and Redis on loopback (installing them from
# Debian's packages if needed) and an SQS-compatible server (moto, from PyPI if missing:
# scripts/sqs.sh), runs every test of the workspace against them (and against SQLite), then
# stops them.
#
#   scripts/test.sh [extra cargo test args]
#
# By default: `cargo test --workspace --all-targets` (built while the servers start; the demos the
# tests run are built once and handed to them, INBOX_TEST_EXAMPLES_DIR; the UI tests of
# tests/macro-ui, then the Kafka tests (BESIDE_TESTS) run beside the rest, and outage
# (ALONE_TESTS) alone after them), then the doctests. INBOX_TEST_ALONGSIDE names a command to run
# beside the tests (CI's lints), whose failure fails the run. Arguments that pick packages
# (-p, --exclude) or targets (--test NAME, --lib, …) replace the defaults they stand for (targets
# picked: no doctest run), e.g.
# `scripts/test.sh --test amqp --test nats`; arguments after `--` go to the test binaries.
# Prefer picking targets to picking packages: `-p` changes cargo's feature resolution, which
# rebuilds the dependencies the workspace shares.
#
# Every test binary and the doctests run even when some fail (`--no-fail-fast`). At the end it
# names each failing binary with its failing tests (`test.sh: FAILED binaries: …`) and closes with
# `test.sh: N passed, N failed, N ignored …`; the exit status is 1 if anything failed.
#
# Nothing is left behind, also after a failure or Ctrl-C: the servers are stopped and their data
# directories deleted; the tests' temporary files go to a directory of this run ($TMPDIR for
# cargo), deleted at the end — files the tests did not remove themselves, and processes of theirs
# still running (a demo copied to that directory), are named and removed.
set -euo pipefail
cd "$(dirname "$0")/.."

# No incremental compilation state: this command builds each crate once, and that state for ~70
# test binaries takes gigabytes of disk the run never reads again (CI once ran out of disk with it).
# Developers who rerun the tests may keep it with CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/inbox-test.XXXXXX")
LOG=$WORK/cargo.log
mkdir "$WORK/tmp"
STARTED=$SECONDS
INTERRUPTED=

# Runs `COMMAND…`, then creates the file MARKER (so that others can wait for its end, which
# `wait` cannot tell another subshell); returns the command's exit status.
#   marking MARKER COMMAND…
marking() {
  local marker=$1 rc=0
  shift
  "$@" || rc=$?
  touch "$marker"
  return "$rc"
}

# `--test NAME` for each NAME given.
test_args() {
  printf -- '--test %s ' "$@"
}

# Prints `test.sh: [Mm SSs] WHAT`: the time since the start, so that a slow run shows its slow part.
phase() {
  local elapsed=$((SECONDS - STARTED))
  printf 'test.sh: [%dm %02ds] %s\n' $((elapsed / 60)) $((elapsed % 60)) "$*"
}

# The processes under $1 (children first, then theirs).
descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}

# Ends $1 and everything under it: SIGTERM, then SIGKILL to what is left after 5 s.
stop_tree() {
  local pids
  pids="$(descendants "$1") $1"
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 50); do
    # shellcheck disable=SC2086
    kill -0 $pids 2>/dev/null || break
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
}

# Processes still running a program from this run's directory (the tests copy the ledger demo
# there): a test that did not stop its child.
left_behind_processes() {
  local proc exe
  for proc in /proc/[0-9]*; do
    exe=$(readlink "$proc/exe" 2>/dev/null) || continue
    case "$exe" in "$WORK"/*) echo "${proc#/proc/}" ;; esac
  done
}

cleanup() {
  local status=$? pids files
  trap - EXIT INT TERM HUP
  set +e
  for pidfile in "$WORK/build.pid" "$WORK/cargo.pid" "$WORK/ui.pid" "$WORK/beside.pid" \
    "$WORK/alongside.pid"; do
    if [ -f "$pidfile" ]; then
      stop_tree "$(cat "$pidfile")"
    fi
  done
  pids=$(left_behind_processes)
  if [ -n "$pids" ]; then
    echo "test.sh: killing processes the tests left running:" >&2
    # shellcheck disable=SC2086
    ps -o pid=,args= -p $pids >&2
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null
  fi
  files=$(find "$WORK/tmp" -mindepth 1 -maxdepth 2 2>/dev/null | head -n 20)
  if [ -n "$files" ] && [ -z "$INTERRUPTED" ]; then
    echo "test.sh: removing files the tests left behind in \$TMPDIR:" >&2
    echo "$files" | sed "s|^$WORK/tmp/|  |" >&2
  fi
  scripts/sqs.sh stop
  scripts/redis.sh stop
  scripts/mariadb.sh stop
  scripts/brokers.sh stop
  scripts/pg.sh stop
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
interrupted() {
  INTERRUPTED=1
  echo "test.sh: interrupted, stopping the tests and the servers" >&2
  exit "$1"
}
trap 'interrupted 130' INT
trap 'interrupted 143' TERM
trap 'interrupted 129' HUP

# The system packages the build needs (librdkafka's: cmake, zlib, OpenSSL, libcurl headers); the
# others (Chromium for the browser tests, curl, pip, psycopg2) once the build has started.
scripts/deps.sh build

# Runs `cargo ARGS` with the tests' temp dir, its output shown and appended to $LOG; returns its
# exit status. In the background, so that a signal reaches the traps above at once.
run_cargo() {
  local rc
  if [ -t 1 ]; then export CARGO_TERM_COLOR=always; fi
  rm -f "$WORK/rc"
  {
    TMPDIR=$WORK/tmp cargo "$@" 2>&1 &
    echo $! >"$WORK/cargo.pid"
    wait $! && echo 0 >"$WORK/rc" || echo $? >"$WORK/rc"
  } | tee -a "$LOG" &
  wait $!
  rm -f "$WORK/cargo.pid"
  rc=$(cat "$WORK/rc" 2>/dev/null || echo 1)
  return "$rc"
}

# The whole suite's build starts now, in the background, while the servers start: on a fresh
# machine installing them is minutes of waiting on the package mirrors.
if [ $# -eq 0 ]; then
  run_cargo test --workspace --all-targets --no-run &
  echo $! >"$WORK/build.pid"
fi
scripts/deps.sh

# The shipped alert rules and Grafana dashboard (examples/monitoring/): promtool's check and unit
# tests, the dashboard's queries against the runtime's metrics. Seconds; a failure ends the run.
scripts/monitoring.sh

DATABASE_URL=$(scripts/pg.sh start)
export DATABASE_URL
echo "test.sh: PostgreSQL at $DATABASE_URL"
exports=$(scripts/mariadb.sh start)
eval "$exports"
echo "test.sh: MariaDB at $MYSQL_URL"
# Not `eval "$(…)"`: that would hide a failed start (eval of nothing succeeds).
exports=$(scripts/brokers.sh start)
eval "$exports"
echo "test.sh: RabbitMQ at $AMQP_URL, NATS at $NATS_URL"
exports=$(scripts/redis.sh start)
eval "$exports"
echo "test.sh: Redis at $REDIS_URL"
exports=$(scripts/sqs.sh start)
eval "$exports"
echo "test.sh: SQS (moto) at $SQS_ENDPOINT, DynamoDB (moto, serial) at $DYNAMODB_ENDPOINT"
phase "servers started"

scope=(--workspace)
targets=(--all-targets)
doctests=yes
for arg in "$@"; do
  case $arg in
    --) break ;;
    -p | -p* | --package | --package=* | --workspace | --all | --exclude | --exclude=*) scope=() ;;
    --lib | --bins | --bin | --bin=* | --tests | --test | --test=* | --examples | --example | \
      --example=* | --benches | --bench | --bench=* | --all-targets | --doc)
      targets=()
      doctests=
      ;;
  esac
done
# Builds the demos the tests run (`cargo build --workspace --examples`, and the ledger with the
# examples features `kafka`, `sqs` and `dynamodb`), copies them to $WORK/examples under the
# names tests/ledger_support.rs asks for, and exports INBOX_TEST_EXAMPLES_DIR: the tests then run
# those copies and never call cargo, so nothing they do waits for the build directory's lock.
prebuild_examples() {
  local dir=$WORK/examples json
  mkdir -p "$dir"
  json=$WORK/examples.json
  # Each compiler-artifact line of an example: "NAME EXECUTABLE".
  example_artifacts() {
    grep '"reason":"compiler-artifact"' "$json" | grep '"kind":\["example"\]' |
      sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*"executable":"\([^"]*\)".*/\1 \2/p'
  }
  # Not through run_cargo: its output (JSON here) would go to the log.
  TMPDIR=$WORK/tmp cargo build --workspace --examples --message-format=json-render-diagnostics \
    >"$json" || return 1
  example_artifacts | while read -r name executable; do cp "$executable" "$dir/$name"; done
  # One ledger with the broker features and DynamoDB, for the tests of each (ledger-kafka,
  # ledger-sqs, ledger-dynamodb).
  TMPDIR=$WORK/tmp cargo build --workspace --example ledger \
    --features inbox-examples/kafka,inbox-examples/sqs,inbox-examples/dynamodb \
    --message-format=json-render-diagnostics >"$json" || return 1
  example_artifacts | while read -r name executable; do
    if [ "$name" = ledger ]; then
      cp "$executable" "$dir/ledger-kafka"
      cp "$executable" "$dir/ledger-sqs"
      cp "$executable" "$dir/ledger-dynamodb"
    fi
  done
  local name
  for name in ledger ledger-kafka ledger-sqs ledger-dynamodb pipeline payments; do
    [ -x "$dir/$name" ] || {
      echo "test.sh: no $name demo after the build (cargo named none, or copying it failed)" >&2
      return 1
    }
  done
  export INBOX_TEST_EXAMPLES_DIR=$dir
}

# INBOX_TEST_ALONGSIDE (CI sets it to the lints): a shell command run at the lowest priority beside
# the tests, once the first test binary runs (cargo has released the build directory's lock by
# then, and the tests mostly wait on servers and killed demos). Its output is shown at the end; its
# failure fails the run.
start_alongside() {
  [ -n "${INBOX_TEST_ALONGSIDE:-}" ] || return 0
  (
    # Colour codes stripped (on a terminal cargo colours its `Running` lines).
    until sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$LOG" 2>/dev/null | grep -q '^ *Running ' ||
      [ -e "$WORK/tests-ended" ]; do sleep 1; done
    marking "$WORK/alongside-ended" nice -n 19 bash -c "$INBOX_TEST_ALONGSIDE"
  ) >"$WORK/alongside.log" 2>&1 &
  echo $! >"$WORK/alongside.pid"
}
alongside_status=0
finish_alongside() {
  [ -f "$WORK/alongside.pid" ] || return 0
  touch "$WORK/tests-ended"
  echo "test.sh: waiting for the command run beside the tests (INBOX_TEST_ALONGSIDE)"
  wait "$(cat "$WORK/alongside.pid")" || alongside_status=1
  rm -f "$WORK/alongside.pid"
  phase "the command beside the tests ended"
  cat "$WORK/alongside.log"
}

# The test binaries run beside the rest in the whole suite's run: the Kafka tests mostly wait on
# the consumer group's protocol (librdkafka's mock cluster, in the test process; vmstat: about 75 %
# idle over their 5 minutes). They use PostgreSQL, MariaDB and SQLite, a database of their own
# each, and no broker server.
BESIDE_TESTS=(kafka kafka_crash)
# The test binaries that must run alone, once BESIDE_TESTS have ended: outage restarts the
# PostgreSQL server (`scripts/pg.sh restart`), which would cut every other test's connections.
ALONE_TESTS=(outage)

# The names of every test target of the workspace but the UI tests,
# BESIDE_TESTS and ALONE_TESTS, from `cargo metadata` (so that a new test file needs no edit here).
other_test_targets() {
  cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
skip = set(sys.argv[1:]) | {"ui"}
for package in json.load(sys.stdin)["packages"]:
    for target in package["targets"]:
        if "test" in target["kind"] and target["name"] not in skip:
            print(target["name"])
' "${BESIDE_TESTS[@]}" "${ALONE_TESTS[@]}"
}

status=0
if [ $# -eq 0 ]; then
  # The whole suite. The UI tests (trybuild: about 4 minutes of compiling, no server touched) run
  # beside the others, whose time goes mostly to waiting on servers and killed demos: build
  # everything once, start the UI tests and BESIDE_TESTS in the background, run the rest, then
  # add their output to the log. `--exclude` of the UI package changes no feature of the others
  # (it enables none of its own), so nothing is built twice.
  # The build started before the servers.
  wait "$(cat "$WORK/build.pid")" || status=1
  rm -f "$WORK/build.pid"
  phase "test binaries built"
  [ "$status" -eq 0 ] && { prebuild_examples || status=1; }
  phase "demos built"
  if [ "$status" -eq 0 ]; then
    # At the lowest priority: the tests running meanwhile wait on servers and killed demos.
    marking "$WORK/ui-ended" env TMPDIR="$WORK/tmp" nice -n 19 cargo test --workspace --test ui \
      --no-fail-fast >"$WORK/ui.log" 2>&1 &
    echo $! >"$WORK/ui.pid"
    # BESIDE_TESTS once the compilers beside the tests (the UI tests, the lints) have ended: on a
    # fresh machine those fill the Kafka tests' idle time anyway. Started at once, in one run from
    # a clean clone, the other test binaries took 1086 s instead of 726 s (ledger_demo 318 s
    # instead of 106 s).
    (
      until [ -e "$WORK/ui-ended" ] &&
        { [ -z "${INBOX_TEST_ALONGSIDE:-}" ] || [ -e "$WORK/alongside-ended" ]; }; do
        sleep 1
      done
      # shellcheck disable=SC2046
      TMPDIR=$WORK/tmp exec cargo test --workspace $(test_args "${BESIDE_TESTS[@]}") --no-fail-fast
    ) >"$WORK/beside.log" 2>&1 &
    echo $! >"$WORK/beside.pid"
    start_alongside
    # Every target of --all-targets but the UI tests, BESIDE_TESTS and ALONE_TESTS.
    names=$(other_test_targets) || status=1
    # shellcheck disable=SC2086
    others=$(test_args $names)
    # shellcheck disable=SC2086
    [ "$status" -eq 0 ] && { run_cargo test --workspace --exclude inbox-macro-ui --lib --bins \
      --examples --benches $others --no-fail-fast || status=1; }
    # Lets the lints start if no test binary ran (BESIDE_TESTS wait for them).
    touch "$WORK/tests-ended"
    phase "tests run; waiting for those run beside them (${BESIDE_TESTS[*]})"
    wait "$(cat "$WORK/beside.pid")" || status=1
    rm -f "$WORK/beside.pid"
    tee -a "$LOG" <"$WORK/beside.log"
    phase "${BESIDE_TESTS[*]} run; now ${ALONE_TESTS[*]}, alone"
    # shellcheck disable=SC2046
    run_cargo test --workspace $(test_args "${ALONE_TESTS[@]}") --no-fail-fast || status=1
    phase "${ALONE_TESTS[*]} run; waiting for the UI tests (tests/macro-ui)"
    wait "$(cat "$WORK/ui.pid")" || status=1
    rm -f "$WORK/ui.pid"
    phase "UI tests run"
    tee -a "$LOG" <"$WORK/ui.log"
  fi
else
  start_alongside
  run_cargo test "${scope[@]}" "${targets[@]}" --no-fail-fast "$@" || status=1
fi
# The doctests: not part of --all-targets.
if [ -n "$doctests" ]; then
  run_cargo test "${scope[@]}" --doc --no-fail-fast "$@" || status=1
  phase "doctests run"
fi

finish_alongside

# The summary, from cargo's output: the binary each `Running`/`Doc-tests` line starts, its
# `test … FAILED` lines, its `test result:` line (a binary without one crashed).
sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$LOG" | awk -v status="$status" -v elapsed=$((SECONDS - STARTED)) '
  function close_binary() {
    if (binary != "" && !has_result) { failed_bins[++nfailed] = binary ": no test result (crashed?)" }
    else if (binary != "" && bad) { failed_bins[++nfailed] = binary ": " (names == "" ? "(see above)" : names) }
    binary = ""; names = ""; bad = 0; has_result = 0
  }
  /^ *Running / {
    close_binary(); bins++
    src = $2; if (src == "unittests") src = $3
    exe = $NF; sub(/\)$/, "", exe); sub(/.*\//, "", exe); sub(/-[0-9a-f]+$/, "", exe)
    binary = src " (" exe ")"; next
  }
  /^ *Doc-tests / { close_binary(); docs++; binary = "doctests of " $2; next }
  /^test .* \.\.\. FAILED$/ {
    name = $0; sub(/^test /, "", name); sub(/ \.\.\. FAILED$/, "", name)
    names = names (names == "" ? "" : ", ") name; next
  }
  /^test result: / {
    has_result = 1
    if (match($0, /finished in [0-9.]+s/)) {
      secs = substr($0, RSTART + 12, RLENGTH - 13) + 0
      for (i = 1; i <= 5; i++) if (secs > slow_secs[i]) {
        for (j = 5; j > i; j--) {
          slow_secs[j] = slow_secs[j - 1]; slow_names[j] = slow_names[j - 1]
        }
        slow_secs[i] = secs; slow_names[i] = binary; break
      }
    }
    for (i = 1; i <= NF; i++) {
      n = $(i - 1) + 0
      if ($i ~ /^passed/) passed += n
      else if ($i ~ /^failed/) { failed += n; if (n > 0) bad = 1 }
      else if ($i ~ /^ignored/) ignored += n
    }
    if ($3 == "FAILED.") bad = 1
    next
  }
  END {
    close_binary()
    if (nfailed > 0) {
      printf "test.sh: FAILED binaries:\n"
      for (i = 1; i <= nfailed; i++) printf "  %s\n", failed_bins[i]
    } else if (status != 0) {
      printf "test.sh: cargo failed before or between the test binaries (see its errors above)\n"
    }
    if (slow_secs[1] > 0) {
      printf "test.sh: the slowest test binaries (their own time):"
      for (i = 1; i <= 5 && slow_secs[i] > 0; i++)
        printf "%s %s %.0fs", (i > 1 ? "," : ""), slow_names[i], slow_secs[i]
      printf "\n"
    }
    printf "test.sh: %d passed, %d failed, %d ignored (%d test binaries, %d doctest runs; %dm %02ds)\n", \
      passed, failed, ignored, bins, docs, elapsed / 60, elapsed % 60
  }'
if [ "$alongside_status" -ne 0 ]; then
  echo "test.sh: the command run beside the tests (INBOX_TEST_ALONGSIDE) failed: see its output above"
  status=1
fi
exit "$status"
