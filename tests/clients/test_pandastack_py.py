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

import base64
import os
import re
import struct
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
    CodeContext,
    CommandFailed,
    Execution,
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


def png_size(b64: str | None) -> tuple[int, int]:
    """(width, height) from a base64 PNG's IHDR chunk, after checking the signature."""
    assert isinstance(b64, str), "no PNG"
    data = base64.b64decode(b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR", "the first PNG chunk must be IHDR"
    return struct.unpack(">II", data[16:24])


def list_sessions(sandbox_id: str) -> list[dict]:
    """The sessions the daemon lists for a sandbox (neither SDK reads this route)."""
    r = raw("GET", f"/v1/sandboxes/{sandbox_id}/repl/sessions")
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list), r.text
    return body


@pytest.fixture
def make_context():
    """Creates code contexts through the SDK and closes them when the test ends."""
    made: list[CodeContext] = []

    def make(sb: Sandbox, *args) -> CodeContext:
        ctx = sb.create_code_context(*args)
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()  # swallows errors, e.g. after the sandbox was killed


# --------------------------------------------------------------------- service


def test_healthz_without_auth():
    assert raw("GET", "/healthz", key=None).status_code == 200


# --------------------------------------------------------------------- code contexts, first sandboxes


def test_context_timeouts_in_the_first_sandboxes_keep_state(make_sandbox, make_context):
    """First sandbox-creating test of the file on purpose: the daemon prepares
    standby sandboxes (2 by default) before it installs its own SIGINT
    handler, so the first sandboxes handed out are the ones a start-up bug
    would affect (for example an interpreter that inherited an ignored SIGINT
    and so can only be killed, not interrupted, when a cell times out).
    3 > the pool."""
    sandboxes = [make_sandbox() for _ in range(3)]
    for i, sb in enumerate(sandboxes):
        ctx = make_context(sb)
        ctx.run_code(f"n = {40 + i}")
        with pytest.raises(SandboxTimeout):
            ctx.run_code("while True: n += 0", timeout_seconds=1)
        after = ctx.run_code("n + 2")
        assert after.error is None, f"sandbox {i} ({sb.id}) lost its state on a timeout: {after.error}"
        assert after.text == str(42 + i), f"sandbox {i} ({sb.id})"


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


# --------------------------------------------------------------------- code contexts


def test_context_state_persists_and_last_expression_is_text(sandbox, make_context):
    ctx = make_context(sandbox)
    assert isinstance(ctx, CodeContext)
    assert re.fullmatch(r"[0-9a-f]{16}", ctx.id), ctx.id
    assert ctx.language == "python"

    # Statements only: no result, no output, no error.
    first = ctx.run_code("x = 6 * 7\nimport math\ndef double(v):\n    return 2 * v")
    assert isinstance(first, Execution)
    assert first.results == []
    assert first.text is None
    assert (first.stdout, first.stderr, first.exit_code, first.error) == ("", "", 0, None)

    # Variables, imports and functions from the earlier cell are all there.
    second = ctx.run_code("print('x is', x)\nimport sys; print('warn', file=sys.stderr)\ndouble(x) + int(math.sqrt(16))")
    assert second.stdout == "x is 42\n"
    assert second.stderr == "warn\n"
    assert second.logs == {"stdout": "x is 42\n", "stderr": "warn\n"}
    assert second.exit_code == 0
    assert len(second.results) == 1, second.results
    assert second.results[0].text == "88"
    assert second.results[0].data == {"text/plain": "88"}
    assert second.text == "88"

    ctx.run_code("x += 1")
    assert ctx.run_code("x").text == "43"
    assert ctx.run_code("None").results == []
    assert ctx.run_code("'it' + \"'s\"").text == '"it\'s"'

    # The context runs in the sandbox: files it writes are visible to the API.
    ctx.run_code("open('/home/user/from-ctx.txt', 'w').write('written by a context ' + str(x))")
    assert sandbox.filesystem.read("/home/user/from-ctx.txt") == b"written by a context 43"

    # A second context ("PY" is lower-cased and aliased to python) has its own state.
    other = make_context(sandbox, "PY")
    assert other.language == "python"
    assert other.id != ctx.id
    assert other.run_code("'x' in globals()").text == "False"
    assert ctx.run_code("'x' in globals()").text == "True"


