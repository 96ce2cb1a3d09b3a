#!/usr/bin/env bash
# Makes `python3 -c 'import psycopg2'` work, for the psycopg2 reference consumer of the bench's
# peers section (examples/bench/peers_psycopg2.py): installs `psycopg2-binary` (a wheel, nothing
# to compile) from PyPI with pip when it is missing, into the user's Python (with
# `--break-system-packages` where Debian's pip refuses). Run by scripts/deps.sh (so by
# scripts/test.sh) and by scripts/bench.sh when the peers section runs.
#
#   scripts/psycopg2.sh
#
# Quick and silent when psycopg2 is importable. Never fails: without python3, pip or the network
# (pip gives up after 15 s) it says so on stderr, and the harness reports the psycopg2 rows as
# skipped with the reason.
set -uo pipefail

python3 -c 'import psycopg2' 2>/dev/null && exit 0
if ! command -v python3 >/dev/null; then
  echo "psycopg2.sh: no python3: the bench's psycopg2 rows will be skipped" >&2
  exit 0
fi
echo "psycopg2.sh: installing psycopg2-binary from PyPI" >&2
install=(python3 -m pip install -q --disable-pip-version-check --timeout 15 --retries 1
  "psycopg2-binary~=2.9")
"${install[@]}" >&2 || "${install[@]}" --break-system-packages >&2 || true
python3 -c 'import psycopg2' 2>/dev/null ||
  echo "psycopg2.sh: psycopg2 is still not importable: the bench's psycopg2 rows will be skipped" >&2
exit 0
