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

let cellNo = 0;
let interruptCurrent = null;

process.on('SIGINT', () => {
  // Between synchronous runs: abandon whatever the cell is awaiting.
  if (interruptCurrent) interruptCurrent(new Error('Script execution interrupted.'));
});

async function runCell(code) {
  cellNo += 1;
  const filename = `cell-${cellNo}.js`;
  let script;
  let wrapped = false;
  try {
    script = new vm.Script(code, { filename });
  } catch (e) {
    if (e instanceof SyntaxError && /await/.test(String(e.message)) ) {
      // Top-level await: run the cell as an async function body.
      script = new vm.Script(`(async () => {\n${code}\n})()`, { filename, lineOffset: -1 });
      wrapped = true;
    } else {
      return { exit_code: 1, error: errorOf(e) };
    }
  }
  try {
    let value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
    if (value && typeof value.then === 'function') {
      value = await new Promise((resolve, reject) => {
        interruptCurrent = reject;
        value.then(resolve, reject);
      });
    }
    interruptCurrent = null;
    if (value !== undefined && !wrapped) {
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