def test_context_dataframe_is_html_and_display_adds_results(sandbox, make_context):
    ctx = make_context(sandbox)
    ctx.run_code("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    ex = ctx.run_code("df")
    assert ex.error is None, ex.error
    assert len(ex.results) == 1, ex.results
    r = ex.results[0]
    assert isinstance(r.html, str), f"no text/html: {list(r.data)}"
    assert re.search(r'<table[^>]*class="dataframe"', r.html)
    assert re.search(r"<th>a</th>\s*<th>b</th>", r.html)
    assert re.search(r"<td>1</td>\s*<td>x</td>", r.html)
    assert re.search(r"<td>2</td>\s*<td>y</td>", r.html)
    assert r.text == "   a  b\n0  1  x\n1  2  y"
    assert ex.text == r.text

    # display() shows a value mid-cell, in order, before the last expression.
    shown = ctx.run_code("print('before')\ndisplay(df[df.a > 1])\nprint('after')\nlen(df)")
    assert shown.stdout == "before\nafter\n"
    assert len(shown.results) == 2, shown.results
    assert re.search(r"<td>2</td>\s*<td>y</td>", shown.results[0].html or "")
    assert "<td>x</td>" not in (shown.results[0].html or "")
    assert shown.results[1].text == "2"
    assert shown.results[1].html is None


def test_context_matplotlib_figures_are_pngs_of_the_figure_size(sandbox, make_context):
    ctx = make_context(sandbox)
    ex = ctx.run_code("import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(4, 3), dpi=100)\n_ = plt.plot([1, 2, 3], [1, 4, 9])")
    assert ex.error is None, ex.error
    assert ex.exit_code == 0
    pngs = [r for r in ex.results if r.png is not None]
    assert len(pngs) == 1, [list(r.data) for r in ex.results]
    assert ex.png == pngs[0].png
    assert pngs[0].chart == pngs[0].png
    assert png_size(ex.png) == (400, 300)

    # The figure was closed once sent: the next cell has no PNG.
    nxt = ctx.run_code("len(plt.get_fignums())")
    assert nxt.text == "0"
    assert nxt.png is None

    # Two figures in one cell (one through plt.show()) come back in order.
    two = ctx.run_code(
        "plt.figure(figsize=(2, 1), dpi=50)\nplt.bar(['a', 'b'], [3, 5])\nplt.show()\n"
        "plt.figure(figsize=(3, 2), dpi=80)\n_ = plt.scatter([1, 2], [2, 1])"
    )
    assert [png_size(r.png) for r in two.results if r.png is not None] == [(100, 50), (240, 160)]


def test_context_exception_traceback_names_the_users_lines(sandbox, make_context):
    ctx = make_context(sandbox)
    ctx.run_code("def ratio(a, b):\n    return a / b")
    ex = ctx.run_code("before = 'ran'\nratio(1, 0)\nafter = 'ran too'")
    assert ex.exit_code == 1
    assert isinstance(ex.error, str), "no error on an exception"
    assert ex.error.startswith("Traceback (most recent call last):")
    assert re.search(r"line 2, in <module>\n\s+ratio\(1, 0\)", ex.error), ex.error
    assert re.search(r"line 2, in ratio\n\s+return a / b", ex.error), ex.error
    assert re.search(r"ZeroDivisionError: division by zero\n?$", ex.error), ex.error
    # The runcell driver's own frames are not shown.
    assert not re.search(r"python\.py|runcell", ex.error), ex.error
    assert "ZeroDivisionError: division by zero" in ex.stderr
    assert ex.results == []

    # Statements before the failing line ran, the ones after did not, and the
    # context keeps working.
    nxt = ctx.run_code("(before, 'after' in globals())")
    assert nxt.error is None
    assert nxt.text == "('ran', False)"

    # A syntax error is reported the same way; nothing in the cell runs.
    syntax = ctx.run_code("y = 1\nif True print(y)")
    assert syntax.exit_code == 1
    assert "SyntaxError" in (syntax.error or "")
    assert ctx.run_code("'y' in globals()").text == "False"


def test_context_timeout_raises_sandbox_timeout_and_keeps_state(sandbox, make_context):
    ctx = make_context(sandbox)
    ctx.run_code("total = 41\nimport time")
    started = time.monotonic()
    with pytest.raises(SandboxTimeout) as info:
        ctx.run_code("while True: pass", timeout_seconds=1)
    elapsed = time.monotonic() - started
    assert str(info.value) == "command timed out: while True: pass"
    assert isinstance(info.value.__cause__, ServerError)
    assert str(info.value.__cause__).startswith("cell timeout after 1s"), str(info.value.__cause__)
    assert elapsed < 5, f"timeout took {elapsed:.1f} s; the daemon should stop at about 1 s"

    # The next cell works, promptly, and still sees the earlier variables.
    t0 = time.monotonic()
    nxt = ctx.run_code("total + 1")
    assert nxt.error is None, f"state lost after a timeout: {nxt.error}"
    assert nxt.text == "42"
    assert time.monotonic() - t0 < 5, "the cell after a timeout was slow"

    # A blocking sleep is interrupted too.
    with pytest.raises(SandboxTimeout):
        ctx.run_code("time.sleep(30)", timeout_seconds=1)
    assert ctx.run_code("total").text == "41"

    # A cell within its timeout just runs.
    assert ctx.run_code("time.sleep(1.5); 'slept'", timeout_seconds=10).text == "'slept'"


def test_context_close_then_run_code_is_not_found(sandbox, make_context):
    keep = make_context(sandbox)
    ctx = sandbox.create_code_context()
    ctx.run_code("v = 1")
    assert sorted(s["id"] for s in list_sessions(sandbox.id)) == sorted([keep.id, ctx.id])

    assert ctx.close() is None
    assert [s["id"] for s in list_sessions(sandbox.id)] == [keep.id]
    with pytest.raises(NotFoundError):
        ctx.run_code("v")
    # close() again is harmless (the SDK swallows the 404), and the other
    # context of the sandbox is untouched.
    ctx.close()
    assert keep.run_code("1 + 1").text == "2"


def test_context_manager_closes_code_context(sandbox):
    with sandbox.create_code_context() as ctx:
        assert ctx.run_code("x = 20\nx * 2 + 2").text == "42"
        assert [s["id"] for s in list_sessions(sandbox.id)] == [ctx.id]
    assert list_sessions(sandbox.id) == []
    with pytest.raises(NotFoundError):
        ctx.run_code("x")

    # Also when the block raises; the exception propagates.
    with pytest.raises(RuntimeError, match="boom"):
        with sandbox.create_code_context() as second:
            second.run_code("y = 1")
            raise RuntimeError("boom")
    assert list_sessions(sandbox.id) == []
    with pytest.raises(NotFoundError):
        second.run_code("y")


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
