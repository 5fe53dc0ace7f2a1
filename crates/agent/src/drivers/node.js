// runcell JavaScript context driver. The agent starts this as the sandbox user
// with fd 3 (cells in) and fd 4 (events out); stdout and stderr are plain pipes
// the agent reads, so nothing user code prints can be taken for an event.
// Cells run in this process's global context, so top-level declarations
// persist from one cell to the next.
'use strict';
const fs = require('fs');
const util = require('util');
const vm = require('vm');

const EVENTS = 4;

function emit(obj) {
  const line = Buffer.from(JSON.stringify(obj) + '\n');
  let off = 0;
  while (off < line.length) off += fs.writeSync(EVENTS, line, off);
}

function bundle(value) {
  if (value && typeof value === 'object' && typeof value._repr_html === 'function') {
    return { 'text/html': String(value._repr_html()), 'text/plain': util.inspect(value) };
  }
  return { 'text/plain': typeof value === 'string' ? util.inspect(value) : util.inspect(value, { depth: 4 }) };
}

// display(value) shows a value as a result; display({'image/png': b64, ...}, {raw: true})
// passes a ready MIME bundle.
globalThis.display = function display(value, opts) {
  if (opts && opts.raw && value && typeof value === 'object') {
    const b = {};
    for (const [k, v] of Object.entries(value)) b[k] = typeof v === 'string' ? v : JSON.stringify(v);
    emit({ type: 'result', bundle: b });
  } else {
    emit({ type: 'result', bundle: bundle(value) });
  }
};
globalThis.require = require;
globalThis.module = module;

function userStack(err) {
  const stack = String(err && err.stack ? err.stack : err);
  return stack
    .split('\n')
    // Keep the message and the frames in cells; drop the driver's and node's.
    .filter((l) => !/^\s+at /.test(l) || /cell-\d+\.js/.test(l))
    .join('\n') + '\n';
}

function errorOf(err) {
  const name = err && err.name ? String(err.name) : 'Error';
  const value = err && err.message !== undefined ? String(err.message) : String(err);
  return { name, value, traceback: userStack(err) };
}

// ---- Top-level await -------------------------------------------------------
// A cell that only compiles as an async function body (it uses `await` at top
// level) runs as `(async () => { <cell> })()`, like node's REPL does. Two
// things a plain wrapper would lose are put back:
// - the value of a final expression statement: the cell is split before its
//   last top-level statement and that statement becomes `return (<expr>)`;
// - top-level declarations (`var`, `let`, `const` including destructuring and
//   several declarators, `function`, `class`): their names are collected and,
//   when the cell settles (fulfilled or rejected), each one that was
//   initialised becomes a global that later cells see (see keep()): an
//   accessor of the cell's own binding, so closures made in the cell and
//   later cells share the variable.
// The statement structure comes from a small tokenizer (strings, templates,
// comments, regex literals, brackets); every rewrite is compiled by V8 before
// it runs, and a cell the rewrite cannot compile reports V8's own error.

const KEYWORDS_BEFORE_REGEX = new Set([
  'return', 'typeof', 'instanceof', 'in', 'of', 'new', 'delete', 'void', 'throw',
  'case', 'do', 'else', 'yield', 'await',
]);

