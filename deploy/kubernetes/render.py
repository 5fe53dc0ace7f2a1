#!/usr/bin/env python3
"""Renders the runcell Helm chart without Helm, for offline validation.

Helm is not installable on the machines runcell is tested on (it ships
neither as a Debian package nor in a PyPI or npm package), so this renders
the subset of Go templates and Sprig the chart uses, and fails loudly on
anything else, so the chart cannot silently grow a construct rendered wrong:

  actions     {{ pipeline }}, {{- ... -}} (whitespace trimming), if / else /
              end, range $i := LIST, define / include, $var := pipeline
  operands    .Values.a.b, .Release.Name/Namespace, .Chart.AppVersion, $,
              $var, "strings", integers, ( subexpressions )
  functions   include, quote, toYaml, nindent, indent, default, join, int,
              until

Usage: render.py CHART_DIR [--set key.path=value ...] > manifests.yaml
Release name "runcell", namespace "runcell" (as `helm template runcell`).
"""

import json
import os
import re
import sys

import yaml


class TemplateError(Exception):
    pass


TOKEN = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def lex(text):
    """Splits a template into ('text', s) and ('action', s) items, applying
    the {{- and -}} whitespace trimming."""
    items = []
    pos = 0
    for m in TOKEN.finditer(text):
        chunk = text[pos : m.start()]
        if m.group(1):
            chunk = chunk.rstrip(" \t\r\n")
        items.append(["text", chunk])
        items.append(["action", m.group(2), bool(m.group(3))])
        pos = m.end()
    items.append(["text", text[pos:]])
    # Trim the text after an action that ends with -}}.
    for i, it in enumerate(items):
        if it[0] == "action" and it[2] and i + 1 < len(items):
            items[i + 1][1] = items[i + 1][1].lstrip(" \t\r\n")
    return [(it[0], it[1]) for it in items]


def parse(items, i=0, stop=("end",)):
    """Parses items into a tree; returns (nodes, index, terminator)."""
    nodes = []
    while i < len(items):
        kind, s = items[i]
        i += 1
        if kind == "text":
            if s:
                nodes.append(("text", s))
            continue
        word = s.split(None, 1)[0] if s else ""
        rest = s[len(word) :].strip()
        if s.startswith("/*"):
            continue
        if word in stop:
            return nodes, i, word
        if word == "if":
            body, i, term = parse(items, i, ("else", "end"))
            other = []
            if term == "else":
                other, i, _ = parse(items, i, ("end",))
            nodes.append(("if", rest, body, other))
        elif word == "range":
            m = re.fullmatch(r"(\$\w+)\s*:=\s*(.+)", rest)
            if not m:
                raise TemplateError(f"unsupported range form: {s!r}")
            body, i, _ = parse(items, i, ("end",))
            nodes.append(("range", m.group(1), m.group(2), body))
        elif word == "define":
            name = json.loads(rest)
            body, i, _ = parse(items, i, ("end",))
            nodes.append(("define", name, body))
        elif word in ("else", "end", "with", "template", "block"):
            raise TemplateError(f"unsupported or unbalanced action: {s!r}")
        else:
            m = re.fullmatch(r"(\$\w+)\s*:=\s*(.+)", s, re.S)
            if m:
                nodes.append(("assign", m.group(1), m.group(2)))
            else:
                nodes.append(("expr", s))
    if stop:
        raise TemplateError(f"missing {{{{ end }}}} (expected one of {stop})")
    return nodes, i, None


def tokenize(expr):
    toks = re.findall(r'"(?:[^"\\]|\\.)*"|\(|\)|\||[^\s()|]+', expr)
    return toks


def to_yaml(v):
    if v is None:
        return "null"
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def go_str(v):
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise TemplateError(f"printing a {type(v).__name__} needs toYaml")
    return str(v)


def truthy(v):
    return bool(v) and v != 0


