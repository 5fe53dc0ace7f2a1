#!/usr/bin/python3
"""Cluster mode, for real: three etcd members and three `runcell serve
--cluster` nodes on loopback (each its own port, data dir and cgroup
parent), driven over HTTP. Run by scripts/test-cluster.sh (as root, after
`cargo build`); stdlib only. Every request and wait is bounded.

Prints one line per check and `N passed, N failed`; exits 1 on any failure.
"""

from http.client import HTTPConnection
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
    def __init__(self, root, name, cluster_url, labels=()):
        self.name = name
        self.labels = list(labels)
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
                "--auto-build=false",
                "--standby", "0",
                "--warm-pool", "code-interpreter=0",
                "--max-sandboxes", "12",
                "--shutdown-grace", "3s",
            ]
            + (
                ["--cluster", self.cluster_url, "--node-name", self.name, "--lost-after", "20s"]
                + [f"--node-label={l}" for l in self.labels]
                if self.cluster_url
                else []
            ),
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
        labels = {"na": ["zone=a"], "nb": ["zone=b", "disk=ssd"], "nc": ["zone=b"]}
        for name in ("na", "nb", "nc"):
            n = Node(root, name, etcd.url, labels[name])
            n.start()
            nodes.append(n)
        a, b, c = nodes
        print(f"== nodes: {', '.join(f'{n.name} {n.url}' for n in nodes)}", flush=True)
        placement_by_labels(a, b, c)
        cluster_routes_documented(a, c)
        drain_survives_restart(a, b, c)
        back_pressure(a, b, c)
        own_clients(root, a, b, c)
        scenario(etcd, a, b, c)
        for n in nodes:
            sdk_suite(n)
            sdk_suite(n, "pandastack (PyPI)")
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
    # A one-shot run through A placed on B: its stream comes back through
    # A, and its sandbox is gone once it has run.
    s, h, r = http("POST", a.url + "/v1/run", a.key, {"sandbox": {"node": "nb"}, "exec": {"cmd": "echo one-shot"}})
    first = r.split("\n\n")[0] if isinstance(r, str) else ""
    ran = json.loads(first.split("data: ", 1)[1]) if first.startswith("event: sandbox") else {}
    check(
        "POST /v1/run through A placed on B streams its output",
        s == 200 and h.get("x-runcell-node") == "nb" and "one-shot" in r and "event: exit" in r,
        f"{s} {dict(h)} {r}",
    )
    gone = wait_for("the run's sandbox to go", lambda: http("GET", f"{b.url}/v1/sandboxes/{ran.get('id')}", a.key)[0] == 404)
    check("the run's sandbox is deleted once it has run", bool(ran.get("id")) and bool(gone), ran)
    s, _, r = http("POST", a.url + "/v1/run", a.key, {"sandbox": {"node_selector": {"zone": 5}}, "exec": {"cmd": "true"}})
    check("a malformed sandbox.node_selector on POST /v1/run is a 400 naming it", s == 400 and "sandbox.node_selector" in json.dumps(r), f"{s} {r}")
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
    # Through a load balancer the node that answers is anyone's: ?node=
    # names the node to drain, and the request is forwarded to it.
    s, _, v = http("POST", f"{a.url}/v1/cluster/drain?node=nc", a.key)
    check("POST /v1/cluster/drain?node=nc through A drains C", s == 200 and v.get("node") == "nc" and v.get("draining") is True, f"{s} {v}")
    s, _, v = http("GET", f"{a.url}/v1/cluster", a.key)
    check("A itself is not draining", s == 200 and v.get("draining") is False, f"{s} {v}")
    s, _, v = http("POST", f"{a.url}/v1/cluster/drain?node=nz", a.key)
    check("draining a node that is not in the cluster is a 404 naming it", s == 404 and "nz" in json.dumps(v), f"{s} {v}")
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
    s, _, v = http("DELETE", f"{b.url}/v1/cluster/drain?node=nc", a.key)
    check("DELETE /v1/cluster/drain?node=nc through B undrains C", s == 200 and v.get("node") == "nc" and v.get("draining") is False, f"{s} {v}")

    # Delete through another node.
    s, _, _ = http("DELETE", f"{c.url}/v1/sandboxes/{on_a['id']}", a.key)
    check("delete through C of A's sandbox answers 204", s == 204, s)
    s, _, _ = http("GET", f"{b.url}/v1/sandboxes/{on_a['id']}", a.key)
    check("then it is gone through B too (404)", s == 404, s)

    # One etcd member down: nothing changes. The nodes' client balances
    # over all three endpoints, so many requests (not one) must all work:
    # a request that goes to the stopped member is retried on another.
    etcd.stop(0)
    statuses = []
    for _ in range(8):
        statuses.append(run(c, a.key, on_b, "echo still")[0])
        statuses.append(http("GET", f"{b.url}/v1/sandboxes/{on_b}", a.key)[0])
        s, _, x = create(b, a.key, {"node": "na"})
        statuses.append(s)
        if s == 201:
            statuses.append(http("DELETE", f"{c.url}/v1/sandboxes/{x['id']}", a.key)[0])
        time.sleep(0.3)
    check(
        "with one etcd member stopped, execs, lookups, creates and deletes through other nodes all work",
        set(statuses) <= {200, 201, 204} and statuses.count(201) == 8,
        statuses,
    )
    s, _, v = http("GET", f"{a.url}/v1/cluster", a.key)
    check("with one etcd member stopped, the nodes stay registered", s == 200 and len(v.get("nodes", [])) == 3, f"{s} {v}")
    etcd.start(0, state="existing")
    wait_for("etcd member 1 back", lambda: etcd.healthy(0), timeout=20)

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


