#!/usr/bin/env bash
# Installs the system packages the workspace's full build and the test servers' tools need, from
# Debian's packages; quiet and quick when everything is present (run by scripts/test.sh before
# cargo).
#
#   scripts/deps.sh [build]
#
# `build`: only the packages the build needs (the first list below), nothing else; scripts/test.sh
# installs those first and the rest while the build runs.
#
# What needs them: the `kafka` feature of inbox-runtime (enabled by the tests package) builds
# librdkafka from source through rdkafka-sys's `cmake-build` feature: cmake and a C/C++
# toolchain, zlib (compression), OpenSSL (TLS, SASL/SCRAM) and libcurl (SASL/OAUTHBEARER with
# OIDC) headers. The default build (`cargo build`, `cargo run --example ledger`) needs none.
# The operator console's browser tests (tests/console_browser.rs) drive Debian's headless
# Chromium through its WebDriver server: chromium and chromium-driver (/usr/bin/chromedriver).
#
# Idempotent: `apt-get update` once, then `apt-get install -y` of the missing packages only;
# nothing at all is done (and nothing printed) when every package is installed. Needs root (or
# sudo-less root as in CI) only when something is missing. Then scripts/psycopg2.sh
# (psycopg2-binary from PyPI, for the bench's peers section, if missing).
set -euo pipefail

BUILD_PACKAGES=(cmake make gcc g++ pkg-config zlib1g-dev libssl-dev libcurl4-openssl-dev)
TOOL_PACKAGES=(chromium chromium-driver)
case "${1:-}" in
  build) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  "") PACKAGES=("${BUILD_PACKAGES[@]}" "${TOOL_PACKAGES[@]}") ;;
  *)
    echo "usage: scripts/deps.sh [build]" >&2
    exit 2
    ;;
esac

missing=()
for package in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$package")
  fi
done
# The test servers' tools, looked for as commands (they may come from elsewhere than Debian, e.g.
# pyenv): python3 with pip (scripts/sqs.sh installs moto with it; scripts/monitoring.sh checks
# the dashboard with python3) and curl (scripts/sqs.sh waits for moto with it).
if [ "${1:-}" != build ]; then
  command -v curl >/dev/null || missing+=(curl)
  python3 -m pip --version >/dev/null 2>&1 || missing+=(python3 python3-pip)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps.sh: installing ${missing[*]} from Debian's packages" >&2
  if [ "$(id -u)" != 0 ]; then
    echo "deps.sh: not root: install them yourself (apt-get install ${missing[*]})" >&2
    exit 1
  fi
  apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
fi
[ "${1:-}" = build ] && exit 0

# The bench's psycopg2 reference consumer (its smoke test runs with the tests): psycopg2-binary
# from PyPI if missing; never fails (the harness then reports those rows as skipped).
"$(dirname "$0")/psycopg2.sh"
