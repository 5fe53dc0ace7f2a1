#!/usr/bin/python3
"""Cluster mode, for real: three etcd members and three `runcell serve
--cluster` nodes on loopback (each its own port, data dir and cgroup
parent), driven over HTTP. Run by scripts/test-cluster.sh (as root, after
`cargo build`); stdlib only. Every request and wait is bounded.

Prints one line per check and `N passed, N failed`; exits 1 on any failure.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUNCELL = os.path.join(REPO, "target", "debug", "runcell")
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
RUN_ID = f"{os.getpid()}"

passed, failed = [], []


def check(name, ok, detail=""):
    if ok:
        passed.append(name)
        print(f"ok    {name}", flush=True)
    else:
        failed.append(name)
        print(f"FAIL  {name} {detail}", flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http(method, url, key=None, body=None, timeout=30, headers=None):
    """(status, headers, parsed JSON or text); never raises for HTTP errors."""
    data = None
    h = dict(headers or {})
    if key:
        h["Authorization"] = f"Bearer {key}"
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status, hdrs = r.status, r.headers
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, e.headers
    try:
        return status, hdrs, json.loads(raw) if raw else None
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")


def wait_for(what, fn, timeout=20, every=0.25):
    """Polls fn until it returns a truthy value; returns it, or None."""
    until = time.time() + timeout
    last = None
    while time.time() < until:
        try:
            last = fn()
            if last:
                return last
        except (OSError, urllib.error.URLError) as e:
            last = e
        time.sleep(every)
    print(f"      (gave up waiting {timeout}s for {what}; last: {last!r})", flush=True)
    return None


class Etcd:
    def __init__(self, root, n=3):
        self.members = []
        for i in range(n):
            self.members.append(
                {
                    "name": f"e{i}",
                    "client": free_port(),
                    "peer": free_port(),
                    "dir": os.path.join(root, f"etcd{i}"),
                    "proc": None,
                }
            )
        self.cluster = ",".join(f"{m['name']}=http://127.0.0.1:{m['peer']}" for m in self.members)
        self.log = os.path.join(root, "etcd.log")

    @property
    def url(self):
        return "etcd://" + ",".join(f"127.0.0.1:{m['client']}" for m in self.members)

    def start(self, i, state="new"):
        m = self.members[i]
        log = open(self.log, "a")
        m["proc"] = subprocess.Popen(
            [
                ETCD,
                "--name", m["name"],
                "--data-dir", m["dir"],
                "--listen-client-urls", f"http://127.0.0.1:{m['client']}",
                "--advertise-client-urls", f"http://127.0.0.1:{m['client']}",
                "--listen-peer-urls", f"http://127.0.0.1:{m['peer']}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{m['peer']}",
                "--initial-cluster", self.cluster,
                "--initial-cluster-state", state,
                "--initial-cluster-token", f"runcell-test-{RUN_ID}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def healthy(self, i):
        m = self.members[i]
        try:
            s, _, b = http("GET", f"http://127.0.0.1:{m['client']}/health", timeout=3)
            return s == 200 and isinstance(b, dict) and b.get("health") == "true"
        except OSError:
            return False

    def stop(self, i):
        p = self.members[i]["proc"]
        if p and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.members[i]["proc"] = None


class Node:
    def __init__(self, root, name, cluster_url):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tempfile.mkdtemp(prefix=f"runcell-cluster-{name}.", dir="/run")
        self.cgroup = f"runcell-test-{name}-{RUN_ID}"
        self.log = os.path.join(root, f"{name}.log")
        self.cluster_url = cluster_url
        self.proc = None
        self.key = None

    def start(self):
        log = open(self.log, "a")
        self.proc = subprocess.Popen(
            [
                RUNCELL, "serve",
                "--listen", f"127.0.0.1:{self.port}",
                "--data-dir", self.data,
                "--cgroup-parent", self.cgroup,
                "--cluster", self.cluster_url,
                "--node-name", self.name,
                "--auto-build=false",
                "--standby", "0",
                "--warm-pool", "code-interpreter=0",
                "--max-sandboxes", "12",
                "--shutdown-grace", "3s",
                "--lost-after", "20s",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        ok = wait_for(
            f"{self.name} /healthz",
            lambda: self.proc.poll() is None and http("GET", self.url + "/healthz", timeout=3)[0] == 200,
            timeout=40,
        )
        if not ok:
            raise RuntimeError(f"node {self.name} did not start; its log:\n" + open(self.log).read()[-4000:])
        with open(os.path.join(self.data, "api-key")) as f:
            self.key = f.read().strip()

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def create(node, key, body=None):
    b = {"template": "host", "metadata": {"suite": f"cluster-{RUN_ID}"}}
    b.update(body or {})
    return http("POST", node.url + "/v1/sandboxes", key, b, timeout=60)


def run(node, key, sid, cmd, timeout=30):
    return http("POST", f"{node.url}/v1/sandboxes/{sid}/exec", key, {"cmd": cmd}, timeout=timeout)


def ids(listing):
    return sorted(s["id"] for s in listing) if isinstance(listing, list) else listing


def main():
    for tool in (RUNCELL, ETCD):
        if not os.access(tool, os.X_OK):
            sys.exit(f"cluster_test: {tool} is missing (cargo build; scripts/install-deps.sh installs etcd-server)")
    root = tempfile.mkdtemp(prefix="runcell-cluster-test.")
    etcd = Etcd(root)
    nodes = []
    try:
        for i in range(3):
            etcd.start(i)
        if not wait_for("etcd quorum", lambda: all(etcd.healthy(i) for i in range(3)), timeout=30):
            raise RuntimeError("etcd did not become healthy:\n" + open(etcd.log).read()[-4000:])
        print(f"== etcd: 3 members ({etcd.url})", flush=True)
        for name in ("na", "nb", "nc"):
            n = Node(root, name, etcd.url)
            n.start()
            nodes.append(n)
        a, b, c = nodes
        print(f"== nodes: {', '.join(f'{n.name} {n.url}' for n in nodes)}", flush=True)
        scenario(etcd, a, b, c)
        for n in nodes:
            sdk_suite(n)
        sdk_suite(c, "pandastack (PyPI)")
    except Exception as e:  # a setup failure is a failure, loudly
        check("cluster scenario ran to the end", False, f"{type(e).__name__}: {e}")
    finally:
        for n in nodes:
            try:
                if n.key and n.proc and n.proc.poll() is None:
                    s, _, lst = http("GET", n.url + "/v1/sandboxes", n.key, timeout=10)
                    for sb in lst if isinstance(lst, list) else []:
                        if sb.get("node") == n.name:
                            http("DELETE", f"{n.url}/v1/sandboxes/{sb['id']}", n.key, timeout=10)
            except OSError:
                pass
        for n in nodes:
            n.stop()
        for i in range(3):
            etcd.stop(i)
        if failed:
            for n in nodes:
                print(f"---- {n.name} log (tail) ----")
                print(open(n.log).read()[-3000:])
        for n in nodes:
            shutil.rmtree(n.data, ignore_errors=True)
            # The node's cgroup parents, once the last teardown is done.
            left = [os.path.join("/sys/fs/cgroup", c, n.cgroup) for c in os.listdir("/sys/fs/cgroup")]
            until = time.time() + 10
            while time.time() < until:
                for d in list(left):
                    try:
                        os.rmdir(d)
                        left.remove(d)
                    except FileNotFoundError:
                        left.remove(d)
                    except OSError:
                        pass
                if not left:
                    break
                time.sleep(0.2)
            if left:
                check(f"{n.name}'s cgroups are gone after the test", False, left)
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(passed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


def scenario(etcd, a, b, c):
    nodes = (a, b, c)
    # Membership: every node sees the three.
    for n in nodes:
        got = wait_for(
            f"{n.name} to see 3 nodes",
            lambda n=n: len((http("GET", n.url + "/v1/cluster", n.key)[2] or {}).get("nodes", [])) == 3,
        )
        check(f"{n.name} sees the three nodes in GET /v1/cluster", bool(got))

    # Keys: B's own key and a key created on B with the CLI work on A and C.
    for n in (a, c):
        got = wait_for(f"B's key on {n.name}", lambda n=n: http("GET", n.url + "/v1/sandboxes", b.key)[0] == 200)
        check(f"node B's key works on {n.name}", bool(got))
    out = subprocess.run(
        [RUNCELL, "key", "create", "--workspace", "team", "--name", "cluster-test", "--data-dir", b.data],
        capture_output=True, text=True, timeout=30,
    )
    team = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
    check("runcell key create on B", bool(team), out.stderr)
    got = wait_for("team key on A", lambda: http("GET", a.url + "/v1/sandboxes", team)[0] == 200)
    check("a key created on B (workspace team) works on A", bool(got))
    s, _, _ = http("GET", a.url + "/v1/sandboxes", "rc_" + "0" * 48)
    check("an unknown key is still refused on every node (401)", s == 401, s)

    # Create through A on B, use it through C.
    s, h, sb = create(a, a.key, {"node": "nb"})
    check("create through A placed on B (node: nb) answers 201", s == 201, f"{s} {sb}")
    on_b = sb["id"]
    check("the create's answer names the owner node", h.get("x-runcell-node") == "nb", dict(h))
    s, h, r = run(c, a.key, on_b, "echo hello from $(hostname) && cat /proc/self/cgroup | head -3")
    check("exec through C on B's sandbox", s == 200 and "hello from" in json.dumps(r), f"{s} {r}")
    # A file written through A is read through C.
    req = urllib.request.Request(
        f"{a.url}/v1/sandboxes/{on_b}/fs?path=/tmp/x.txt", data=b"written through A", method="PUT",
        headers={"Authorization": f"Bearer {a.key}", "Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        wrote = r.status
    req = urllib.request.Request(f"{c.url}/v1/sandboxes/{on_b}/fs?path=/tmp/x.txt", headers={"Authorization": f"Bearer {a.key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        got = r.read()
    check("a file written through A is read through C", wrote in (200, 204) and got == b"written through A", f"{wrote} {got!r}")
    # The exec stream (SSE) through a forwarding node arrives as it is made.
    t0 = time.time()
    req = urllib.request.Request(
        f"{c.url}/v1/sandboxes/{on_b}/exec/stream",
        data=json.dumps({"cmd": "echo one; sleep 1.5; echo two"}).encode(), method="POST",
        headers={"Authorization": f"Bearer {a.key}", "Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    first_at, text = None, ""
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r:
            line = line.decode()
            text += line
            if first_at is None and "one" in line:
                first_at = time.time() - t0
    check(
        "an exec stream through C arrives chunk by chunk (first output before the command ends)",
        first_at is not None and first_at < 1.2 and "two" in text and "exit" in text,
        f"first at {first_at}, {text[:300]!r}",
    )

    # List: through any node, the workspace's sandboxes of every node, and only those.
    s, _, on_a = create(a, a.key, {"node": "na"})
    s2, _, on_c = create(b, a.key, {"node": "nc"})
    s3, _, team_sb = create(c, team, {"node": "nb"})
    check("creates placed on A, C (for default) and B (for team)", (s, s2, s3) == (201, 201, 201), (s, s2, s3))
    want = sorted([on_b, on_a["id"], on_c["id"]])
    for n in nodes:
        s, _, lst = http("GET", f"{n.url}/v1/sandboxes?metadata.suite=cluster-{RUN_ID}", a.key)
        check(f"list through {n.name} shows the workspace's sandboxes of all nodes and only those", ids(lst) == want, f"{ids(lst)} != {want}")
        s, _, lst = http("GET", f"{n.url}/v1/sandboxes", team)
        check(f"list through {n.name} with team's key shows only team's", ids(lst) == [team_sb["id"]], ids(lst))
    s, _, _ = http("GET", f"{c.url}/v1/sandboxes/{team_sb['id']}", a.key)
    check("another workspace's sandbox on another node is a 404", s == 404, s)
    s, _, lst = http("GET", f"{c.url}/v1/sandboxes?metadata.suite=none", a.key)
    check("a metadata filter applies to other nodes' sandboxes", lst == [], lst)

    # Placement: with no node named, creates spread by free slots.
    placed = []
    for _ in range(3):
        s, h, sb = create(a, a.key)
        placed.append((s, h.get("x-runcell-node"), sb.get("id") if isinstance(sb, dict) else None))
    owners = {p[1] for p in placed}
    check("three unplaced creates through A land on more than one node", all(p[0] == 201 for p in placed) and len(owners) >= 2, placed)
    for _, _, sid in placed:
        if sid:
            http("DELETE", f"{a.url}/v1/sandboxes/{sid}", a.key)

    # Draining: a node that drains takes no creates; its sandboxes go on.
    s, _, v = http("POST", f"{c.url}/v1/cluster/drain", a.key)
    check("POST /v1/cluster/drain on C", s == 200 and v.get("draining") is True, f"{s} {v}")
    got = wait_for(
        "A to see C draining",
        lambda: any(n["name"] == "nc" and n["draining"] for n in http("GET", a.url + "/v1/cluster", a.key)[2]["nodes"]),
        timeout=10,
    )
    check("A sees C draining", bool(got))
    placed = [create(a, a.key) for _ in range(4)]
    where = [p[1].get("x-runcell-node") for p in placed]
    check("no create lands on a draining node", all(p[0] == 201 for p in placed) and "nc" not in where, where)
    for p in placed:
        if p[0] == 201:
            http("DELETE", f"{a.url}/v1/sandboxes/{p[2]['id']}", a.key)
    s, _, r = run(a, a.key, on_c["id"], "echo draining")
    check("a draining node's sandbox still works", s == 200, f"{s} {r}")
    http("DELETE", f"{c.url}/v1/cluster/drain", a.key)

    # Delete through another node.
    s, _, _ = http("DELETE", f"{c.url}/v1/sandboxes/{on_a['id']}", a.key)
    check("delete through C of A's sandbox answers 204", s == 204, s)
    s, _, _ = http("GET", f"{b.url}/v1/sandboxes/{on_a['id']}", a.key)
    check("then it is gone through B too (404)", s == 404, s)

    # One etcd member down: nothing changes.
    etcd.stop(2)
    s, _, r = run(c, a.key, on_b, "echo still")
    check("with one etcd member stopped, exec through C on B's sandbox works", s == 200, f"{s} {r}")
    s, _, x = create(b, a.key, {"node": "na"})
    check("with one etcd member stopped, a create placed on A through B works", s == 201, f"{s} {x}")
    if s == 201:
        http("DELETE", f"{c.url}/v1/sandboxes/{x['id']}", a.key)
    etcd.start(2, state="existing")
    wait_for("etcd member 3 back", lambda: etcd.healthy(2), timeout=20)

    # SIGKILL node B mid-exec: its sandboxes are reported lost, nothing hangs,
    # the others are unaffected.
    result = {}

    def long_exec():
        try:
            result["r"] = run(a, a.key, on_b, "sleep 20; echo done", timeout=40)
        except Exception as e:  # the connection is cut: that is the answer
            result["r"] = ("error", type(e).__name__)
        result["t"] = time.time()

    th = threading.Thread(target=long_exec)
    th.start()
    time.sleep(1.5)
    killed_at = time.time()
    b.kill()
    th.join(15)
    check("an exec through A on B's sandbox ends when B is SIGKILLed (no hang)", not th.is_alive() and result.get("t", 1e18) - killed_at < 10, result)
    s, _, r = run(c, a.key, on_b, "echo x", timeout=15)
    check("B's sandbox answers 503 naming node nb as lost", s == 503 and "nb" in json.dumps(r) and "lost" in json.dumps(r), f"{s} {r}")
    s, _, r = run(a, a.key, on_c["id"], "echo unaffected")
    check("C's sandbox through A is unaffected", s == 200, f"{s} {r}")
    got = wait_for(
        "B's sandbox listed as lost",
        lambda: any(x["id"] == on_b and x.get("status") == "lost" for x in (http("GET", a.url + "/v1/sandboxes", a.key)[2] or [])),
        timeout=15,
    )
    check("after B's lease expires, list shows its sandbox as lost", bool(got))
    got = wait_for("A to forget nb", lambda: len(http("GET", a.url + "/v1/cluster", a.key)[2]["nodes"]) == 2, timeout=15)
    check("B leaves the node list when its lease expires", bool(got))
    s, _, x = create(a, a.key)
    check("creates go on (to A or C) with B gone", s == 201 and x.get("id"), f"{s} {x}")
    if s == 201:
        http("DELETE", f"{a.url}/v1/sandboxes/{x['id']}", a.key)
    # B comes back: re-registers, re-attaches its sandbox (it outlived the daemon).
    b.start()
    got = wait_for("B back", lambda: run(c, a.key, on_b, "echo back")[0] == 200, timeout=20)
    check("B restarted: its sandbox works again through C", bool(got))

    # All etcd members down: sandboxes keep working on their nodes, creates 503.
    for i in range(3):
        etcd.stop(i)
    s, _, r = run(c, a.key, on_c["id"], "echo no etcd")
    check("with etcd down, a sandbox works through its own node", s == 200, f"{s} {r}")
    time.sleep(5)  # the node list goes stale
    s, h, r = create(c, a.key)
    check("with etcd down, a create answers 503 with Retry-After", s == 503 and h.get("Retry-After"), f"{s} {r}")
    s, _, r = run(c, a.key, on_c["id"], "echo still no etcd")
    check("with etcd down for a while, the sandbox still works on its node", s == 200, f"{s} {r}")
    for i in range(3):
        etcd.start(i, state="existing")
    wait_for("etcd back", lambda: all(etcd.healthy(i) for i in range(3)), timeout=30)
    got = wait_for("creates back", lambda: create(a, a.key, {"node": "nc"})[0] == 201, timeout=20)
    check("etcd back: creates work again", bool(got))
    got = wait_for(
        "a consistent list",
        lambda: {on_b, on_c["id"]} <= set(ids(http("GET", f"{b.url}/v1/sandboxes?metadata.suite=cluster-{RUN_ID}", a.key)[2]) or []),
        timeout=15,
    )
    check("etcd back: list through B shows the sandboxes made before the outage", bool(got))

    # A node that comes back later than --lost-after (20 s) removes the
    # sandboxes it had (they were reported lost) instead of re-attaching them.
    b.kill()
    time.sleep(23)
    b.start()
    got = wait_for(
        "B's late sandbox to be gone",
        lambda: run(c, a.key, on_b, "true", timeout=10)[0] == 404,
        timeout=20,
    )
    check("B back late: its sandbox answers 404 through C", bool(got))
    s, _, r = run(b, a.key, on_b, "true", timeout=10)
    check("B back late: B answers 404 saying the sandbox was lost", s == 404 and "lost" in json.dumps(r), f"{s} {r}")
    got = wait_for(
        "B's late sandbox out of the list",
        lambda: on_b not in (ids(http("GET", f"{a.url}/v1/sandboxes", a.key)[2]) or [on_b]),
        timeout=10,
    )
    check("B back late: its sandbox is gone from the list", bool(got))
    got = wait_for("B's sandbox directory removed", lambda: not os.path.exists(os.path.join(b.data, "sandboxes", on_b)), timeout=15)
    check("B back late: nothing of the sandbox is left on B", bool(got))


def sdk_suite(node, what="@pandastack/sdk"):
    """A published client's suite, unchanged, through one node."""
    env = dict(os.environ, PANDASTACK_API=node.url, PANDASTACK_API_KEY=node.key)
    clients = os.path.join(REPO, "tests", "clients")
    if what == "@pandastack/sdk":
        cmd = ["node", "--test", os.path.join(clients, "pandastack-sdk.test.mjs")]
    else:
        cmd = [
            os.path.join(clients, ".venv", "bin", "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
            os.path.join(clients, "test_pandastack_py.py"),
        ]
    print(f"== {what} suite through {node.name}", flush=True)
    name = f"the {what} suite passes through node {node.name}"
    try:
        p = subprocess.run(cmd, env=env, timeout=900, cwd=REPO)
        check(name, p.returncode == 0, f"exit {p.returncode}")
    except subprocess.TimeoutExpired:
        check(name, False, "timed out after 900 s")


if __name__ == "__main__":
    main()
