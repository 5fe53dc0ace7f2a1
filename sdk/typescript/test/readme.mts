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
  const dir = mkdtempSync(join(tmpdir(), "readme-block-"));
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