// Tokens: { t: 'id'|'num'|'str'|'tpl'|'re'|'p', v, s, e, nl, d, curly } where d
// is the bracket depth before the token, curly says it is inside braces (so
// possibly in a function body) and nl says a line break precedes it.
function tokenize(src) {
  const toks = [];
  const stack = []; // '(' '[' '{' or '`' (a template's ${)
  let i = 0;
  let nl = false;
  const n = src.length;
  const prev = () => (toks.length ? toks[toks.length - 1] : null);
  const regexAllowed = () => {
    const p = prev();
    if (!p) return true;
    if (p.t === 'id') return KEYWORDS_BEFORE_REGEX.has(p.v);
    if (p.t === 'p') return !(p.v === ')' || p.v === ']');
    return false;
  };
  const push = (t, s, e) => {
    toks.push({ t, v: src.slice(s, e), s, e, nl, d: stack.length, curly: stack.includes('{') });
    nl = false;
  };
  // Scans a template from just after ` or } up to ` or ${.
  const template = (s) => {
    let j = i;
    while (j < n) {
      const c = src[j];
      if (c === '\\') { j += 2; continue; }
      if (c === '`') { i = j + 1; push('tpl', s, i); return; }
      if (c === '$' && src[j + 1] === '{') { i = j + 2; push('tpl', s, i); stack.push('`'); return; }
      j += 1;
    }
    throw new SyntaxError('Unterminated template literal');
  };
  while (i < n) {
    const c = src[i];
    if (c === '\n' || c === '\r' || c === '\u2028' || c === '\u2029') { nl = true; i += 1; continue; }
    if (/\s/.test(c)) { i += 1; continue; }
    const s = i;
    if (c === '/' && src[i + 1] === '/') {
      while (i < n && src[i] !== '\n' && src[i] !== '\r') i += 1;
      continue;
    }
    if (c === '/' && src[i + 1] === '*') {
      const end = src.indexOf('*/', i + 2);
      if (end < 0) throw new SyntaxError('Unterminated comment');
      if (/[\n\r\u2028\u2029]/.test(src.slice(i, end))) nl = true;
      i = end + 2;
      continue;
    }
    if (c === '#' && i === 0 && src[1] === '!') {
      while (i < n && src[i] !== '\n') i += 1;
      continue;
    }
    if (c === '"' || c === "'") {
      i += 1;
      while (i < n && src[i] !== c) {
        if (src[i] === '\\') i += 1;
        else if (src[i] === '\n') throw new SyntaxError('Invalid or unexpected token');
        i += 1;
      }
      i += 1;
      push('str', s, i);
      continue;
    }
    if (c === '`') { i += 1; template(s); continue; }
    if (c === '}' && stack[stack.length - 1] === '`') { stack.pop(); i += 1; template(s); continue; }
    if (c === '/' && regexAllowed()) {
      i += 1;
      let cls = false;
      while (i < n) {
        const ch = src[i];
        if (ch === '\\') { i += 2; continue; }
        if (ch === '\n') throw new SyntaxError('Invalid regular expression: missing /');
        if (ch === '[') cls = true;
        else if (ch === ']') cls = false;
        else if (ch === '/' && !cls) break;
        i += 1;
      }
      i += 1;
      while (i < n && /[\w$]/.test(src[i])) i += 1;
      push('re', s, i);
      continue;
    }
    if (/[\p{ID_Start}$_\\]/u.test(c)) {
      i += 1;
      while (i < n && /[\p{ID_Continue}$\u200c\u200d\\]/u.test(src[i])) i += 1;
      push('id', s, i);
      continue;
    }
    if (/[0-9]/.test(c) || (c === '.' && /[0-9]/.test(src[i + 1] || ''))) {
      i += 1;
      while (i < n && /[\w.]/.test(src[i])) {
        if ((src[i] === 'e' || src[i] === 'E') && (src[i + 1] === '+' || src[i + 1] === '-')) i += 1;
        i += 1;
      }
      push('num', s, i);
      continue;
    }
    if (c === '(' || c === '[' || c === '{') { push('p', s, i + 1); stack.push(c); i += 1; continue; }
    if (c === ')' || c === ']' || c === '}') { stack.pop(); i += 1; push('p', s, i); continue; }
    if (c === '.' && src[i + 1] === '.' && src[i + 2] === '.') { i += 3; push('p', s, i); continue; }
    // Other punctuators, one character at a time except those that matter.
    const two = src.slice(i, i + 2);
    if (two === '=>' || two === '?.' || two === '++' || two === '--') { i += 2; push('p', s, i); continue; }
    i += 1;
    push('p', s, i);
  }
  return toks;
}

// Top-level statements start after `;`, after a `}` closing a top-level
// block, and (possibly, by ASI) at a line break.
function atStatementStart(toks, k) {
  if (k === 0) return true;
  const p = toks[k - 1];
  if (p.d !== 0) return false;
  if (p.t === 'p' && (p.v === ';' || p.v === '}' || p.v === ')')) return true;
  return toks[k].nl && !(p.t === 'p' && p.v !== ')' && p.v !== ']' && p.v !== '++' && p.v !== '--');
}

