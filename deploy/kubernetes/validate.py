#!/usr/bin/env python3
"""Validates rendered manifests (a multi-document YAML stream on stdin)
against the Kubernetes JSON schemas that the kubernetes-validate package
ships, strictly (unknown fields are errors). Exits 1 naming each invalid
document.

Usage: validate.py KUBERNETES_VERSION [EXPECTED_KIND ...] < manifests.yaml
Each EXPECTED_KIND (e.g. DaemonSet) must appear at least once.
"""

import sys

import kubernetes_validate
import yaml


def main():
    version, expected = sys.argv[1], sys.argv[2:]
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d is not None]
    if not docs:
        sys.exit("validate.py: no manifests on stdin")
    bad = ok = 0
    kinds = set()
    for d in docs:
        what = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        kinds.add(d.get("kind"))
        try:
            kubernetes_validate.validate(d, version, strict=True)
            ok += 1
            print(f"ok    {what}")
        except kubernetes_validate.ValidationError as e:
            bad += 1
            print(f"FAIL  {what}: {e.message} at {'/'.join(str(p) for p in e.path)}")
        except Exception as e:  # an unknown kind or version is a failure too
            bad += 1
            print(f"FAIL  {what}: {type(e).__name__}: {e}")
    for k in expected:
        if k not in kinds:
            bad += 1
            print(f"FAIL  no {k} was rendered")
    print(f"{ok} passed, {bad} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
