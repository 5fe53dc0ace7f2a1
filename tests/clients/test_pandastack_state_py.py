"""Sandboxes that outlive their processes (issue 14), driven through the
published PandaStack Python SDK (``pandastack`` 0.10.0), unchanged: pause and
resume, snapshots (``client.snapshots``, ``create(from_snapshot=...)``),
``fork``, ``fork_tree``, ``promote`` and ``explore`` over copy-on-write
forks, hibernate and wake, and volumes (``client.volumes``).

Needs PANDASTACK_API(_KEY) of a running daemon with the namespace jail
(scripts/test-clients.sh).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from urllib.parse import urlparse

import pytest

import pandastack
from pandastack import BadRequestError, Client, NotFoundError, Sandbox

API = os.environ.get("PANDASTACK_API")
KEY = os.environ.get("PANDASTACK_API_KEY")
if not API or not KEY:
    raise RuntimeError("PANDASTACK_API and PANDASTACK_API_KEY must be set (scripts/test-clients.sh)")
_host = urlparse(API).hostname or ""
if not (re.fullmatch(r"127\.\d+\.\d+\.\d+", _host) or _host in ("localhost", "::1")):
    raise RuntimeError(f"PANDASTACK_API must point at loopback, got {API}")

client = Client()


@pytest.fixture
def made():
    sandboxes: list[Sandbox] = []
    yield sandboxes
    for sb in sandboxes:
        try:
            sb.kill()
        except NotFoundError:
            pass


def new(made, **kw) -> Sandbox:
    kw.setdefault("template", "host")
    sb = Sandbox.create(**kw)
    made.append(sb)
    return sb


def out(sb: Sandbox, cmd: str) -> str:
    r = sb.exec(cmd)
    assert r.exit_code == 0, f"{cmd}: {r.stderr}"
    return r.stdout


def test_pause_refuses_work_and_resume_carries_on(made):
    sb = new(made)
    sb.pause()
    assert client.sandboxes.get(sb.id).status == "paused"
    with pytest.raises(BadRequestError) as e:
        sb.exec("echo hi")
    assert "paused" in str(e.value)
    sb.resume()
    assert out(sb, "echo hi") == "hi\n"


def test_snapshot_and_create_from_it(made):
    sb = new(made)
    out(sb, "echo v1 > ~/state")
    snap_id = sb.snapshot()
    assert snap_id.startswith("snap-")
    out(sb, "echo v2 > ~/state")
    listed = client.snapshots.list(sandbox_id=sb.id)
    assert [s["id"] for s in listed] == [snap_id]
    assert client.snapshots.get(snap_id)["memory"] is False
    restored = new(made, from_snapshot=snap_id)
    assert out(restored, "cat ~/state") == "v1\n"
    client.snapshots.delete(snap_id)
    with pytest.raises(NotFoundError):
        client.snapshots.get(snap_id)


def test_fork_tree_promote_and_explore(made):
    parent = new(made)
    out(parent, "echo base > ~/f")
    child = parent.fork(metadata={"branch": "x"})
    made.append(child)
    assert out(child, "cat ~/f") == "base\n"
    kids = parent.fork_tree(count=2)
    made.extend(kids)
    assert len(kids) == 2
    res = kids[0].promote(cleanup_siblings=True)
    assert res["winner"] == kids[0].id and res["deleted"] == [kids[1].id]

    result = parent.explore(
        ["exit 1", "cat ~/f && echo PASS"],
        score_fn=lambda sb, o: 1.0 if o.ok and "PASS" in o.stdout_tail else 0.0,
    )
    assert result.winner is not None, result.errors
    made.append(result.winner)
    assert result.winner_outcome.label == "cat ~/f && echo PASS"
    assert len(result.reaped) == 1
    with pytest.raises(NotFoundError):
        client.sandboxes.get(result.reaped[0])


def test_hibernate_and_wake_keep_files(made):
    sb = new(made, persistent=True)
    out(sb, "echo kept > ~/k")
    sb.hibernate()
    assert client.sandboxes.get(sb.id).status == "hibernated"
    sb.wake()
    assert client.sandboxes.get(sb.id).status == "running"
    assert out(sb, "cat ~/k") == "kept\n"
    sb.hibernate()
    # A workload call wakes it transparently.
    assert out(sb, "cat ~/k") == "kept\n"


def test_volume_survives_its_sandbox(made):
    name = f"py-{uuid.uuid4().hex[:12]}"
    vol = client.volumes.create(name, 32)
    assert vol["name"] == name and vol["size_mb"] == 32
    try:
        a = new(made, volumes=[{"name": name, "read_only": False}])
        out(a, f"echo from-python > /mnt/{name}/f")
        a.kill()
        b = new(made, volumes=[{"name": name, "read_only": True}])
        assert out(b, f"cat /mnt/{name}/f") == "from-python\n"
        assert any(v["name"] == name for v in client.volumes.list())
        b.kill()
    finally:
        client.volumes.delete(name)
    with pytest.raises(NotFoundError):
        client.volumes.get(name)