// Binding names of a declarator list starting at token k (just after the
// keyword). Returns the names.
function declaredNames(toks, k) {
  const names = [];
  const base = toks[k] ? toks[k].d : 0;
  let j = k;
  for (;;) {
    const tk = toks[j];
    if (!tk) break;
    if (tk.t === 'id') {
      names.push(tk.v);
      j += 1;
    } else if (tk.t === 'p' && (tk.v === '{' || tk.v === '[')) {
      j = patternNames(toks, j, names);
    } else {
      break;
    }
    // Skip the initializer up to `,` at the declaration's depth, `;`, or a
    // line break that ends the statement.
    let t = toks[j];
    if (t && t.t === 'p' && t.v === '=' && t.d === base) {
      j += 1;
      for (;;) {
        t = toks[j];
        if (!t || t.d < base) return names;
        if (t.d === base && t.t === 'p' && (t.v === ';')) return names;
        if (t.d === base && t.t === 'p' && t.v === ',') break;
        if (t.d === base && t.nl && j > 0 && atStatementStart(toks, j) && (t.t === 'id' || t.t === 'num' || t.t === 'str')) {
          const p = toks[j - 1];
          if (!(p.t === 'p' && p.v !== ')' && p.v !== ']' && p.v !== '}')) return names;
        }
        j += 1;
      }
    }
    t = toks[j];
    if (t && t.t === 'p' && t.v === ',' && t.d === base) { j += 1; continue; }
    break;
  }
  return names;
}

// Names bound by the object or array pattern opening at token k; returns the
// index after its closing bracket.
function patternNames(toks, k, names) {
  const open = toks[k];
  const isObj = open.v === '{';
  const depth = open.d + 1;
  let j = k + 1;
  const skipTo = (stop) => {
    // Skips an expression at `depth` until `,` or the pattern's close.
    while (toks[j] && !(toks[j].d === depth && toks[j].t === 'p' && stop.includes(toks[j].v)) && toks[j].d >= depth) j += 1;
  };
  while (toks[j] && toks[j].d >= depth) {
    const t = toks[j];
    if (t.d === depth && t.t === 'p' && (t.v === '}' || t.v === ']')) break;
    if (t.t === 'p' && t.v === ',') { j += 1; continue; }
    if (t.t === 'p' && t.v === '...') { j += 1; continue; }
    if (isObj) {
      // key: target | key = default | name | [computed]: target
      if (t.t === 'p' && t.v === '[') {
        j += 1;
        while (toks[j] && toks[j].d > depth) j += 1;
        j += 1; // ]
      } else if (toks[j + 1] && toks[j + 1].t === 'p' && toks[j + 1].v === ':') {
        j += 1;
      } else if (t.t === 'id') {
        names.push(t.v);
        j += 1;
      } else {
        j += 1;
      }
      if (toks[j] && toks[j].t === 'p' && toks[j].v === ':') {
        j += 1;
        j = target(j);
      }
    } else {
      j = target(j);
    }
    if (toks[j] && toks[j].t === 'p' && toks[j].v === '=' && toks[j].d === depth) {
      j += 1;
      skipTo([',', '}', ']']);
    }
  }
  return j + 1;
  function target(m) {
    const t = toks[m];
    if (!t) return m;
    if (t.t === 'p' && (t.v === '{' || t.v === '[')) return patternNames(toks, m, names);
    if (t.t === 'id') names.push(t.v);
    return m + 1;
  }
}

const EXPR_STARTERS_THAT_ARE_DECLARATIONS = /^(function|class|async\s+function|let|const|var|if|for|while|do|switch|try|return|throw|break|continue|import|export)\b/;

function compiles(src, filename) {
  try {
    // eslint-disable-next-line no-new
    new vm.Script(src, { filename });
    return true;
  } catch {
    return false;
  }
}

const EXPORT = '__runcellExport';

