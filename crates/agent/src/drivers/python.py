# runcell Python context driver. The agent starts this as the sandbox user
# with fd 3 (cells in) and fd 4 (events out). Both are moved to private
# close-on-exec descriptors before any user code runs, so child processes never
# inherit them; stdout and stderr are plain pipes the agent reads, so nothing
# user code prints can be taken for an event.
import ast
import base64
import builtins
import inspect
import json
import linecache
import os
import signal
import sys
import time
import traceback
import types

# The cell timeout arrives as SIGINT: make sure it raises KeyboardInterrupt
# even if whoever started the sandbox had SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

_CTRL = os.dup(3)  # os.dup makes non-inheritable descriptors
_EVENTS = os.dup(4)
os.close(3)
os.close(4)
_ctrl = os.fdopen(_CTRL, "rb", buffering=0)
_events = os.fdopen(_EVENTS, "wb", buffering=0)
_DRIVER = os.path.abspath(__file__)

# User code runs in a fresh __main__ module, not in this driver's globals, so
# it cannot rebind the driver's functions by accident.
_main_module = types.ModuleType("__main__")
_main_module.__dict__["__builtins__"] = builtins
sys.modules["__main__"] = _main_module
_namespace = _main_module.__dict__


def _emit(obj):
    _events.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


def _flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


_MIME_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_json_", "application/json"),
    ("_repr_latex_", "text/latex"),
)


def _bundle(obj):
    """A MIME bundle for obj: every value a string, binary ones base64."""
    bundle = {}
    if not isinstance(obj, type):
        for method, mime in _MIME_METHODS:
            fn = getattr(obj, method, None)
            if not callable(fn):
                continue
            try:
                data = fn()
            except Exception:
                continue
            if isinstance(data, tuple):
                data = data[0]
            if data is None:
                continue
            if isinstance(data, (bytes, bytearray)):
                data = base64.b64encode(bytes(data)).decode()
            elif mime == "application/json":
                data = json.dumps(data)
            elif not isinstance(data, str):
                data = str(data)
            bundle[mime] = data
    try:
        bundle["text/plain"] = repr(obj)
    except Exception as e:  # a broken __repr__ must not break the cell
        bundle["text/plain"] = "<unrepresentable object: %s>" % e
    return bundle


def _figure_png(fig):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode()


def _flush_figures():
    """Sends every open matplotlib figure as image/png and closes it."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in list(plt.get_fignums()):
        fig = plt.figure(num)
        try:
            _emit({"type": "result", "bundle": {"image/png": _figure_png(fig), "text/plain": repr(fig)}})
        except Exception as e:
            print("runcell: could not render figure %s: %s" % (num, e), file=sys.stderr)
        plt.close(fig)


def _patch_pyplot():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None or getattr(plt.show, "_runcell", False):
        return

    def show(*args, **kwargs):
        _flush_std()
        _flush_figures()

    show._runcell = True
    plt.show = show


def display(*objs, raw=False):
    """Shows each object as a rich result (HTML, PNG, ...) of the current cell.
    With raw=True, each object is already a MIME bundle (a dict)."""
    _flush_std()
    for obj in objs:
        if raw and isinstance(obj, dict):
            bundle = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in obj.items()}
        elif _is_figure(obj):
            bundle = {"image/png": _figure_png(obj), "text/plain": repr(obj)}
            plt = sys.modules.get("matplotlib.pyplot")
            if plt is not None:
                plt.close(obj)
        else:
            bundle = _bundle(obj)
        _emit({"type": "result", "bundle": bundle})


def _is_figure(obj):
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(obj, figure.Figure)


builtins.display = display


def _user_tb(tb):
    """Drops the driver's own frames from the front of a traceback."""
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == _DRIVER:
        tb = tb.tb_next
    return tb


def _error(exc):
    tb = _user_tb(exc.__traceback__)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {"name": type(exc).__name__, "value": str(exc), "traceback": text}


_cell_no = 0


def _run_cell(code):
    global _cell_no
    _cell_no += 1
    filename = "<cell-%d>" % _cell_no
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    _patch_pyplot()
    exit_code, error = 0, None
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        for node, mode in ((tree, "exec"), (last, "eval")):
            if node is None:
                continue
            compiled = compile(node, filename, mode, flags=flags)
            value = eval(compiled, _namespace)
            if compiled.co_flags & inspect.CO_COROUTINE:
                import asyncio

                value = asyncio.get_event_loop_policy().get_event_loop().run_until_complete(value)
            if mode == "eval" and value is not None:
                _namespace["_"] = value
                _patch_pyplot()
                _flush_std()
                if not _is_figure(value):
                    _emit({"type": "result", "bundle": _bundle(value)})
    except SystemExit as e:
        code_ = e.code
        if code_ is None:
            exit_code = 0
        elif isinstance(code_, int):
            exit_code = code_
        else:
            print(code_, file=sys.stderr)
            exit_code = 1
    except BaseException as e:  # KeyboardInterrupt included: it is the timeout
        error = _error(e)
        sys.stderr.write(error["traceback"])
        exit_code = 1
    _patch_pyplot()
    _flush_std()
    try:
        _flush_figures()
    except BaseException as e:
        print("runcell: could not collect figures: %s" % e, file=sys.stderr)
    _flush_std()
    return exit_code, error


def _preload(modules):
    errors = []
    for name in modules:
        try:
            __import__(name)
        except BaseException as e:
            errors.append("%s: %s: %s" % (name, type(e).__name__, e))
    _patch_pyplot()
    return errors


def _main():
    preload = [m for m in os.environ.pop("RUNCELL_PRELOAD", "").split(",") if m]
    os.environ.setdefault("MPLBACKEND", "Agg")
    errors = _preload(preload)
    _emit({"type": "ready", "preload_errors": errors})
    while True:
        try:
            header = _ctrl.readline()
            if not header:
                return
            size = int(header)
            code = b""
            while len(code) < size:
                chunk = _ctrl.read(size - len(code))
                if not chunk:
                    return
                code += chunk
            started = time.monotonic()
            exit_code, error = _run_cell(code.decode("utf-8", "replace"))
            _emit({"type": "done", "exit_code": exit_code, "error": error,
                   "duration_ms": int((time.monotonic() - started) * 1000)})
        except KeyboardInterrupt:
            # An interrupt that arrived between cells: nothing to stop.
            continue


_main()
