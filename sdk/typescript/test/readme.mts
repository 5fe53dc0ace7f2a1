// Runs the fenced code examples of a Markdown file, so a README cannot drift
// from the code it documents. Generic: point it at any Markdown file, choose
// which fence languages run and how, and how imports are rewritten.
//
// Which blocks run: every fenced block whose language (the first word of the
// info string) is one of `languages`, unless its info string also has the
// word `no-run` (say why next to the block). A block runs on its own, as a
// file in a fresh temporary directory, with the caller's environment; it
// fails when the program exits non-zero (an exception, a rejected promise,
// an `assert`) or outlives `timeoutMs`.
//
// TypeScript and JavaScript blocks (ts, typescript, js, javascript, mjs) are
// transpiled with TypeScript's `transpileModule` (target ES2022, so `await
// using` is lowered for Node 20) and run as ES modules by `node`. Python
// blocks run with `python` (default `python3`).
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";

export interface Block {
  /** The fence's language, lower case. */
  lang: string;
  /** The whole info string. */
  info: string;
  /** 1-based line of the opening fence. */
  line: number;
  code: string;
}

/** The fenced blocks (``` or ~~~, 3 or more) of a Markdown text, in order. */
export function fencedBlocks(markdown: string): Block[] {
  const lines = markdown.split(/\r?\n/);
  const blocks: Block[] = [];
  for (let i = 0; i < lines.length; i++) {
    const open = /^( {0,3})(`{3,}|~{3,})\s*(.*)$/.exec(lines[i]!);
    if (!open) continue;
    const [, indent, fence, info] = open as unknown as [string, string, string, string];
    const body: string[] = [];
    let j = i + 1;
    for (; j < lines.length; j++) {
      const l = lines[j]!;
      const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
      if (close.test(l)) break;
      body.push(indent ? l.replace(new RegExp(`^ {0,${indent.length}}`), "") : l);
    }
    const trimmed = info.trim();
    blocks.push({ lang: (trimmed.split(/\s+/)[0] ?? "").toLowerCase(), info: trimmed, line: i + 1, code: body.join("\n") + "\n" });
    i = j;
  }
  return blocks;
}

export interface RunOptions {
  /** Fence languages to run, lower case (e.g. ["ts", "js"] or ["python"]). */
  languages: string[];
  /** Module specifier rewrites for JS/TS blocks: `from "runcell"` -> `from "<to>"`. */
  imports?: Record<string, string>;
  /** Python interpreter for python blocks. */
  python?: string;
  /** Per-block wall-clock limit. */
  timeoutMs?: number;
  /** Extra environment for the blocks. */
  env?: Record<string, string>;
  /** Parent of each block's temporary directory (default: the OS's), so that
   * bare imports resolve from a node_modules above it. */
  parent?: string;
}

export interface Outcome {
  block: Block;
  ok: boolean;
  status: number | null;
  stdout: string;
  stderr: string;
}

const JS = new Set(["ts", "typescript", "js", "javascript", "mjs"]);

/** The blocks of `languages` that are not marked `no-run`. */
export function runnableBlocks(markdown: string, languages: string[]): Block[] {
  const want = new Set(languages.map((l) => l.toLowerCase()));
  return fencedBlocks(markdown).filter((b) => want.has(b.lang) && !/(^|\s)no-run(\s|$)/.test(b.info));
}

function rewriteImports(code: string, imports: Record<string, string>): string {
  let out = code;
  for (const [from, to] of Object.entries(imports)) {
    const q = from.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    out = out.replace(new RegExp(`(\\bfrom\\s*|\\bimport\\s*\\(\\s*|\\bimport\\s+|\\brequire\\s*\\(\\s*)(["'])${q}\\2`, "g"), `$1$2${to}$2`);
  }
  return out;
}

/** Runs one block; never throws for a failing block (see `ok`). */
export function runBlock(block: Block, opts: RunOptions): Outcome {
  const dir = mkdtempSync(join(opts.parent ?? tmpdir(), "readme-block-"));
  try {
    let cmd: string;
    let args: string[];
    if (JS.has(block.lang)) {
      const ts = createRequire(import.meta.url)("typescript") as typeof import("typescript");
      const js = ts.transpileModule(rewriteImports(block.code, opts.imports ?? {}), {
        compilerOptions: {
          target: ts.ScriptTarget.ES2022,
          module: ts.ModuleKind.ESNext,
          lib: ["lib.esnext.d.ts"],
        },
        reportDiagnostics: true,
        fileName: `block-${block.line}.ts`,
      });
      const diags = (js.diagnostics ?? []).map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
      if (diags.length) {
        return { block, ok: false, status: null, stdout: "", stderr: `does not transpile: ${diags.join("; ")}` };
      }
      const file = join(dir, `block-${block.line}.mjs`);
      writeFileSync(file, js.outputText);
      cmd = process.execPath;
      args = [file];
    } else if (block.lang === "python" || block.lang === "py" || block.lang === "python3") {
      const file = join(dir, `block-${block.line}.py`);
      writeFileSync(file, block.code);
      cmd = opts.python ?? "python3";
      args = [file];
    } else if (block.lang === "sh" || block.lang === "bash" || block.lang === "shell") {
      const file = join(dir, `block-${block.line}.sh`);
      writeFileSync(file, block.code);
      cmd = "bash";
      args = ["-euo", "pipefail", file];
    } else {
      return { block, ok: false, status: null, stdout: "", stderr: `no runner for language "${block.lang}"` };
    }
    const r = spawnSync(cmd, args, {
      cwd: dir,
      encoding: "utf8",
      timeout: opts.timeoutMs ?? 120_000,
      env: { ...process.env, ...(opts.env ?? {}) },
      maxBuffer: 16 * 1024 * 1024,
    });
    const why = r.error ? `${r.error.message}\n` : r.signal ? `killed by ${r.signal}\n` : "";
    return { block, ok: r.status === 0 && !r.error, status: r.status, stdout: r.stdout ?? "", stderr: why + (r.stderr ?? "") };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

/** Reads a Markdown file and runs its runnable blocks in order. */
export function runMarkdownFile(path: string, opts: RunOptions): Outcome[] {
  return runnableBlocks(readFileSync(path, "utf8"), opts.languages).map((b) => runBlock(b, opts));
}

// ---------------------------------------------------------------------------
// Shell transcripts (```console blocks)
//
// A transcript is what a user types and sees: lines starting with `$ ` are
// commands, the lines after one (up to the next command) are what it prints.
// Every command of a block runs, in order, in one bash process (variables set
// by one command are seen by the next) in `cwd`, with stdin from /dev/null.
// A command passes when
// - its exit status is 0, or N where the command or its output lines say
//   `# exit status N`;
// - every output line shown appears among the lines it printed (stdout and
//   stderr together), in order; `...` or `…` in a shown line matches
//   anything, and a trailing comment (two spaces, then `#`) is not part of
//   the line. README literals that differ in this run (the default port, the
//   data directory) are mapped by `substitutions` first.
// A leading `sudo ` is dropped (the tests run as root). Commands matching
// `background` (a server) run in the background until their output shows
// the last line the transcript shows for them, then they and everything
// they started get SIGTERM.

export interface Step {
  /** 1-based line of the `$ ` line in the Markdown file. */
  line: number;
  command: string;
  expected: string[];
  status: number;
}

export interface TranscriptOptions {
  cwd: string;
  env?: Record<string, string>;
  substitutions?: Record<string, string>;
  background?: RegExp;
  timeoutMs?: number;
}

export interface TranscriptOutcome {
  block: Block;
  ok: boolean;
  /** One sentence per failed command. */
  failures: string[];
  /** What each command printed, for the failure message. */
  outputs: string[];
  stderr: string;
}

const COMMENT = /\s{2,}#.*$/;

/** The commands of a transcript and what each shows. */
export function transcriptSteps(block: Block): Step[] {
  const steps: Step[] = [];
  block.code.split("\n").forEach((l, i) => {
    if (l.startsWith("$ ")) {
      steps.push({ line: block.line + 1 + i, command: l.slice(2), expected: [], status: 0 });
    } else if (steps.length && l.trim()) {
      steps[steps.length - 1]!.expected.push(l);
    }
  });
  for (const s of steps) {
    for (const l of [s.command, ...s.expected]) {
      const m = /#\s*exit status (\d+)/.exec(l);
      if (m) s.status = Number(m[1]);
    }
    s.command = s.command.replace(/^sudo\s+/, "");
    s.expected = s.expected.map((l) => l.replace(COMMENT, "").trimEnd());
  }
  return steps;
}

function substitute(line: string, subs: Record<string, string>): string {
  let out = line;
  for (const [from, to] of Object.entries(subs)) out = out.split(from).join(to);
  return out;
}

function lineMatcher(expected: string): RegExp {
  const parts = expected.split(/\.\.\.|…/).map((p) => p.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
  return new RegExp(`^${parts.join(".*")}$`);
}

/** Whether `shown` appear among `printed`, in order. */
export function showsInOrder(printed: string[], shown: string[]): string | null {
  let at = 0;
  for (const want of shown) {
    const re = lineMatcher(want);
    while (at < printed.length && !re.test(printed[at]!.trimEnd())) at++;
    if (at === printed.length) return want;
    at++;
  }
  return null;
}

function shellQuote(s: string): string {
  return `'${s.replace(/'/g, "'\\''")}'`;
}

/** Runs a console transcript; never throws for a failing command. */
export function runTranscript(block: Block, opts: TranscriptOptions): TranscriptOutcome {
  const steps = transcriptSteps(block);
  const subs = opts.substitutions ?? {};
  const out = mkdtempSync(join(tmpdir(), "readme-transcript-"));
  try {
    const script: string[] = [`cd ${shellQuote(opts.cwd)} || exit 99`];
    steps.forEach((s, i) => {
      const o = shellQuote(join(out, `out.${i}`));
      const rc = shellQuote(join(out, `rc.${i}`));
      if (opts.background?.test(s.command)) {
        const last = s.expected.length ? substitute(s.expected[s.expected.length - 1]!, subs) : "";
        // In a session of its own, so the SIGTERM reaches the server and
        // whatever it started, not only a subshell wrapping it.
        script.push(
          `setsid bash -c ${shellQuote(s.command)} >${o} 2>&1 </dev/null &`,
          `bg=$!; for _ in $(seq 300); do grep -qF -- ${shellQuote(last)} ${o} 2>/dev/null && break; kill -0 $bg 2>/dev/null || break; sleep 0.1; done`,
          `if kill -0 $bg 2>/dev/null; then kill -TERM -- -$bg; wait $bg; echo 0 >${rc}; else wait $bg; echo $? >${rc}; fi`,
        );
      } else {
        script.push(`{ ${s.command}\n} >${o} 2>&1 </dev/null; echo $? >${rc}`);
      }
    });
    const r = spawnSync("bash", ["-c", script.join("\n")], {
      encoding: "utf8",
      timeout: opts.timeoutMs ?? 300_000,
      env: { ...process.env, ...(opts.env ?? {}) },
      maxBuffer: 16 * 1024 * 1024,
    });
    const failures: string[] = [];
    const outputs: string[] = [];
    steps.forEach((s, i) => {
      let printed = "";
      let status: number | null = null;
      try {
        printed = readFileSync(join(out, `out.${i}`), "utf8");
        status = Number(readFileSync(join(out, `rc.${i}`), "utf8").trim());
      } catch {
        // Not run: the script died or timed out before this command.
      }
      outputs.push(`$ ${s.command}\n${printed}[exit status ${status ?? "none: not run to the end"}]`);
      const where = `line ${s.line} \`${s.command}\``;
      if (status === null) {
        failures.push(`${where} did not finish`);
        return;
      }
      if (status !== s.status) failures.push(`${where} exited ${status}, the README says ${s.status}`);
      const missing = showsInOrder(printed.split("\n"), s.expected.map((l) => substitute(l, subs)));
      if (missing !== null) failures.push(`${where} did not print ${JSON.stringify(missing)} (or not in the README's order)`);
    });
    const why = r.error ? `${r.error.message}\n` : r.signal ? `killed by ${r.signal}\n` : "";
    return { block, ok: failures.length === 0 && !r.error, failures, outputs, stderr: why + (r.stderr ?? "") };
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
}