function rewriteAwait(code, filename, tokens) {
  const toks = tokens || tokenize(code);
  const names = new Set();
  const starts = [];
  for (let k = 0; k < toks.length; k++) {
    const t = toks[k];
    if (t.d !== 0 || !atStatementStart(toks, k)) continue;
    starts.push(k);
    if (t.t !== 'id') continue;
    if (t.v === 'var' || t.v === 'let' || t.v === 'const') {
      const next = toks[k + 1];
      if (next && (next.t === 'id' || (next.t === 'p' && (next.v === '{' || next.v === '[')))) {
        for (const name of declaredNames(toks, k + 1)) names.add(name);
      }
    } else if (t.v === 'function' || (t.v === 'async' && toks[k + 1] && toks[k + 1].v === 'function')) {
      let m = t.v === 'async' ? k + 2 : k + 1;
      if (toks[m] && toks[m].v === '*') m += 1;
      if (toks[m] && toks[m].t === 'id') names.add(toks[m].v);
    } else if (t.v === 'class' && toks[k + 1] && toks[k + 1].t === 'id') {
      names.add(toks[k + 1].v);
    }
  }
  // For each name a getter and a setter of the cell's own binding.
  const access = [...names].map((n) => {
    const param = n === '__runcellValue' ? '__runcellValue2' : '__runcellValue';
    return `${JSON.stringify(n)}: [() => ${n}, (${param}) => { ${n} = ${param}; }]`;
  }).join(', ');
  const head = `(async (${EXPORT}) => { ${EXPORT}({${access}}); `;
  const wrap = (body) => `${head}${body}\n})(globalThis[${JSON.stringify(EXPORT)}])`;
  // The earliest top-level statement start from which the rest of the cell
  // is one expression: that is the last statement, and it is an expression.
  // Tried from the last `;`-separated statement on, at most 200 candidates.
  let lastSemi = -1;
  toks.forEach((t, k) => { if (t.d === 0 && t.t === 'p' && t.v === ';' && k < toks.length - 1) lastSemi = k; });
  // Not the body of an if/for/while/with written without braces (right
  // after the header's `)`): making it a `return` would end a loop.
  const afterParen = (k) => {
    if (k === 0 || toks[k - 1].t !== 'p' || toks[k - 1].v !== ')') return false;
    let depth = 0;
    let m = k - 1;
    for (; m >= 0; m--) {
      const t = toks[m];
      if (t.t !== 'p') continue;
      if (t.v === ')') depth += 1;
      else if (t.v === '(' && --depth === 0) break;
    }
    let before = m > 0 ? toks[m - 1] : null;
    if (before && before.t === 'id' && before.v === 'await' && m > 1) before = toks[m - 2]; // for await (
    return !!before && before.t === 'id' && ['if', 'for', 'while', 'with'].includes(before.v);
  };
  const cands = starts.filter((k) => k > lastSemi && !afterParen(k)).slice(-200);
  const last = toks[toks.length - 1];
  const end = last && last.d === 0 && last.t === 'p' && last.v === ';' ? last.s : code.length;
  for (const k of cands) {
    const tail = code.slice(toks[k].s, end);
    if (EXPR_STARTERS_THAT_ARE_DECLARATIONS.test(tail)) continue;
    if (tail.trim() === '' || !compiles(`(async () => (${tail}\n))`, filename)) continue;
    const src = wrap(`${code.slice(0, toks[k].s)}return (${tail}\n);${code.slice(end + (end < code.length ? 1 : 0))}`);
    if (compiles(src, filename)) return { src, names: [...names] };
  }
  return { src: wrap(code), names: [...names] };
}

// Makes a finished await cell's declarations globals. A name no global
// binding has yet becomes an accessor property of globalThis that reads and
// writes the cell's own binding, so the cell's closures and later cells share
// one variable (as with node's REPL). A name that is already a global `let`
// or `const`, or a non-configurable global (a `var` of an earlier cell), is
// assigned instead.
const assigners = new Map();
function lexicallyBound(name) {
  if (name in globalThis) return false;
  try {
    vm.runInThisContext(name);
    return true;
  } catch (e) {
    return !(e instanceof ReferenceError && /is not defined/.test(String(e.message)));
  }
}
function keep(bindings) {
  for (const [name, [get, set]] of Object.entries(bindings)) {
    try {
      get();
    } catch {
      continue; // never initialised (the cell failed first)
    }
    try {
      const desc = Object.getOwnPropertyDescriptor(globalThis, name);
      if (!lexicallyBound(name) && (!desc || desc.configurable)) {
        Object.defineProperty(globalThis, name, { get, set, enumerable: true, configurable: true });
        continue;
      }
      let assign = assigners.get(name);
      if (!assign) {
        // The parameter's name must not be the one assigned.
        const param = name === '__runcellValue' ? '__runcellValue2' : '__runcellValue';
        assign = vm.runInThisContext(`(function (${param}) { ${name} = ${param}; })`);
        assigners.set(name, assign);
      }
      assign(get());
    } catch (e) {
      process.stderr.write(`runcell: the cell's ${name} could not be kept: ${e && e.message}\n`);
    }
  }
}