def placement_by_labels(a, b, c):
    """Nodes carry labels (--node-label); a create's node_selector places it
    on the least loaded node that carries all of them."""
    print("== placement by node labels", flush=True)
    want = {"na": {"zone": "a"}, "nb": {"zone": "b", "disk": "ssd"}, "nc": {"zone": "b"}}

    def labels_seen():
        v = http("GET", a.url + "/v1/cluster", a.key)[2] or {}
        return {n["name"]: n.get("labels") for n in v.get("nodes", [])}

    got = wait_for("A to see the three nodes' labels", lambda: labels_seen() == want)
    check("GET /v1/cluster shows each node's labels", bool(got), labels_seen())
    made = []
    s, h, sb = create(a, a.key, {"node_selector": {"zone": "b", "disk": "ssd"}})
    check(
        "a create through A with node_selector zone=b,disk=ssd lands on nb (the only match)",
        s == 201 and h.get("x-runcell-node") == "nb",
        f"{s} {h.get('x-runcell-node')} {sb}",
    )
    made.append(sb)
    where = []
    for _ in range(3):
        s, h, sb = create(c, a.key, {"node_selector": {"zone": "b"}})
        where.append((s, h.get("x-runcell-node")))
        made.append(sb)
    check(
        "creates through C with node_selector zone=b land on nb and nc only, spread by free slots",
        all(x[0] == 201 for x in where) and {x[1] for x in where} == {"nb", "nc"},
        where,
    )
    s, h, r = create(b, a.key, {"node_selector": {"zone": "z"}})
    msg = json.dumps(r)
    check(
        "a selector no live node matches is a 503 with Retry-After naming the selector and the nodes' labels",
        s == 503 and h.get("Retry-After") and "zone=z" in msg and "na {zone=a}" in msg
        and isinstance(r, dict) and r.get("node_selector") == {"zone": "z"},
        f"{s} {r}",
    )
    s, _, r = create(a, a.key, {"node": "na", "node_selector": {"zone": "b"}})
    check(
        "a named node that does not match the selector is a 503 saying so",
        s == 503 and "na" in json.dumps(r) and "zone=b" in json.dumps(r),
        f"{s} {r}",
    )
    for bad in ({"zone": "a b"}, {"-zone": "a"}, "zone=a", {"zone": 1}):
        s, _, r = create(a, a.key, {"node_selector": bad})
        check(
            f"a malformed node_selector {json.dumps(bad)} is a 400 naming the field",
            s == 400 and "node_selector" in json.dumps(r),
            f"{s} {r}",
        )
    for sb in made:
        if isinstance(sb, dict) and sb.get("id"):
            http("DELETE", f"{a.url}/v1/sandboxes/{sb['id']}", a.key)
    # A node refuses a malformed label at start-up, naming the flag.
    p = subprocess.run(
        [RUNCELL, "serve", "--cluster", "etcd://127.0.0.1:1", "--node-label", "zone=a b", "--listen", "127.0.0.1:0",
         "--data-dir", tempfile.mkdtemp(prefix="runcell-cluster-badlabel.")],
        capture_output=True, text=True, timeout=30,
    )
    check(
        "runcell serve refuses a malformed --node-label (exit 2, naming the flag)",
        p.returncode == 2 and "--node-label" in p.stderr,
        f"{p.returncode} {p.stderr[-300:]}",
    )


def cluster_nodes(via, key):
    v = http("GET", via.url + "/v1/cluster", key)[2]
    return {n["name"]: n for n in (v or {}).get("nodes", [])} if isinstance(v, dict) else {}