class Renderer:
    def __init__(self, root):
        self.root = root
        self.defines = {}

    def lookup(self, path, dot, scope):
        if path == ".":
            return dot
        if path == "$":
            return self.root
        if path.startswith("$"):
            name, _, rest = path.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            v = scope[name]
            fields = rest.split(".") if rest else []
        elif path.startswith("."):
            v = dot
            fields = path[1:].split(".")
        else:
            raise TemplateError(f"not a field or variable: {path!r}")
        for f in fields:
            if not isinstance(v, dict):
                raise TemplateError(f"{path}: {f} of a non-map")
            v = v.get(f)
        return v

    def operand(self, toks, dot, scope):
        t = toks.pop(0)
        if t == "(":
            depth, sub = 1, []
            while toks:
                x = toks.pop(0)
                depth += x == "("
                depth -= x == ")"
                if depth == 0:
                    break
                sub.append(x)
            return self.pipeline(sub, dot, scope)
        if t.startswith('"'):
            return json.loads(t)
        if re.fullmatch(r"-?\d+", t):
            return int(t)
        if t in ("true", "false"):
            return t == "true"
        return self.lookup(t, dot, scope)

    def call(self, name, args, dot, scope):
        if name == "include":
            tpl, ctx = args
            if tpl not in self.defines:
                raise TemplateError(f"include of undefined template {tpl!r}")
            return self.render(self.defines[tpl], ctx, {})
        if name == "quote":
            return json.dumps(go_str(args[0]))
        if name == "toYaml":
            return to_yaml(args[0])
        if name == "nindent":
            n, s = args
            return "\n" + "\n".join(" " * n + line for line in go_str(s).split("\n"))
        if name == "indent":
            n, s = args
            return "\n".join(" " * n + line for line in go_str(s).split("\n"))
        if name == "default":
            d, v = args
            return v if truthy(v) else d
        if name == "join":
            sep, lst = args
            return sep.join(go_str(x) for x in (lst or []))
        if name == "int":
            return int(args[0])
        if name == "until":
            return list(range(int(args[0])))
        raise TemplateError(f"unsupported function {name!r}")

    FUNCS = {"include", "quote", "toYaml", "nindent", "indent", "default", "join", "int", "until"}

    def command(self, toks, dot, scope, piped=None):
        if toks and toks[0] in self.FUNCS:
            name = toks.pop(0)
            args = []
            while toks:
                args.append(self.operand(toks, dot, scope))
            if piped is not None:
                args.append(piped[0])
            return self.call(name, args, dot, scope)
        if piped is not None:
            raise TemplateError(f"cannot pipe into {toks!r}")
        v = self.operand(toks, dot, scope)
        if toks:
            raise TemplateError(f"unexpected {toks!r}")
        return v

    def pipeline(self, toks, dot, scope):
        cmds, cur, depth = [], [], 0
        for t in toks:
            depth += t == "("
            depth -= t == ")"
            if t == "|" and depth == 0:
                cmds.append(cur)
                cur = []
            else:
                cur.append(t)
        cmds.append(cur)
        v = self.command(list(cmds[0]), dot, scope)
        for c in cmds[1:]:
            v = self.command(list(c), dot, scope, piped=(v,))
        return v

    def eval(self, expr, dot, scope):
        return self.pipeline(tokenize(expr), dot, scope)

    def render(self, nodes, dot, scope):
        out = []
        scope = dict(scope)
        for n in nodes:
            kind = n[0]
            if kind == "text":
                out.append(n[1])
            elif kind == "expr":
                out.append(go_str(self.eval(n[1], dot, scope)))
            elif kind == "assign":
                scope[n[1]] = self.eval(n[2], dot, scope)
            elif kind == "if":
                branch = n[2] if truthy(self.eval(n[1], dot, scope)) else n[3]
                out.append(self.render(branch, dot, scope))
            elif kind == "range":
                for x in self.eval(n[2], dot, scope) or []:
                    out.append(self.render(n[3], x, {**scope, n[1]: x}))
            elif kind == "define":
                pass
        return "".join(out)

    def collect_defines(self, nodes):
        for n in nodes:
            if n[0] == "define":
                self.defines[n[1]] = n[2]


def set_value(values, assignment):
    key, _, raw = assignment.partition("=")
    v = yaml.safe_load(raw)
    parts = key.split(".")
    d = values
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = v


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    chart = args.pop(0)
    sets = []
    while args:
        flag = args.pop(0)
        if flag != "--set" or not args:
            sys.exit(f"render.py: unexpected argument {flag!r}")
        sets.append(args.pop(0))
    with open(os.path.join(chart, "Chart.yaml")) as f:
        meta = yaml.safe_load(f)
    with open(os.path.join(chart, "values.yaml")) as f:
        values = yaml.safe_load(f)
    for s in sets:
        set_value(values, s)
    root = {
        "Values": values,
        "Release": {"Name": "runcell", "Namespace": "runcell", "Service": "Helm"},
        "Chart": {"Name": meta["name"], "Version": meta["version"], "AppVersion": meta["appVersion"]},
    }
    r = Renderer(root)
    tdir = os.path.join(chart, "templates")
    names = sorted(os.listdir(tdir))
    trees = {}
    for name in names:
        with open(os.path.join(tdir, name)) as f:
            nodes, _, term = parse(lex(f.read()), 0, ())
        if term is not None:
            raise TemplateError(f"{name}: unbalanced {term}")
        r.collect_defines(nodes)
        trees[name] = nodes
    for name in names:
        if name.startswith("_") or not name.endswith(".yaml"):
            continue
        try:
            text = r.render(trees[name], root, {"$": root})
        except TemplateError as e:
            raise TemplateError(f"{name}: {e}") from e
        if text.strip():
            print(f"---\n# Source: {meta['name']}/templates/{name}")
            print(text.strip("\n"))


if __name__ == "__main__":
    try:
        main()
    except TemplateError as e:
        sys.exit(f"render.py: {e}")