let cellNo = 0;
let interruptCurrent = null;

process.on('SIGINT', () => {
  // Between synchronous runs: abandon whatever the cell is awaiting.
  if (interruptCurrent) interruptCurrent(new Error('Script execution interrupted.'));
});

// The await wrapper hands its getters over through this (hidden) global.
let pendingKeep = null;
Object.defineProperty(globalThis, EXPORT, {
  value: (getters) => { pendingKeep = getters; },
  enumerable: false,
});

async function runCell(code) {
  cellNo += 1;
  const filename = `cell-${cellNo}.js`;
  let script;
  let wrapped = false;
  try {
    script = new vm.Script(code, { filename });
    // `const o = await (x)` compiles as a call of a function named await;
    // with an `await` outside any braces, prefer the async reading (as
    // node's REPL does) when it compiles and no global is called await.
    if (/\bawait\b/.test(code) && !('await' in globalThis)) {
      let toks = [];
      try { toks = tokenize(code); } catch { /* the plain reading stands */ }
      if (toks.some((t) => t.t === 'id' && t.v === 'await' && !t.curly)) {
        try {
          const rewritten = rewriteAwait(code, filename, toks);
          script = new vm.Script(rewritten.src, { filename });
          wrapped = true;
        } catch { /* the plain reading stands */ }
      }
    }
  } catch (e) {
    if (!(e instanceof SyntaxError)) return { exit_code: 1, error: errorOf(e) };
    // Maybe top-level await: try the cell as an async function body. If that
    // does not compile either, the first error is the one to report unless
    // the rewrite got further (the cell does use await and has another error).
    let rewritten = null;
    try {
      rewritten = rewriteAwait(code, filename);
      script = new vm.Script(rewritten.src, { filename });
      wrapped = true;
    } catch (e2) {
      const useSecond = rewritten && /await/.test(String(e.message)) && e2 instanceof SyntaxError;
      return { exit_code: 1, error: errorOf(useSecond ? e2 : e) };
    }
  }
  pendingKeep = null;
  try {
    let value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
    const keepNow = pendingKeep;
    pendingKeep = null;
    if (value && typeof value.then === 'function') {
      try {
        value = await new Promise((resolve, reject) => {
          interruptCurrent = reject;
          value.then(resolve, reject);
        });
      } finally {
        if (wrapped && keepNow) keep(keepNow);
      }
    }
    interruptCurrent = null;
    if (value !== undefined) {
      globalThis._ = value;
      emit({ type: 'result', bundle: bundle(value) });
    }
    return { exit_code: 0, error: null };
  } catch (e) {
    interruptCurrent = null;
    if (e && e.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') e.name = 'Interrupted';
    const error = errorOf(e);
    process.stderr.write(error.traceback);
    return { exit_code: 1, error };
  }
}

function flushStd() {
  return new Promise((resolve) => {
    let pending = 2;
    const done = () => { if (--pending === 0) resolve(); };
    process.stdout.write('', done);
    process.stderr.write('', done);
  });
}

// Cells arrive as "<length>\n<code>" on fd 3.
const input = fs.createReadStream(null, { fd: 3 });
let buf = Buffer.alloc(0);
let busy = false;

async function pump() {
  if (busy) return;
  busy = true;
  for (;;) {
    const nl = buf.indexOf(10);
    if (nl < 0) break;
    const size = parseInt(buf.subarray(0, nl).toString(), 10);
    if (buf.length < nl + 1 + size) break;
    const code = buf.subarray(nl + 1, nl + 1 + size).toString('utf8');
    buf = buf.subarray(nl + 1 + size);
    const started = Date.now();
    const r = await runCell(code);
    await flushStd();
    emit({ type: 'done', exit_code: r.exit_code, error: r.error, duration_ms: Date.now() - started });
  }
  busy = false;
}

input.on('data', (chunk) => {
  buf = Buffer.concat([buf, chunk]);
  pump();
});
input.on('end', () => process.exit(0));
process.on('uncaughtException', (e) => {
  // An error thrown later by a callback of an earlier cell: report it and go on.
  process.stderr.write('Uncaught ' + userStack(e));
});
process.on('unhandledRejection', (e) => {
  process.stderr.write('Unhandled rejection: ' + userStack(e));
});
emit({ type: 'ready', preload_errors: [] });
