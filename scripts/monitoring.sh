#!/usr/bin/env bash
# Checks the shipped monitoring files (examples/monitoring/): the Prometheus alert rules and the
# Grafana dashboard. Needs no server and no cargo build; a few seconds.
#
#   scripts/monitoring.sh           # check everything (run by scripts/test.sh)
#   scripts/monitoring.sh install   # only install Debian's prometheus (for promtool) if missing
#
# * `promtool check rules alerts.yml` and `promtool test rules alerts.test.yml` (the rules' unit
#   tests: series that fire each alert and series that must not);
# * the dashboard is valid JSON (`python3 -m json.tool`), every panel queries `${DS_PROMETHEUS}`,
#   and every PromQL expression in it parses (promtool, with Grafana's variables substituted);
# * every metric name in the dashboard's and the rules' expressions is one the runtime emits
#   (a `counter!`/`gauge!`/`histogram!` call in inbox-runtime/src; histograms also as `_bucket`,
#   `_sum`, `_count`), and every label they match or group by is one it sets (plus `le` for
#   buckets, `quantile` for summaries, and the scrape's `instance` and `job`).
#
# promtool comes from the Debian package `prometheus`, installed if `promtool` is missing
# (`apt-get update` once, then `apt-get install`); the package's own service is not used.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=examples/monitoring

install_missing() {
  command -v promtool >/dev/null && return 0
  echo "monitoring.sh: installing prometheus (for promtool) from Debian's packages" >&2
  if [ "$(id -u)" != 0 ]; then
    echo "monitoring.sh: not root: install it yourself (apt-get install prometheus)" >&2
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus >&2
  # The package starts its own server on 9090 where a service manager runs: not ours.
  command -v service >/dev/null && service prometheus stop >/dev/null 2>&1 || true
}

check() {
  install_missing
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/inbox-monitoring.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT

  promtool check rules "$DIR/alerts.yml"
  promtool test rules "$DIR/alerts.test.yml"
  python3 -m json.tool "$DIR/grafana-dashboard.json" >/dev/null

  python3 - "$DIR/grafana-dashboard.json" "$DIR/alerts.yml" inbox-runtime/src \
    "$work/dashboard-rules.yml" <<'PYTHON'
import json, pathlib, re, sys

dashboard_path, alerts_path, src, rules_out = sys.argv[1:5]
errors = []

# What the runtime emits: name -> (kind, label keys), from its metrics macros.
emitted = {}
call = re.compile(r'\b(counter|gauge|histogram)!\(\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"((?:[^()]|\([^()]*\))*)\)')
for path in sorted(pathlib.Path(src).rglob("*.rs")):
    for kind, name, rest in call.findall(path.read_text()):
        known_kind, labels = emitted.setdefault(name, (kind, set()))
        if known_kind != kind:
            errors.append(f"{path}: {name} is a {kind} here, a {known_kind} elsewhere")
        labels.update(re.findall(r'"([a-zA-Z_][a-zA-Z0-9_]*)"\s*=>', rest))
if len(emitted) < 10:
    errors.append(f"found only {len(emitted)} metrics in {src}: is the pattern out of date?")
SCRAPE = {"instance", "job"}

def series(name):
    """(base metric, labels allowed) for a series name as the exporter renders it."""
    if name in emitted:
        kind, labels = emitted[name]
        return name, labels | SCRAPE | ({"quantile"} if kind == "histogram" else set())
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and emitted.get(base, ("",))[0] == "histogram":
            return base, emitted[base][1] | SCRAPE | ({"le"} if suffix == "_bucket" else set())
    return None, set()

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "offset", "bool", "inf", "nan", "atan2"}
string = r'"(?:[^"\\]|\\.)*"'

