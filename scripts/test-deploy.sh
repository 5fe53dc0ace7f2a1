#!/usr/bin/env bash
# Offline validation of the Kubernetes deployment (deploy/kubernetes):
# renders the Helm chart with deploy/kubernetes/render.py (Helm itself is not
# installable here: no Debian, PyPI or npm package ships it; render.py
# renders the chart's template subset and refuses anything else) and
# validates every manifest strictly against the Kubernetes JSON schemas
# shipped by the kubernetes-validate package (PyPI), for each value set the
# chart supports. A negative case checks the validator rejects a broken
# manifest. Needs no cluster and no root.
#   ./scripts/test-deploy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEPLOY=deploy/kubernetes
K8S=1.30.0
die() { echo "scripts/test-deploy.sh: $*" >&2; exit 1; }

[ -x /usr/bin/python3 ] || die "/usr/bin/python3 is missing (scripts/install-deps.sh installs it)"
VENV=$DEPLOY/.venv
[ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV" || die "could not make a venv (python3-venv)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$DEPLOY/requirements.txt"
PY=$VENV/bin/python

failed=()
check() { # NAME EXPECTED_KINDS -- render args...
  local name=$1 kinds=$2
  shift 2
  echo "== $name"
  local out
  out=$(mktemp)
  if ! timeout 60 "$PY" "$DEPLOY/render.py" "$DEPLOY/runcell" "$@" >"$out"; then
    failed+=("$name: render failed"); rm -f "$out"; return
  fi
  # shellcheck disable=SC2086
  timeout 120 "$PY" "$DEPLOY/validate.py" "$K8S" $kinds <"$out" || failed+=("$name: invalid manifests")
  rm -f "$out"
}
check "defaults (etcd in the release)" "DaemonSet Service StatefulSet PodDisruptionBudget"
check "external etcd, microVM, node selector, node labels" "DaemonSet Service PodDisruptionBudget" \
  --set 'nodeLabels=["zone=a","runcell.dev/tier=gpu"]' --set etcd.enabled=false --set 'etcd.endpoints=["etcd-a:2379","etcd-b:2379"]' \
  --set microvm=true --set 'nodeSelector={"runcell.dev/node":"true"}' --set metrics.scrape=false
# The rendered chart says what it claims: the external endpoints reach the
# flag, five etcd members are listed in the initial cluster.
ext=$(timeout 60 "$PY" "$DEPLOY/render.py" "$DEPLOY/runcell" --set etcd.enabled=false --set 'etcd.endpoints=["etcd-a:2379","etcd-b:2379"]')
grep -q -- '--cluster=etcd://etcd-a:2379,etcd-b:2379' <<<"$ext" || failed+=("external etcd endpoints not in --cluster")
grep -q 'kind: StatefulSet' <<<"$ext" && failed+=("etcd.enabled=false still renders a StatefulSet")
# Node labels: the Kubernetes node name from the downward API by default,
# and the nodeLabels values, each a --node-label flag.
labels=$(timeout 60 "$PY" "$DEPLOY/render.py" "$DEPLOY/runcell" --set 'nodeLabels=["zone=a","disk=ssd"]')
grep -q -- '- --node-label=runcell.dev/k8s-node=$(NODE_NAME)$' <<<"$labels" ||
  failed+=("the Kubernetes node name is not a --node-label")
grep -q -- '- --node-label=zone=a$' <<<"$labels" && grep -q -- '- --node-label=disk=ssd$' <<<"$labels" ||
  failed+=("nodeLabels do not reach --node-label")
grep -A3 'name: NODE_NAME' <<<"$labels" | grep -q 'fieldPath: spec.nodeName' ||
  failed+=("NODE_NAME is not the downward API's spec.nodeName")
nolabel=$(timeout 60 "$PY" "$DEPLOY/render.py" "$DEPLOY/runcell" --set 'nodeNameLabel=')
grep -q -- '--node-label' <<<"$nolabel" && failed+=("nodeNameLabel empty still renders a --node-label")
five=$(timeout 60 "$PY" "$DEPLOY/render.py" "$DEPLOY/runcell" --set etcd.replicas=5)
grep -q -- '--initial-cluster=runcell-etcd-0=http://runcell-etcd-0.runcell-etcd-peer:2380,.*runcell-etcd-4=http://runcell-etcd-4.runcell-etcd-peer:2380$' <<<"$five" ||
  failed+=("etcd.replicas=5 does not list five initial members")
# Negative: the validator must reject a DaemonSet with an unknown field and
# a wrong type.
echo "== a broken manifest is rejected"
broken=$(timeout 60 "$PY" "$DEPLOY/render.py" "$DEPLOY/runcell" | sed -e 's/hostPID: true/hostPID: "yes"/' -e 's/updateStrategy:/updateStrategi:/')
# (Its report is shown as the reasons only: its count line is not this
# script's result.)
if report=$(timeout 120 "$PY" "$DEPLOY/validate.py" "$K8S" <<<"$broken"); then
  failed+=("the validator accepted a broken DaemonSet")
else
  grep '^FAIL' <<<"$report" | sed 's/^FAIL /rejected as expected:/'
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAIL: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "deploy: every rendered manifest is valid Kubernetes $K8S"
