"""Drives a running runcell daemon through the published PandaStack Python SDK
(``pandastack``, pinned in requirements.txt), unchanged.

Needs PANDASTACK_API (a loopback URL, e.g. http://127.0.0.1:PORT) and
PANDASTACK_API_KEY in the environment; scripts/test-clients.sh starts the
daemon and sets both. Run with the venv's interpreter:

    tests/clients/.venv/bin/python -m pytest tests/clients/test_pandastack_py.py

Wire contract: shared/pandastack-api.md. SDK facts these tests rely on:

- ``Sandbox.create/list/get`` are classmethods on a module-level default
  ``Client()`` built from the environment on first use; a client with another
  key is ``Client(api_key=...)`` and its ``.sandboxes.create/list/get``.
- ``Sandbox.create(template="code-interpreter", ...)`` by default;
  ``run_code(code, language="python")`` runs ``python3 -c <code>``.
- ``exec`` returns a frozen ``ExecResult(stdout, stderr, exit_code,
  duration_ms)``; ``exec_stream`` returns the exit code as an int.
- ``filesystem.read`` returns bytes; ``listdir`` (not ``list``) and ``stat``
  return ``FileInfo``; ``exists`` is stat + NotFoundError -> False.
- Exceptions live in ``pandastack`` (and ``pandastack.exceptions``): AuthError
  (401 only; 403 is BadRequestError), NotFoundError, BadRequestError,
  ServerError, SandboxTimeout, CommandFailed, ExecInterrupted. The base class
  is ``PandastackError`` (lower-case s, unlike the TS ``PandaStackError``).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from urllib.parse import urlparse

import pytest
import requests

import pandastack
from pandastack import (
    AuthError,
    BadRequestError,
    Client,
    CommandFailed,
    NotFoundError,
    PandastackError,
    Sandbox,
    SandboxTimeout,
    ServerError,
)

API = os.environ.get("PANDASTACK_API")
KEY = os.environ.get("PANDASTACK_API_KEY")
if not API or not KEY:
    raise RuntimeError(
        "PANDASTACK_API and PANDASTACK_API_KEY must be set to a running runcell daemon "
        "(scripts/test-clients.sh does this); refusing to run without them"
    )
# Never let a misconfigured environment send these tests to a real service.
_host = urlparse(API).hostname or ""
if not (re.fullmatch(r"127\.\d+\.\d+\.\d+", _host) or _host in ("localhost", "::1")):
    raise RuntimeError(f"PANDASTACK_API must point at loopback, got {API}")
ORIGIN = re.sub(r"/v1$", "", API.rstrip("/"))

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)
UNKNOWN_ID = "00000000-0000-4000-8000-000000000000"


def test_sdk_version_is_pinned():
    assert pandastack.__version__ == "0.10.0"


# --------------------------------------------------------------------- helpers


def _kill_quietly(sb: Sandbox) -> None:
    try:
        sb.kill()
    except NotFoundError:
        pass


@pytest.fixture
def make_sandbox():
    """Creates sandboxes through the SDK and deletes them when the test ends."""
    made: list[Sandbox] = []

    def make(**kwargs) -> Sandbox:
        kwargs.setdefault("template", "host")
        sb = Sandbox.create(**kwargs)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        _kill_quietly(sb)


@pytest.fixture
def sandbox(make_sandbox) -> Sandbox:
    return make_sandbox()


def raw(method: str, path: str, *, key: str | None = KEY, **kwargs) -> requests.Response:
    """Plain HTTP to the daemon, for runcell extensions and wire-level checks."""
    headers = dict(kwargs.pop("headers", {}) or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return requests.request(method, f"{ORIGIN}{path}", headers=headers, timeout=30, **kwargs)


def assert_json_error(r: requests.Response, status: int) -> None:
    assert r.status_code == status, f"expected HTTP {status}, got {r.status_code}: {r.text}"
    assert "application/json" in r.headers.get("content-type", ""), r.headers.get("content-type")
    body = r.json()
    assert isinstance(body.get("error"), str) and body["error"], f'error body needs a string "error": {r.text}'


# --------------------------------------------------------------------- service


def test_healthz_without_auth():
    assert raw("GET", "/healthz", key=None).status_code == 200


# --------------------------------------------------------------------- create


def test_create_host_with_ttl_and_metadata(make_sandbox):
    sb = make_sandbox(template="host", ttl_seconds=600, metadata={"suite": "py-sdk", "case": "create"})
    assert UUID_RE.match(sb.id)
    assert sb.template == "host"
    assert sb.status == "running"
    assert isinstance(sb.cpu, int) and isinstance(sb.memory_mb, int)
    # The server may add keys (PandaStack stamps "workspace"); ours must be there.
    assert sb.metadata.get("suite") == "py-sdk"
    assert sb.metadata.get("case") == "create"
    assert sb.persistent is False
    life = sb.lifecycle()
    assert life["ttl_seconds"] == 600
    assert life["persistent"] is False
    assert sb.exec("echo ready").stdout == "ready\n"


def test_create_default_template_is_code_interpreter_alias():
    sb = Sandbox.create()  # the SDK default: template="code-interpreter"
    try:
        assert UUID_RE.match(sb.id)
        assert sb.status == "running"
        # The alias resolves to host; echoing either name is the daemon's choice.
        assert sb.template in ("code-interpreter", "host")
        r = sb.exec("python3 -c 'print(1+1)'")
        assert (r.stdout, r.exit_code) == ("2\n", 0)
    finally:
        _kill_quietly(sb)


def test_create_ubuntu_alias(make_sandbox):
    sb = make_sandbox(template="ubuntu-24.04")  # the TS SDK's default
    assert UUID_RE.match(sb.id)
    assert sb.template in ("ubuntu-24.04", "host")


def test_create_persistent(make_sandbox):
    sb = make_sandbox(template="host", persistent=True)
    assert sb.persistent is True
    assert sb.lifecycle()["persistent"] is True


def test_unknown_template_is_bad_request_naming_installed_templates():
    with pytest.raises(BadRequestError) as info:
        Sandbox.create(template="no-such-template-xyz")
    assert re.search(r"\bhost\b", str(info.value)), f"message should list installed templates: {info.value}"


# --------------------------------------------------------------------- exec


def test_run_code_python_prints_42(sandbox):
    r = sandbox.run_code("x = 6 * 7\nprint(x)")
    assert r.stdout == "42\n"
    assert r.stderr == ""
    assert r.exit_code == 0
    # Quotes in the code survive the SDK's shlex quoting.
    assert sandbox.run_code("print(\"it's\", 'ok')", language="python").stdout == "it's ok\n"
    assert sandbox.run_code("echo $((6 * 7))", language="bash").stdout == "42\n"
    assert sandbox.exec("node -e 'console.log(6 * 7)'").stdout == "42\n"


def test_exec_stdout_stderr_exit_code(sandbox):
    r = sandbox.exec("echo out; echo err >&2; exit 3")
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert r.exit_code == 3  # not an exception

    assert sandbox.exec("true").exit_code == 0
    # Runs through a shell.
    assert sandbox.exec("printf 'b\\na\\n' | sort | tr -d '\\n'; X=5; echo \" $X\"").stdout == "ab 5\n"
    assert sandbox.exec("echo 'héllo ✓'").stdout == "héllo ✓\n"

    with pytest.raises(CommandFailed) as info:
        sandbox.exec("echo partial; exit 7", check=True)
    assert info.value.exit_code == 7
    assert info.value.stdout == "partial\n"

    assert sandbox.commands.run("echo via-commands").stdout == "via-commands\n"


def test_sandbox_basics(sandbox):
    r = sandbox.exec("touch /home/user/w && touch /tmp/w && echo ok && command -v python3 bash node >/dev/null && echo tools")
    assert (r.stdout, r.exit_code) == ("ok\ntools\n", 0), r.stderr


def test_exec_timeout_raises_sandbox_timeout_and_kills(sandbox):
    started = time.monotonic()
    with pytest.raises(SandboxTimeout) as info:
        sandbox.exec("sleep 5; touch /tmp/late", timeout_seconds=1)
    elapsed = time.monotonic() - started
    assert str(info.value).startswith("command timed out: ")
    assert isinstance(info.value.__cause__, ServerError)
    assert elapsed < 4.5, f"timeout took {elapsed:.1f} s; the daemon should stop at about 1 s"
    # Still usable, and the timed-out command's process group is gone.
    time.sleep(max(0.0, 6.0 - (time.monotonic() - started)))
    assert sandbox.exec("test -e /tmp/late && echo late || echo killed").stdout == "killed\n"


# --------------------------------------------------------------------- exec_stream


def test_exec_stream_callbacks_and_exit_code(sandbox):
    out: list[str] = []
    err: list[str] = []
    code = sandbox.exec_stream(
        "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo 'oops ✓' >&2; exit 3",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert code == 3
    assert out, "on_stdout was never called"
    assert "".join(out) == "line1\nline2\nline3\n"
    # Non-ASCII survives: requests decodes text/event-stream as ISO-8859-1
    # unless the daemon sends charset=utf-8 (or \u-escapes the JSON).
    assert "".join(err) == "oops ✓\n"


def test_exec_stream_zero_exit(sandbox):
    chunks: list[str] = []
    assert sandbox.exec_stream("python3 -c 'print(6*7)'", on_stdout=chunks.append) == 0
    assert "".join(chunks) == "42\n"


def test_exec_stream_timeout_raises_sandbox_timeout(sandbox):
    started = time.monotonic()
    with pytest.raises(SandboxTimeout):
        sandbox.exec_stream("echo before; sleep 20", timeout_seconds=1)
    assert time.monotonic() - started < 10


# --------------------------------------------------------------------- filesystem


def test_filesystem_write_read_listdir_stat_exists(sandbox):
    fs = sandbox.filesystem
    d = "/home/user/proj"
    path = f"{d}/sub/hello.txt"
    content = "hello from the Python SDK ✓\nline 2\n"
    data = content.encode()

    w = fs.write(path, content)  # str is UTF-8 encoded by the SDK
    assert (w["path"], w["bytes"]) == (path, len(data))

    got = fs.read(path)
    assert isinstance(got, bytes)
    assert got == data
    assert sandbox.exec(f"cat {path}").stdout == content
    sandbox.exec(f"echo made-by-exec > {d}/from-exec.txt")
    assert fs.read(f"{d}/from-exec.txt") == b"made-by-exec\n"

    fs.write(path, b"short")
    assert fs.read(path) == b"short"
    fs.write(path, data)

    entries = fs.listdir(f"{d}/sub")
    hello = next((e for e in entries if e.name == "hello.txt"), None)
    assert hello is not None, entries
    assert hello.is_dir is False
    assert hello.size == len(data)
    assert hello.path == path
    assert hello.mtime > 1_600_000_000

    top = fs.listdir(d)
    assert sorted(e.name for e in top) == ["from-exec.txt", "sub"]
    assert next(e for e in top if e.name == "sub").is_dir is True

    st = fs.stat(path)
    assert (st.name, st.path, st.is_dir, st.size) == ("hello.txt", path, False, len(data))
    assert fs.stat(f"{d}/sub").is_dir is True

    assert fs.exists(path) is True
    assert fs.exists(f"{d}/sub") is True
    assert fs.exists(f"{d}/missing.txt") is False
    assert fs.exists("/no/such/dir/at/all") is False

    sandbox.exec(f"mkdir -p {d}/empty")
    assert fs.listdir(f"{d}/empty") == []

    fs.write("/tmp/t.txt", b"tmp")
    assert fs.read("/tmp/t.txt") == b"tmp"


def test_filesystem_binary_round_trip(sandbox):
    blob = bytes(range(256)) * 4 + b"\x00\xff\r\n"
    w = sandbox.filesystem.write("/home/user/bin.dat", blob)
    assert w["bytes"] == len(blob)
    assert sandbox.filesystem.read("/home/user/bin.dat") == blob
    assert sandbox.filesystem.stat("/home/user/bin.dat").size == len(blob)


def test_filesystem_errors(sandbox):
    with pytest.raises(NotFoundError):
        sandbox.filesystem.read("/home/user/does-not-exist.txt")
    with pytest.raises(NotFoundError):
        sandbox.filesystem.stat("/home/user/does-not-exist.txt")
    with pytest.raises(BadRequestError):
        sandbox.filesystem.read("relative/path.txt")
    with pytest.raises(BadRequestError):
        sandbox.filesystem.write("relative.txt", b"x")


# --------------------------------------------------------------------- get / list


def test_get_and_list(make_sandbox):
    sb = make_sandbox(template="host", metadata={"suite": "py-sdk", "case": "get-list"})
    got = Sandbox.get(sb.id)
    assert got.id == sb.id
    assert got.template == sb.template
    assert got.status == "running"
    assert got.metadata.get("case") == "get-list"
    assert got.exec("echo via-get").stdout == "via-get\n"

    all_ = Sandbox.list()
    assert isinstance(all_, list)
    mine = [s for s in all_ if s.id == sb.id]
    assert len(mine) == 1, f"created sandbox {sb.id} missing from list"
    assert isinstance(mine[0], Sandbox)
    assert mine[0].status == "running"
    assert mine[0].metadata.get("case") == "get-list"

    assert sb.refresh() is sb
    assert sb.status == "running"


def test_get_unknown_id_is_not_found():
    with pytest.raises(NotFoundError):
        Sandbox.get(UNKNOWN_ID)


# --------------------------------------------------------------------- lifecycle


def test_lifecycle_and_set_ttl(make_sandbox):
    sb = make_sandbox(template="host", ttl_seconds=600)
    before = sb.lifecycle()
    assert before["ttl_seconds"] == 600
    assert before["persistent"] is False
    assert isinstance(before["idle_seconds"], int) and before["idle_seconds"] >= 0

    updated = sb.set_ttl(900)
    assert updated["ttl_seconds"] == 900
    assert updated["persistent"] is False
    assert sb.lifecycle()["ttl_seconds"] == 900

    p = sb.set_persistent(True)
    assert p["persistent"] is True and p["ttl_seconds"] == 900
    assert sb.persistent is True
    assert sb.lifecycle()["persistent"] is True
    assert sb.set_persistent(False)["persistent"] is False

    with pytest.raises(BadRequestError):
        sb.set_ttl(-1)


# --------------------------------------------------------------------- delete


def test_kill_then_get_is_not_found(make_sandbox):
    sb = make_sandbox()
    sb.kill()
    with pytest.raises(NotFoundError):
        Sandbox.get(sb.id)
    assert sb.id not in [s.id for s in Sandbox.list()]
    with pytest.raises(NotFoundError):
        sb.exec("true")
    with pytest.raises(NotFoundError):
        sb.kill()


def test_context_manager_kills_non_persistent_sandbox():
    with Sandbox.create(template="host") as sb:
        sandbox_id = sb.id
        assert sb.exec("echo inside").stdout == "inside\n"
    with pytest.raises(NotFoundError):
        Sandbox.get(sandbox_id)


# --------------------------------------------------------------------- auth


def test_wrong_api_key_is_auth_error(sandbox):
    bad = Client(api_key="pds_definitely-not-the-key")
    assert bad.api_url == API.rstrip("/")
    with pytest.raises(AuthError):
        bad.sandboxes.list()
    with pytest.raises(AuthError):
        bad.sandboxes.create(template="host")
    # A real sandbox is not reachable with a wrong key either (401, not 404).
    with pytest.raises(AuthError):
        bad.sandboxes.get(sandbox.id)


def test_missing_api_key():
    # The Python SDK refuses locally, before sending anything...
    with pytest.raises(AuthError):
        Client(api_key="").sandboxes.list()
    # ...so check the daemon's side over plain HTTP.
    assert_json_error(raw("GET", "/v1/sandboxes", key=None), 401)


# --------------------------------------------------------------------- wire level


def test_wire_error_bodies():
    assert_json_error(raw("GET", "/v1/sandboxes", key="wrong"), 401)
    assert_json_error(raw("GET", f"/v1/sandboxes/{UNKNOWN_ID}"), 404)
    assert_json_error(raw("POST", "/v1/sandboxes", json={"template": "no-such-template-xyz"}), 400)


def test_wire_list_metadata_filter(make_sandbox):
    """metadata.KEY=VALUE query filters on GET /v1/sandboxes (runcell extension)."""
    tag = f"py-{uuid.uuid4().hex[:12]}"
    a = make_sandbox(metadata={"filtertag": tag, "role": "a"})
    b = make_sandbox(metadata={"filtertag": tag, "role": "b"})
    other = make_sandbox(metadata={"filtertag": f"{tag}-other"})

    r = raw("GET", "/v1/sandboxes")
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list), f"list must be a bare array: {r.text[:200]}"
    ids = {s["id"] for s in body}
    assert {a.id, b.id, other.id} <= ids

    by_tag = raw("GET", "/v1/sandboxes", params={"metadata.filtertag": tag}).json()
    assert sorted(s["id"] for s in by_tag) == sorted([a.id, b.id])
    # Several filters must all match.
    both = raw("GET", "/v1/sandboxes", params={"metadata.filtertag": tag, "metadata.role": "b"}).json()
    assert [s["id"] for s in both] == [b.id]
    none = raw("GET", "/v1/sandboxes", params={"metadata.filtertag": f"{tag}-nobody"})
    assert none.status_code == 200
    assert none.json() == []


def test_sdk_error_classes():
    for cls in (AuthError, NotFoundError, BadRequestError, ServerError, SandboxTimeout, CommandFailed):
        assert issubclass(cls, PandastackError), cls