def schema_problems(doc, schema, value, at="$"):
    """What in value does not fit an OpenAPI schema of doc (required
    properties, types, $ref, nullable types, arrays, maps); [] if it fits."""
    if "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    types = schema.get("type")
    types = [types] if isinstance(types, str) else (types or [])
    py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
          "integer": int, "number": (int, float)}
    if types and not any(isinstance(value, py[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                         for t in types):
        return [f"{at} is {type(value).__name__}, not {types}"]
    out = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{at}.{k} is missing" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            sub = props.get(k) or (schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None)
            if sub:
                out += schema_problems(doc, sub, v, f"{at}.{k}")
    elif isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += schema_problems(doc, schema["items"], v, f"{at}[{i}]")
    return out


def cluster_routes_documented(a, c):
    """The /v1/cluster routes are in the OpenAPI document every node serves,
    and a node's answers fit it: the 200 of GET /v1/cluster and of a drain
    match ClusterView, and the statuses seen are documented."""
    doc = http("GET", a.url + "/v1/openapi.json")[2]
    paths = (doc or {}).get("paths", {})
    ops = {
        ("get", "/v1/cluster"): {"200", "401", "404"},
        ("post", "/v1/cluster/drain"): {"200", "401", "404", "503"},
        ("delete", "/v1/cluster/drain"): {"200", "401", "404", "503"},
    }
    missing = [f"{m.upper()} {p} {sorted(want - set(paths.get(p, {}).get(m, {}).get('responses', {})))}"
               for (m, p), want in ops.items()
               if not want <= set(paths.get(p, {}).get(m, {}).get("responses", {}))]
    check("GET /v1/cluster and POST/DELETE /v1/cluster/drain are in /v1/openapi.json with their statuses", not missing, missing)
    schema = paths.get("/v1/cluster", {}).get("get", {}).get("responses", {}).get("200", {}).get(
        "content", {}).get("application/json", {}).get("schema")
    s, _, v = http("GET", c.url + "/v1/cluster", a.key)
    problems = schema_problems(doc, schema, v) if schema else ["no 200 schema"]
    check("a node's GET /v1/cluster answer fits the documented schema (ClusterView, NodeInfo)",
          s == 200 and not problems and len(v.get("nodes", [])) == 3, f"{s} {problems} {v}")
    # A daemon without --cluster answers the routes with the documented 404.
    single = Node(os.path.dirname(a.log), "single", None)
    try:
        single.start()
        got = [(m, p, *http(m, single.url + p, single.key)[::2]) for m, p in
               (("GET", "/v1/cluster"), ("POST", "/v1/cluster/drain"), ("DELETE", "/v1/cluster/drain?node=na"))]
        check(
            "a single node (no --cluster) answers the cluster routes 404 saying it is not part of a cluster",
            all(s == 404 and "not part of a cluster" in json.dumps(v) for _, _, s, v in got),
            got,
        )
    finally:
        single.stop()
        shutil.rmtree(single.data, ignore_errors=True)


def drain_survives_restart(a, b, c):
    """A drain is kept in the node's registry: node C, drained and then
    SIGKILLed and started again, still takes no creates (placement skips
    it, a create naming it is a 503) until DELETE /v1/cluster/drain; its
    sandbox goes on working meanwhile."""
    print("== a drained node stays drained across SIGKILL and restart", flush=True)
    s, _, kept = create(a, a.key, {"node": "nc"})
    if s != 201:
        check("a sandbox is created on C before the drain", False, f"{s} {kept}")
        return
    made = []
    try:
        s, _, v = http("POST", f"{b.url}/v1/cluster/drain?node=nc", a.key)
        check(
            "POST /v1/cluster/drain?node=nc through B drains C",
            s == 200 and isinstance(v, dict) and v.get("node") == "nc" and v.get("draining") is True,
            f"{s} {v}",
        )
        s, h, r = create(a, a.key, {"node": "nc"})
        check(
            "a create through A naming the draining node is a 503 with Retry-After saying it drains",
            s == 503 and h.get("Retry-After") and "nc is draining" in json.dumps(r),
            f"{s} {r}",
        )
        c.kill()
        killed_pid = c.proc.pid
        c.start()
        s, _, v = http("GET", f"{c.url}/v1/cluster", a.key)
        check(
            "C, SIGKILLed and started again, still drains (GET /v1/cluster on C)",
            s == 200 and c.proc.pid != killed_pid and isinstance(v, dict) and v.get("draining") is True,
            f"{s} {v}",
        )
        got = wait_for(
            "A to see the restarted C, draining",
            lambda: (cluster_nodes(a, a.key).get("nc") or {}).get("draining") is True,
            timeout=10,
        )
        check("A sees the restarted C draining", bool(got))
        where = []
        for via in (a, c, b, c):
            s, h, x = create(via, a.key)
            where.append((via.name, s, h.get("x-runcell-node")))
            if s == 201:
                made.append(x["id"])
        check(
            "after the restart no create lands on C, whichever node takes it (C itself included)",
            all(w[1] == 201 and w[2] != "nc" for w in where),
            where,
        )
        s, h, r = create(c, a.key, {"node": "nc"})
        check(
            "after the restart a create through C naming C is a 503 saying it drains",
            s == 503 and h.get("Retry-After") and "nc is draining" in json.dumps(r),
            f"{s} {r}",
        )
        s, _, r = run(a, a.key, kept["id"], "echo survived")
        check(
            "the drained node's sandbox outlived the SIGKILL and works through A",
            s == 200 and "survived" in (r or {}).get("stdout", ""),
            f"{s} {r}",
        )
        s, _, v = http("DELETE", f"{a.url}/v1/cluster/drain?node=nc", a.key)
        check(
            "DELETE /v1/cluster/drain?node=nc through A undrains C",
            s == 200 and isinstance(v, dict) and v.get("node") == "nc" and v.get("draining") is False,
            f"{s} {v}",
        )

        def create_on_c():
            s, h, x = create(a, a.key, {"node": "nc"})
            if s == 201:
                made.append(x["id"])
            return s == 201 and h.get("x-runcell-node") == "nc"

        got = wait_for("a create naming C to be taken", create_on_c, timeout=10, every=0.5)
        check("undrained, C takes creates again (a create through A naming it answers 201)", bool(got))
        # The undrain is kept too: a restart does not bring the drain back.
        c.stop()
        c.start()
        s, _, v = http("GET", f"{c.url}/v1/cluster", a.key)
        check(
            "undrained and restarted, C does not drain",
            s == 200 and isinstance(v, dict) and v.get("draining") is False,
            f"{s} {v}",
        )
    finally:
        for sid in made + [kept["id"]]:
            http("DELETE", f"{a.url}/v1/sandboxes/{sid}", a.key)


def memory_kib(pid):
    """(VmRSS, VmHWM) of a process in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    return out["VmRSS"], out["VmHWM"]


def reset_peak(pid):
    """Resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class SmallBuffer(HTTPConnection):
    """An HTTP connection whose socket receives into a fixed 128 KiB
    buffer: the kernel's autotuning (up to net.ipv4.tcp_rmem's maximum,
    32 MB here) would otherwise soak up tens of MB that a slow client has
    not read yet, and hide whether back-pressure reaches the program."""

    def connect(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 10)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def slow_stream(node, method, path, key, body=None):
    """Opens an SSE response through node on a SmallBuffer connection."""
    conn = SmallBuffer("127.0.0.1", node.port, timeout=60)
    h = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
    if body is not None:
        h["Content-Type"] = "application/json"
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=h)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{method} {path} through {node.name}: {r.status} {r.read()[:300]!r}")
    return conn, r


class SlowSse:
    """Reads an SSE response at most `rate` bytes a second, in reads of
    `step` bytes, calling on_event(name, data, comment) for each event;
    stops when on_event returns True or the stream ends."""

    def __init__(self, resp, rate, step=32 << 10):
        self.resp, self.rate, self.step = resp, rate, step
        self.bytes = 0
        self.slept = 0.0
        self.elapsed = 0.0

    def run(self, on_event, deadline):
        t0 = time.time()
        buf = b""
        try:
            while time.time() < deadline:
                data = self.resp.read1(self.step) if hasattr(self.resp, "read1") else self.resp.read(self.step)
                if not data:
                    return False
                self.bytes += len(data)
                buf += data
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    name, datas, comments = "message", [], []
                    for line in block.decode().split("\n"):
                        if line.startswith(":"):
                            comments.append(line[1:].strip())
                        elif line.startswith("event:"):
                            name = line[6:].strip()
                        elif line.startswith("data:"):
                            datas.append(line[5:].lstrip(" "))
                    if on_event(name, "\n".join(datas) if datas else None, comments):
                        return True
                # At most `rate` bytes a second: a slow client.
                ahead = self.bytes / self.rate - (time.time() - t0)
                if ahead > 0:
                    time.sleep(ahead)
                    self.slept += ahead
            return False
        finally:
            self.elapsed = time.time() - t0


class Probe:
    """Runs execs on sandbox `sid` every `every` s in a thread, in turn
    through `via` (a forwarding node) and straight to `owner`, recording
    each one's status and latency: the owner's are the control for what
    the machine's load does to both."""

    def __init__(self, via, key, sid, owner=None, every=0.2):
        self.via, self.key, self.sid, self.owner, self.every = via, key, sid, owner, every
        self.results = []  # through via
        self.direct = []  # straight to owner
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def once(self, node=None):
        t = time.time()
        s, _, r = run(node or self.via, self.key, self.sid, "echo probe", timeout=30)
        return s, time.time() - t, r

    def _loop(self):
        while not self.stop.is_set():
            s, dt, _ = self.once()
            self.results.append((s, dt))
            if self.owner:
                s, dt, _ = self.once(self.owner)
                self.direct.append((s, dt))
            self.stop.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(35)


def not_slowed(probe, base_p50, what):
    """Checks that the execs through the forwarding node during a stream
    were not slowed: all answered 200, their median is within 2x + 100 ms
    of the same execs straight to the owner at the same time (the machine's
    load slows both alike), within 4x or +500 ms of the median before, and
    none took 3 s (a request queued behind a stream would wait for all of
    it, 10+ s)."""
    via = [x[1] for x in probe.results]
    direct = [x[1] for x in probe.direct]
    print(
        f"      execs through C during the {what}: p50 {median(via) * 1000:.0f} ms, max {max(via) * 1000:.0f} ms "
        f"over {len(via)} (straight to the owner meanwhile: p50 {median(direct) * 1000:.0f} ms; "
        f"through C before: p50 {base_p50 * 1000:.0f} ms)",
        flush=True,
    )
    check(
        f"other execs through C are not slowed while it forwards the slow {what}",
        len(via) >= 3 and len(direct) >= 3 and all(x[0] == 200 for x in probe.results + probe.direct)
        and median(via) <= 2 * median(direct) + 0.1
        and median(via) <= max(4 * base_p50, base_p50 + 0.5) and max(via) < 3.0,
        f"before p50 {base_p50:.3f} s; through C {[round(x, 3) for x in via]}; "
        f"straight {[round(x, 3) for x in direct]}",
    )


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def sampled_peak(pid, stop, out):
    """Samples the RSS of pid every 50 ms into out["peak"] until stop."""
    while not stop.is_set():
        try:
            out["peak"] = max(out.get("peak", 0), memory_kib(pid)[0])
        except OSError:
            return
        stop.wait(0.05)


# The forwarding node's peak RSS may grow by at most this much while tens
# of MB pass through it to a slow reader: with back-pressure it holds a few
# buffers, not the stream.
RSS_GROWTH_LIMIT_KIB = 16 << 10


def back_pressure(a, b, c):
    """A client reads an exec stream, and then the SSE log of a sandbox
    that writes fast, slowly through C while the sandboxes are on B: C's
    memory stays bounded (its peak RSS, VmHWM reset before, grows by far
    less than what passes through), the output arrives complete and in
    order (the log: in order, every gap announced with its size), and
    execs through C meanwhile (on another sandbox of B during the exec
    stream, of A during the log) are not slowed (a request queued behind a
    stream would wait for all of it, 10+ s; the bound allows for a loaded
    2-core machine)."""
    print("== back-pressure through a forwarding node (slow readers through C, sandboxes on B)", flush=True)
    made = []
    try:
        # Output past limits.output_bytes (1 MiB by default) is cut: 64 MiB.
        big = {"node": "nb", "limits": {"output_bytes": 64 << 20}}
        # The exec stream's probes go to B too: the same owner as the
        # stream, so a forwarding connection held by a slow stream must not
        # hold them. The log's go to A: B runs the log's writer flat out.
        for body in (big, big, {"node": "nb"}, {"node": "na"}):
            s, _, x = create(a, a.key, body)
            if s != 201:
                check("the back-pressure test's sandboxes are created", False, f"{s} {x}")
                return
            made.append(x["id"])
        streamed, logged, probed, probed_a = made
        base = [Probe(c, a.key, probed).once() for _ in range(8)]
        base_a = [Probe(c, a.key, probed_a).once() for _ in range(8)]
        check("baseline execs through C answer 200", all(x[0] == 200 for x in base + base_a), base + base_a)
        base_p50 = median([x[1] for x in base])

        # 1. An exec stream: 6 million lines (47 MB of output, ~55 MB of
        # SSE) read at 4 MB/s through C.
        n = 6_000_000
        want = "".join(f"{i}\n" for i in range(1, n + 1))
        rss0, _ = memory_kib(c.proc.pid)
        owner0, _ = memory_kib(b.proc.pid)
        reset_peak(c.proc.pid)
        reset_peak(b.proc.pid)
        chunks, seen = [], {}
        mid_check = {}

        def on_exec(name, data, _comments):
            if name in ("stdout", "stderr") and data:
                chunks.append(json.loads(data)["chunk"])
            elif name in ("exit", "error"):
                seen[name] = json.loads(data) if data else None
                return True
            # Early on (4 MB of 53 read): the program is still held back.
            # Later is not a fair test: loopback TCP buffers on the two
            # hops (autotuned to several MB each on a quiet machine) hold a
            # good part of the stream, and then the program has finished.
            if not mid_check and reader.bytes > 4_000_000:
                s, _, r = run(a, a.key, streamed, "pgrep -x seq >/dev/null && echo running || echo done", timeout=15)
                mid_check["r"] = (s, (r or {}).get("stdout", "").strip())
            return False

        stop, peak = threading.Event(), {}
        sampler = threading.Thread(target=sampled_peak, args=(c.proc.pid, stop, peak), daemon=True)
        sampler.start()
        with Probe(c, a.key, probed, owner=b) as probe:
            conn, r = slow_stream(c, "POST", f"/v1/sandboxes/{streamed}/exec/stream", a.key,
                                  {"cmd": f"seq 1 {n}", "timeout_seconds": 300})
            try:
                reader = SlowSse(r, rate=4_000_000)
                ended = reader.run(on_exec, time.time() + 120)
            finally:
                conn.close()
        stop.set()
        sampler.join(5)
        rss1, hwm = memory_kib(c.proc.pid)
        _, owner_hwm = memory_kib(b.proc.pid)
        got = "".join(chunks)
        print(
            f"      exec stream: {reader.bytes / 1e6:.1f} MB of SSE in {reader.elapsed:.1f} s "
            f"({reader.bytes / 1e6 / max(reader.elapsed, 1e-9):.1f} MB/s, {reader.slept:.1f} s of it sleeping); "
            f"C (forwarding) RSS {rss0} KiB before, peak {hwm} KiB (sampled {peak.get('peak')}), {rss1} KiB after; "
            f"B (owner) RSS {owner0} KiB before, peak {owner_hwm} KiB",
            flush=True,
        )
        check(
            "a slowly read exec stream through C arrives complete and in order (6,000,000 lines, then exit 0)",
            ended and got == want and (seen.get("exit") or {}).get("exit_code") == 0,
            f"ended={ended} got {len(got)} of {len(want)} chars, first difference at "
            f"{next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))}; {seen}",
        )
        check(
            "the reader was the bottleneck (it slept most of the stream)",
            reader.slept > 0.5 * reader.elapsed,
            f"slept {reader.slept:.1f} of {reader.elapsed:.1f} s",
        )
        check(
            "the sandbox's program was held back by the slow reader (still running 4 MB in)",
            mid_check.get("r") == (200, "running"),
            mid_check,
        )
        check(
            f"C's peak RSS grew by less than {RSS_GROWTH_LIMIT_KIB >> 10} MiB while {reader.bytes >> 20} MiB passed through it",
            hwm - rss0 < RSS_GROWTH_LIMIT_KIB and reader.bytes > 3 * (RSS_GROWTH_LIMIT_KIB << 10),
            f"{rss0} -> peak {hwm} KiB",
        )
        not_slowed(probe, base_p50, "exec stream")

        # 2. SSE logs: C follows the log of a sandbox on B that writes
        # 30 MB (300,000 lines of 101 bytes) as fast as it can; the client
        # reads 4 MB/s. The log keeps 256 KiB: a follower that falls
        # behind is told how many bytes it missed.
        lines, width = 300_000, 100
        total = lines * (width + 1)
        rss0, _ = memory_kib(c.proc.pid)
        reset_peak(c.proc.pid)
        log = {"segments": [[]], "dropped": 0, "drops": 0, "bytes": 0, "bad": [], "tail_due": False}

        def on_log(name, data, comments):
            for cm in comments:
                if cm.endswith("bytes dropped"):
                    log["dropped"] += int(cm.split()[0])
                    log["drops"] += 1
                    log["segments"].append([])
                    log["tail_due"] = True
            if name == "line" and data:
                text = json.loads(data)["line"]
                log["bytes"] += len(text.encode())
                if log["drops"] and log["tail_due"]:
                    # The log resumes after a gap where the ring starts,
                    # mid-line: the first line may be any tail of one
                    # ("67\n", or only "\n").
                    log["tail_due"] = False
                    if not (text.endswith("\n") and text[:-1].isdigit() or text == "\n"):
                        log["bad"].append(text[:40])
                    return False
                try:
                    v = int(text)
                except ValueError:
                    log["bad"].append(text[:40])
                    return False
                log["segments"][-1].append(v)
                return v == lines
            return False

        stop, peak = threading.Event(), {}
        sampler = threading.Thread(target=sampled_peak, args=(c.proc.pid, stop, peak), daemon=True)
        sampler.start()
        writer = {}

        def write():
            # Straight to the owner, read at full speed.
            wr = urllib.request.Request(
                f"{b.url}/v1/sandboxes/{logged}/exec/stream",
                data=json.dumps({"cmd": f"seq -f '%0{width}.0f' 1 {lines}", "timeout_seconds": 300}).encode(),
                method="POST",
                headers={"Authorization": f"Bearer {a.key}", "Content-Type": "application/json"},
            )
            t = time.time()
            with urllib.request.urlopen(wr, timeout=60) as r:
                body = r.read()
            writer["s"] = time.time() - t
            writer["exit"] = b'"exit_code":0' in body

        base_p50 = median([x[1] for x in base_a])
        with Probe(c, a.key, probed_a, owner=a) as probe:
            conn, r = slow_stream(c, "GET", f"/v1/sandboxes/{logged}/logs?follow=1", a.key)
            try:
                reader = SlowSse(r, rate=4_000_000)
                wt = threading.Thread(target=write, daemon=True)
                wt.start()
                ended = reader.run(on_log, time.time() + 90)
            finally:
                conn.close()
            wt.join(60)
        stop.set()
        sampler.join(5)
        rss1, hwm = memory_kib(c.proc.pid)
        segs = log["segments"]
        # Within a segment (between gaps, the tail after a gap set apart),
        # consecutive numbers from 1; each segment starts past the last.
        in_order = segs[0][:1] == [1] and all(
            all(y == x + 1 for x, y in zip(seg, seg[1:])) for seg in segs
        )
        done = [seg for seg in segs if seg]
        rising = all(later[0] > earlier[-1] for earlier, later in zip(done, done[1:]))
        missing = total - log["bytes"] - log["dropped"]
        print(
            f"      log stream: {reader.bytes / 1e6:.1f} MB of SSE in {reader.elapsed:.1f} s, writer done in "
            f"{writer.get('s', float('nan')):.1f} s; {sum(len(x) for x in segs)} lines received, "
            f"{log['drops']} gaps announced ({log['dropped']} bytes), {missing} bytes unaccounted; "
            f"C RSS {rss0} KiB before, peak {hwm} KiB (sampled {peak.get('peak')}), {rss1} KiB after",
            flush=True,
        )
        check(
            "a slowly read SSE log through C arrives in order up to the last line, every gap announced with its size",
            ended and writer.get("exit") and in_order and rising and not log["bad"]
            # A gap may also swallow the partial line the follower held.
            and 0 <= missing <= log["drops"] * (width + 1),
            f"ended={ended} writer={writer} in_order={in_order} rising={rising} bad={log['bad'][:3]} "
            f"missing={missing} drops={log['drops']} last={segs[-1][-3:] if segs[-1] else None}",
        )
        check(
            f"C's peak RSS grew by less than {RSS_GROWTH_LIMIT_KIB >> 10} MiB while it forwarded the log "
            f"({reader.bytes >> 20} MiB of it)",
            hwm - rss0 < RSS_GROWTH_LIMIT_KIB,
            f"{rss0} -> peak {hwm} KiB",
        )
        not_slowed(probe, base_p50, "log")
    finally:
        for sid in made:
            http("DELETE", f"{a.url}/v1/sandboxes/{sid}", a.key)


def mcp_stdio(url, key, calls):
    """Runs `runcell mcp` against url and makes the tool calls; returns
    their results (or an error string)."""
    proc = subprocess.Popen(
        [RUNCELL, "mcp", "--url", url, "--api-key", key],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out = []
    try:
        def send(msg):
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()

        def answer(want_id):
            until = time.time() + 60
            while time.time() < until:
                line = proc.stdout.readline()
                if not line:
                    return {"error": "runcell mcp closed stdout: " + proc.stderr.read()[-500:]}
                m = json.loads(line)
                if m.get("id") == want_id:
                    return m
            return {"error": "no answer in 60 s"}

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "cluster-test", "version": "1"}}})
        answer(1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        for i, (name, args) in enumerate(calls, start=2):
            send({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": name, "arguments": args}})
            out.append(answer(i))
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return out


def mcp_http(url, key, calls):
    """The daemon's streamable-HTTP MCP endpoint (/mcp): initialize, then
    the tool calls; returns their results."""
    def post(msg, session=None):
        h = {
            "Authorization": f"Bearer {key}", "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        if session:
            h["Mcp-Session-Id"] = session
        req = urllib.request.Request(url + "/mcp", data=json.dumps(msg).encode(), method="POST", headers=h)
        with urllib.request.urlopen(req, timeout=60) as r:
            sid = r.headers.get("Mcp-Session-Id")
            if "id" not in msg:
                return sid, None
            if r.headers.get_content_type() == "application/json":
                return sid, json.loads(r.read())
            for line in r:  # SSE: the answer is a data: line
                line = line.decode().strip()
                if line.startswith("data:") and line[5:].strip():
                    m = json.loads(line[5:])
                    if m.get("id") == msg["id"]:
                        return sid, m
        return sid, None

    session, _ = post({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "cluster-test", "version": "1"}}})
    post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    out = []
    for i, (name, args) in enumerate(calls, start=2):
        out.append(post({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": name, "arguments": args}}, session)[1])
    return out


def tool_text(answer):
    r = (answer or {}).get("result") or {}
    return "".join(c.get("text", "") for c in r.get("content", []) if isinstance(c, dict)), r.get("isError")


def own_clients(root, a, b, c):
    """runcell's own clients pointed at node C do real work on a sandbox
    that node A owns: the CLI (exec, cp both ways, get, list, logs and
    logs -f over SSE), `runcell mcp` and the /mcp endpoint, the TypeScript
    SDK and the Mastra tool."""
    print("== runcell's own clients through a node that does not own the sandbox", flush=True)
    s, h, sb = create(a, a.key, {"node": "na", "metadata": {"suite": f"cluster-{RUN_ID}", "clients": "yes"}})
    if s != 201:
        check("a sandbox for the clients is created on A", False, f"{s} {sb}")
        return
    sid = sb["id"]
    conn = ["--url", c.url, "--api-key", a.key]

    def cli(*args, timeout=60, stdin=None):
        return subprocess.run([RUNCELL, *args], capture_output=True, text=True, timeout=timeout, input=stdin)

    try:
        p = cli("exec", *conn, sid, "--", "echo cli-ok from sandbox")
        check("runcell exec --url C on A's sandbox prints its output", p.returncode == 0 and "cli-ok from sandbox" in p.stdout, f"{p.returncode} {p.stdout!r} {p.stderr!r}")
        p = cli("exec", *conn, sid, "--", "exit 3")
        check("runcell exec --url C exits with the command's status", p.returncode == 3, f"{p.returncode} {p.stderr!r}")
        local = os.path.join(root, "cp-in.txt")
        with open(local, "w") as f:
            f.write("copied through C\n")
        p1 = cli("cp", *conn, local, f"{sid}:/tmp/cli.txt")
        back = os.path.join(root, "cp-out.txt")
        p2 = cli("cp", *conn, f"{sid}:/tmp/cli.txt", back)
        ok = p1.returncode == 0 and p2.returncode == 0 and os.path.exists(back) and open(back).read() == "copied through C\n"
        check("runcell cp --url C copies into and out of A's sandbox", ok, f"{p1.stderr!r} {p2.stderr!r}")
        s, _, r = run(a, a.key, sid, "cat /tmp/cli.txt")
        check("the file runcell cp wrote through C is in the sandbox on A", s == 200 and "copied through C" in (r or {}).get("stdout", ""), f"{s} {r}")
        p = cli("sandbox", "get", *conn, "--json", sid)
        check("runcell sandbox get --url C shows A's sandbox", p.returncode == 0 and sid in p.stdout, f"{p.returncode} {p.stdout[:300]!r} {p.stderr!r}")
        p = cli("sandbox", "ls", *conn, "--json", "--meta", "clients=yes")
        check("runcell sandbox list --url C lists A's sandbox", p.returncode == 0 and sid in p.stdout, f"{p.returncode} {p.stdout[:300]!r} {p.stderr!r}")
        p = cli("logs", *conn, sid)
        check("runcell logs --url C shows the output of A's sandbox", p.returncode == 0 and "cli-ok from sandbox" in p.stdout, f"{p.returncode} {p.stdout[-300:]!r} {p.stderr!r}")
        # logs -f: the SSE stream through C carries a line written later through A.
        follow = subprocess.Popen([RUNCELL, "logs", "-f", *conn, sid], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = {}

        def reader():
            for line in follow.stdout:
                if "followed-line" in line:
                    seen["at"] = time.time()
                    return

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        time.sleep(1.0)
        t0 = time.time()
        run(a, a.key, sid, "echo followed-line")
        th.join(10)
        follow.kill()
        follow.wait(5)
        check(
            "runcell logs -f --url C streams (SSE through the forwarding node) a line written later through A",
            "at" in seen and seen["at"] - t0 < 5,
            seen,
        )

        # MCP: runcell mcp (stdio) pointed at C, and C's /mcp endpoint.
        res = mcp_stdio(c.url, a.key, [
            ("exec", {"sandbox_id": sid, "command": "echo mcp-stdio-ok; cat /tmp/cli.txt"}),
            ("write_file", {"sandbox_id": sid, "path": "/tmp/mcp.txt", "content": "from mcp"}),
            ("read_file", {"sandbox_id": sid, "path": "/tmp/mcp.txt"}),
        ])
        texts = [tool_text(r) for r in res]
        check(
            "runcell mcp --url C: exec, write_file and read_file on A's sandbox",
            len(texts) == 3 and "mcp-stdio-ok" in texts[0][0] and "copied through C" in texts[0][0]
            and not any(t[1] for t in texts) and "from mcp" in texts[2][0],
            res,
        )
        try:
            res = mcp_http(c.url, a.key, [
                ("exec", {"sandbox_id": sid, "command": "echo mcp-http-ok; cat /tmp/mcp.txt"}),
                ("list_sandboxes", {"all": True}),
            ])
            texts = [tool_text(r) for r in res]
            ok = len(texts) == 2 and "mcp-http-ok" in texts[0][0] and "from mcp" in texts[0][0] and sid in texts[1][0] and not texts[0][1]
        except (OSError, ValueError) as e:
            ok, res = False, repr(e)
        check("C's /mcp endpoint: exec and list_sandboxes reach A's sandbox", ok, res)

        # The TypeScript SDK and the Mastra tool, on Node 22.
        node22 = os.environ.get("RUNCELL_TEST_NODE22")
        if not node22 or not os.access(node22, os.X_OK):
            check("Node 22 for the SDK and Mastra checks (scripts/test-cluster.sh sets RUNCELL_TEST_NODE22)", False, node22)
            return
        env = dict(os.environ, RUNCELL_URL=c.url, RUNCELL_API_KEY=a.key, SID=sid, REPO=REPO,
                   NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        p = subprocess.run([node22, os.path.join(REPO, "tests", "cluster", "ts_sdk.mjs")], env=env,
                           capture_output=True, text=True, timeout=120)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            r = {}
        check(
            "the TypeScript SDK through C: connect, exec, streamed exec, files, runCode and list on A's sandbox",
            p.returncode == 0 and r.get("exec") == "ts-ok\n" and r.get("streamed") == ["one\n", "two\n"]
            and r.get("file") == "from ts" and r.get("code") == "42" and r.get("listed") is True,
            f"{p.returncode} {p.stdout[-600:]!r} {p.stderr[-600:]!r}",
        )
        # The Mastra tool (per-thread mode) through C finds the thread's
        # sandbox on A by its metadata (the list comes from etcd) and runs there.
        thread = f"cluster-thread-{RUN_ID}"
        s, _, mine = create(a, a.key, {"node": "na", "template": "code-interpreter", "metadata": {
            "suite": f"cluster-{RUN_ID}", "tool": "runcell-mastra", "mode": "per-thread", "threadId": thread}})
        if s != 201:
            check("a Mastra thread sandbox is created on A", False, f"{s} {mine}")
            return
        env["THREAD"] = thread
        p = subprocess.run([node22, os.path.join(REPO, "tests", "cluster", "mastra_tool.mjs")], env=env,
                           capture_output=True, text=True, timeout=180)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            r = {}
        check(
            "the Mastra tool through C runs the thread's code in its sandbox on A, state kept between calls",
            p.returncode == 0 and r.get("sandboxes") == [mine["id"], mine["id"]] and "42" in r.get("second", ""),
            f"{p.returncode} {p.stdout[-800:]!r} {p.stderr[-800:]!r}",
        )
        http("DELETE", f"{a.url}/v1/sandboxes/{mine['id']}", a.key)
    finally:
        http("DELETE", f"{a.url}/v1/sandboxes/{sid}", a.key)


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
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, timeout=900, cwd=REPO)
        print(f"      ({what} through {node.name}: {time.time() - t0:.0f} s)", flush=True)
        check(name, p.returncode == 0, f"exit {p.returncode}")
    except subprocess.TimeoutExpired:
        check(name, False, "timed out after 900 s")


if __name__ == "__main__":
    main()