def check_expr(where, expr):
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    names, allowed = [], set()
    for name, matchers in re.findall(r'([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{((?:[^{}"]|' + string + r')*)\}', expr):
        if not name:
            errors.append(f"{where}: a selector without a metric name: {{{matchers}}}")
            continue
        names.append(name)
        base, labels = series(name)
        allowed |= labels
        for label in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*' + string, matchers):
            if base and label not in labels:
                errors.append(f"{where}: {name} has no label {label!r} (it has {sorted(labels)})")
    bare = re.sub(string, "", expr)
    bare = re.sub(r"\{[^{}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    grouped = []
    def grouping(m):
        grouped.extend(l.strip() for l in m.group(2).split(",") if l.strip())
        return " "
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", grouping, bare)
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", bare):
        if m.group(2) or m.group(1).lower() in KEYWORDS:
            continue
        names.append(m.group(1))
        allowed |= series(m.group(1))[1]
    if not names:
        errors.append(f"{where}: no metric in {expr!r}")
    for name in names:
        if series(name)[0] is None:
            errors.append(f"{where}: {name} is not a metric the runtime emits")
    for label in grouped:
        if label not in allowed:
            errors.append(f"{where}: groups by {label!r}, which none of its metrics has")

# The dashboard.
dashboard = json.loads(pathlib.Path(dashboard_path).read_text())
if not any(i.get("name") == "DS_PROMETHEUS" for i in dashboard.get("__inputs", [])):
    errors.append("dashboard: no DS_PROMETHEUS input")
variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
if "consumer" not in variables:
    errors.append("dashboard: no `consumer` variable")
exprs = []
def panels(items):
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))
for panel in panels(dashboard["panels"]):
    where = f"dashboard panel {panel.get('title')!r}"
    for item in [panel] + panel.get("targets", []):
        if "datasource" in item and item["datasource"].get("uid") != "${DS_PROMETHEUS}":
            errors.append(f"{where}: datasource {item['datasource']} is not ${{DS_PROMETHEUS}}")
    for target in panel.get("targets", []):
        check_expr(where, target["expr"])
        exprs.append(target["expr"])
for name, variable in variables.items():
    query = variable.get("query", "")
    query = query.get("query", "") if isinstance(query, dict) else query
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", query)
    if not m:
        errors.append(f"dashboard variable {name}: not label_values(metric, label): {query!r}")
        continue
    base, labels = series(re.sub(r"\{.*", "", m.group(1)))
    if base is None or m.group(2) not in labels:
        errors.append(f"dashboard variable {name}: {m.group(1)} has no label {m.group(2)!r}")

# The alert rules (block scalars `expr: |` or one-line `expr:`), without a YAML library.
lines = pathlib.Path(alerts_path).read_text().splitlines()
count = 0
for i, line in enumerate(lines):
    m = re.match(r"^(\s*)expr:\s*(.*)$", line)
    if not m:
        continue
    if m.group(2) in ("|", "|-", ">", ">-"):
        body, j = [], i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(m.group(1))):
            body.append(lines[j]); j += 1
        expr = "\n".join(body)
    else:
        expr = m.group(2).strip().strip("'\"")
    count += 1
    check_expr(f"{alerts_path}:{i + 1}", expr)
if count == 0:
    errors.append(f"{alerts_path}: no expr found")

# Every dashboard expression, Grafana's variables substituted, as a recording rule: promtool
# parses them.
with open(rules_out, "w") as out:
    out.write("groups:\n  - name: dashboard\n    rules:\n")
    for n, expr in enumerate(exprs):
        expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
        expr = re.sub(r"\$\{?(\w+)\}?", ".*", expr)
        out.write(f"      - record: dashboard_expr_{n}\n        expr: {json.dumps(expr)}\n")

if errors:
    errors = list(dict.fromkeys(errors))
    print("monitoring.sh: " + "\n  ".join(["problems:"] + errors), file=sys.stderr)
    sys.exit(1)
print(f"monitoring.sh: dashboard: {len(exprs)} queries, {len(variables)} variables; rules: "
      f"{count} expressions; every metric and label is one inbox-runtime/src emits "
      f"({len(emitted)} metrics)")
PYTHON
  if ! promtool check rules "$work/dashboard-rules.yml" >/dev/null; then
    echo "monitoring.sh: a dashboard query does not parse (promtool above; dashboard_expr_N is" \
      "the dashboard's Nth query, from 0)" >&2
    return 1
  fi
  echo "monitoring.sh: every dashboard query parses"
}

case "${1:-check}" in
  check) check ;;
  install) install_missing ;;
  *)
    echo "usage: $0 [check|install]" >&2
    exit 2
    ;;
esac
