/**
 * @runcell/mastra: a Mastra tool that runs the model's code in runcell
 * sandboxes.
 *
 *   const runCode = createRunCodeTool({ mode: "per-thread" });
 *   const agent = new Agent({ ..., tools: { runCode } });
 *   await agent.generate("...", { memory: { thread: "t1", resource: "u1" } });
 */
import { createTool } from "@mastra/core/tools";
import { MASTRA_THREAD_ID_KEY } from "@mastra/core/request-context";
import { z } from "zod";
import { NotFoundError, Sandbox } from "runcell";
import type { ConnectionOptions, Language, RunResult, SandboxCreateOptions } from "runcell";
import { formatRunResult, type RunCodeOutput } from "./format.js";

export { formatRunResult, truncate } from "./format.js";
export type { RunCodeOutput, FormatOptions } from "./format.js";

/** The metadata key and value stamped on every sandbox this package creates. */
export const TOOL_METADATA_KEY = "tool";
export const TOOL_METADATA_VALUE = "runcell-mastra";

export type RunCodeMode = "per-call" | "per-thread";

/**
 * What happens to a per-thread sandbox once its thread has been idle for
 * `ttlSeconds`: `"hibernate"` (its processes end and its memory is freed, its
 * files and installed packages stay; the thread's next call wakes it) or
 * `"delete"` (it is gone; the next call starts from an empty sandbox).
 */
export type ThreadIdleAction = "hibernate" | "delete";

/** Every language runcell's code contexts speak. */
export const ALL_LANGUAGES = ["python", "javascript", "bash"] as const satisfies readonly Language[];

export const DEFAULTS = {
  mode: "per-call" as RunCodeMode,
  template: "code-interpreter",
  /** Idle TTL of a per-thread sandbox: it lives this long after its last use. */
  perThreadTtlSeconds: 1800,
  /** What an idle per-thread sandbox becomes. */
  onThreadIdle: "hibernate" as ThreadIdleAction,
  /** Server-side backstop for a per-call sandbox, which the tool kills itself. */
  perCallTtlSeconds: 300,
  maxOutputChars: 8000,
  timeoutSeconds: 60,
  maxCodeChars: 50_000,
};

/** Whatever the execution context carries; only the parts read here are typed. */
export interface ThreadContextLike {
  agent?: { threadId?: string; resourceId?: string };
  requestContext?: { get(key: string): unknown };
  threadId?: string;
  resourceId?: string;
}

export interface RunCodeToolOptions extends ConnectionOptions {
  /**
   * `"per-call"` (default): a fresh sandbox for every call, killed when the
   * call returns. `"per-thread"`: one sandbox per conversation thread, kept
   * between calls until it has been idle for `ttlSeconds`.
   */
  mode?: RunCodeMode;
  /** Tool id (default `"run_code"`). */
  id?: string;
  /** Sandbox template (default `"code-interpreter"`). */
  template?: string;
  /** Idle TTL of the sandbox: per-thread default 1800 s; per-call default 300 s, as a backstop only. */
  ttlSeconds?: number;
  /**
   * Per-thread mode: what the thread's sandbox becomes after `ttlSeconds` idle. `"hibernate"`
   * (default) keeps its files and installed packages on the daemon's disk without processes or
   * memory, and the thread's next call wakes it (variables and imports are gone; the model is told);
   * `"delete"` deletes it, and the next call starts from an empty sandbox.
   */
  onThreadIdle?: ThreadIdleAction;
  /** Longest string (stdout, stderr, each result, traceback) returned to the model (default 8000). */
  maxOutputChars?: number;
  /** Time limit of one call's code, in seconds (default 60). */
  timeoutSeconds?: number;
  /** Languages the model may use (default python, javascript, bash); the first is the default. */
  languages?: readonly Language[];
  /** Extra metadata stamped on each sandbox (e.g. your app's name, to scope `sweepOrphans`). */
  metadata?: Record<string, string>;
  /** Resource limits of each sandbox. */
  limits?: SandboxCreateOptions["limits"];
  /** Environment variables of each sandbox. */
  envs?: Record<string, string>;
  /** Network policy of each sandbox (`"none"`, `"open"` or an allowlist), passed to `Sandbox.create` as is. */
  network?: SandboxCreateOptions["network"];
  /** Replaces the tool's description entirely. */
  description?: string;
  /**
   * Finds the conversation thread of a call (per-thread mode). By default:
   * the agent's memory thread (`context.agent.threadId`), else the request
   * context's `mastra__threadId`, else `context.threadId`.
   */
  getThreadId?: (context: ThreadContextLike) => string | undefined;
  /** Called after each run with the full result (images included), e.g. to show plots to the user. */
  onResult?: (result: RunResult, info: { sandboxId: string; threadId?: string; language: Language }) => void | Promise<void>;
}

function isNotFound(err: unknown): boolean {
  if (err instanceof NotFoundError) return true;
  const e = err as { name?: unknown; status?: unknown } | null;
  return !!e && (e.name === "NotFoundError" || e.status === 404);
}

/** The sandbox is gone: deleted (404), or reaped while the request was on its way (409). */
function isGone(err: unknown): boolean {
  if (isNotFound(err)) return true;
  const e = err as { status?: unknown; message?: unknown } | null;
  return !!e && e.status === 409 && typeof e.message === "string" && /no longer running/i.test(e.message);
}

function describeDuration(seconds: number): string {
  if (seconds % 3600 === 0) return `${seconds / 3600} hour${seconds === 3600 ? "" : "s"}`;
  if (seconds % 60 === 0) return `${seconds / 60} minute${seconds === 60 ? "" : "s"}`;
  return `${seconds} seconds`;
}

const LANGUAGE_NAMES: Record<Language, string> = {
  python: "python (Python 3; the value of the last expression is returned, like a notebook cell)",
  javascript: "javascript (Node.js)",
  bash: "bash",
};

/** The description the model reads: what the tool does and, truthfully, what persists. */
export function describeTool(opts: {
  mode: RunCodeMode;
  languages: readonly Language[];
  ttlSeconds: number;
  timeoutSeconds: number;
  maxOutputChars: number;
  /** Per-thread mode: what an idle sandbox becomes (default `"hibernate"`). */
  onThreadIdle?: ThreadIdleAction;
}): string {
  const langs = opts.languages.map((l) => LANGUAGE_NAMES[l]).join(", ");
  const common =
    ` Languages: ${langs}; default ${opts.languages[0]}.` +
    ` Each call may run for at most ${opts.timeoutSeconds} seconds; code that runs longer is interrupted.` +
    ` You get stdout, stderr, the exit code, results and any error; print what you need to see.` +
    ` Each output field is cut to ${opts.maxOutputChars} characters (a marker says so and gives the full size), so print summaries rather than whole data sets.` +
    ` Images (plots) are counted but not shown to you.`;
  if (opts.mode === "per-thread") {
    const idle = describeDuration(opts.ttlSeconds);
    const afterIdle =
      (opts.onThreadIdle ?? DEFAULTS.onThreadIdle) === "hibernate"
        ? ": files written to disk and packages you install are kept for later calls, even after the sandbox has been idle." +
          ` Variables, imports and functions (per language) persist too, as long as the sandbox is not idle for more than ${idle};` +
          " after that they are gone (files and packages are not), the output of the next call says so, and you must redo that setup in code."
: ": variables, imports and functions (per language), files written to disk and packages you install stay available in later calls," +
          ` as long as the sandbox is not idle for more than ${idle}.` +
          " After that it is deleted and the next call starts from a fresh sandbox; the output then says so and you must redo the setup.";
    return (
      "Runs code in an isolated Linux sandbox that belongs to this conversation." +
      " State persists between calls in this conversation" +
      afterIdle +
      " Other conversations cannot see this sandbox." +
      common
    );
  }
  return (
    "Runs code in a fresh, isolated Linux sandbox that is deleted as soon as the call returns." +
    " Nothing persists between calls: variables, imports, files and installed packages are all gone afterwards," +
    " so every snippet must be self-contained: install packages, import modules, load data and define functions in the same snippet that uses them." +
    common
  );
}

type Connection = ConnectionOptions;

function connectionOf(opts: ConnectionOptions): Connection {
  const c: Connection = {};
  if (opts.apiUrl !== undefined) c.apiUrl = opts.apiUrl;
  if (opts.apiKey !== undefined) c.apiKey = opts.apiKey;
  return c;
}

/** Per-key promise chain: calls with the same key run one after another. */
class KeyedLock {
  private tails = new Map<string, Promise<void>>();

  async run<T>(key: string, fn: () => Promise<T>): Promise<T> {
    const prev = this.tails.get(key) ?? Promise.resolve();
    let release!: () => void;
    const mine = new Promise<void>((resolve) => (release = resolve));
    const tail = prev.then(() => mine);
    this.tails.set(key, tail);
    await prev;
    try {
      return await fn();
    } finally {
      release();
      if (this.tails.get(key) === tail) this.tails.delete(key);
    }
  }
}

export function defaultThreadId(context: ThreadContextLike | undefined): string | undefined {
  if (!context) return undefined;
  const fromAgent = context.agent?.threadId;
  if (typeof fromAgent === "string" && fromAgent) return fromAgent;
  const fromRequest = context.requestContext?.get?.(MASTRA_THREAD_ID_KEY);
  if (typeof fromRequest === "string" && fromRequest) return fromRequest;
  if (typeof context.threadId === "string" && context.threadId) return context.threadId;
  return undefined;
}

function resourceIdOf(context: ThreadContextLike | undefined): string | undefined {
  const r = context?.agent?.resourceId ?? context?.resourceId;
  return typeof r === "string" && r ? r : undefined;
}

/**
 * Creates the run-code tool. Give it to an agent under the name the model
 * should see, e.g. `tools: { run_code: createRunCodeTool() }`.
 */
export function createRunCodeTool(options: RunCodeToolOptions = {}) {
  const mode = options.mode ?? DEFAULTS.mode;
  if (mode !== "per-call" && mode !== "per-thread") {
    throw new TypeError(`createRunCodeTool: mode must be "per-call" or "per-thread", not ${JSON.stringify(mode)}`);
  }
  const persistent = mode === "per-thread";
  const onThreadIdle = options.onThreadIdle ?? DEFAULTS.onThreadIdle;
  if (onThreadIdle !== "hibernate" && onThreadIdle !== "delete") {
    throw new TypeError(
      `createRunCodeTool: onThreadIdle must be "hibernate" or "delete", not ${JSON.stringify(onThreadIdle)}`,
    );
  }
  const ttlSeconds = options.ttlSeconds ?? (persistent ? DEFAULTS.perThreadTtlSeconds : DEFAULTS.perCallTtlSeconds);
  const timeoutSeconds = options.timeoutSeconds ?? DEFAULTS.timeoutSeconds;
  const maxOutputChars = options.maxOutputChars ?? DEFAULTS.maxOutputChars;
  const template = options.template ?? DEFAULTS.template;
  const languages = [...(options.languages ?? ALL_LANGUAGES)];
  if (languages.length === 0) throw new TypeError("createRunCodeTool: languages must not be empty");
  for (const l of languages) {
    if (!(ALL_LANGUAGES as readonly string[]).includes(l)) {
      throw new TypeError(`createRunCodeTool: unknown language ${JSON.stringify(l)}; runcell speaks ${ALL_LANGUAGES.join(", ")}`);
    }
  }
  if (!(maxOutputChars >= 200)) throw new TypeError("createRunCodeTool: maxOutputChars must be at least 200");
  const conn = connectionOf(options);
  const getThreadId = options.getThreadId ?? defaultThreadId;

  const createOptions = (metadata: Record<string, string>): SandboxCreateOptions => {
    const o: SandboxCreateOptions = {
      ...conn,
      template,
      ttlSeconds,
      metadata: { ...options.metadata, ...metadata, [TOOL_METADATA_KEY]: TOOL_METADATA_VALUE },
    };
    if (options.limits !== undefined) o.limits = options.limits;
    if (options.envs !== undefined) o.envs = options.envs;
    if (options.network !== undefined) o.network = options.network;
    return o;
  };

  // per-thread state: thread id -> sandbox id, and a lock per thread.
  const sandboxOfThread = new Map<string, string>();
  const lock = new KeyedLock();

  /** The thread's live sandbox, found again or created; `fresh` says a new one was made. */
  async function threadSandbox(threadId: string, resourceId: string | undefined): Promise<{ sb: Sandbox; fresh: boolean }> {
    const known = sandboxOfThread.get(threadId);
    if (known) {
      try {
        return { sb: await Sandbox.get(known, conn), fresh: false };
      } catch (err) {
        if (!isNotFound(err)) throw err;
        sandboxOfThread.delete(threadId);
      }
    }
    // Another process (or an earlier run of this one) may have made it.
    const listed = await Sandbox.list({
      ...conn,
      metadata: { ...options.metadata, [TOOL_METADATA_KEY]: TOOL_METADATA_VALUE, mode: "per-thread", threadId },
    });
    for (const info of [...listed].reverse()) {
      if (info.id === known) continue;
      try {
        const sb = await Sandbox.get(info.id, conn);
        sandboxOfThread.set(threadId, sb.id);
        return { sb, fresh: false };
      } catch (err) {
        if (!isNotFound(err)) throw err;
      }
    }
    const meta: Record<string, string> = { mode: "per-thread", threadId };
    if (resourceId) meta.resourceId = resourceId;
    const sb = await Sandbox.create({ ...createOptions(meta), onIdle: onThreadIdle });
    sandboxOfThread.set(threadId, sb.id);
    return { sb, fresh: known !== undefined };
  }

  const run = (sb: Sandbox, code: string, language: Language) =>
    sb.runCode(code, { language, timeoutSeconds });

  async function report(result: RunResult, sandboxId: string, language: Language, threadId?: string) {
    if (!options.onResult) return;
    const info: { sandboxId: string; threadId?: string; language: Language } = { sandboxId, language };
    if (threadId !== undefined) info.threadId = threadId;
    await options.onResult(result, info);
  }

  async function perCall(code: string, language: Language, ctx: ThreadContextLike | undefined): Promise<RunCodeOutput> {
    const meta: Record<string, string> = { mode: "per-call" };
    const threadId = getThreadId(ctx ?? {});
    if (threadId) meta.threadId = threadId;
    const sb = await Sandbox.create(createOptions(meta));
    let result: RunResult;
    try {
      result = await run(sb, code, language);
    } finally {
      // The server-side TTL removes it if this fails.
      await sb.kill().catch(() => undefined);
    }
    await report(result, sb.id, language, threadId);
    return formatRunResult(result, { maxOutputChars, timeoutSeconds, persistent: false });
  }

  async function perThread(code: string, language: Language, ctx: ThreadContextLike | undefined): Promise<RunCodeOutput> {
    const threadId = getThreadId(ctx ?? {});
    if (!threadId) {
      throw new Error(
        "runcell run-code tool (per-thread mode) found no conversation thread id: call the agent with " +
          "memory: { thread, resource }, set mastra__threadId in the request context, or pass getThreadId.",
      );
    }
    return lock.run(threadId, async () => {
      const notes: string[] = [];
      let { sb, fresh } = await threadSandbox(threadId, resourceIdOf(ctx));
      // Hibernated while the thread was idle: this call wakes it (the daemon
      // wakes a sandbox on its next exec or cell) with its files and without
      // its interpreters.
      let woke = sb.info.status === "hibernated";
      let result: RunResult;
      try {
        result = await run(sb, code, language);
      } catch (err) {
        // Expired between the lookup and the run: start over once in a new one.
        if (!isGone(err)) throw err;
        if (sandboxOfThread.get(threadId) === sb.id) sandboxOfThread.delete(threadId);
        ({ sb } = await threadSandbox(threadId, resourceIdOf(ctx)));
        fresh = true;
        woke = false;
        result = await run(sb, code, language);
      }
      if (fresh) {
        notes.push(
          "This conversation's previous sandbox had expired, so this code ran in a new, empty one: variables, files and packages from earlier calls are gone.",
        );
      }
      if (woke) {
        notes.push(
          "This conversation's sandbox had been idle and was hibernated; this call woke it. Files on disk and installed packages are kept, but variables, imports and functions defined in earlier calls are gone. Re-run the setup you need.",
        );
      }
      await report(result, sb.id, language, threadId);
      // The wake note already says the interpreters were restarted.
      const shown = woke && result.stateLost ? { ...result, stateLost: false } : result;
      return formatRunResult(shown, { maxOutputChars, timeoutSeconds, persistent: true, notes });
    });
  }

  const languageEnum = z.enum(languages as [Language, ...Language[]]);
  const inputSchema = z.object({
    code: z
      .string()
      .max(DEFAULTS.maxCodeChars)
      .describe(`The code to run (at most ${DEFAULTS.maxCodeChars} characters).`),
    language: languageEnum.default(languages[0] as Language).describe("The language of the code."),
  });
  const outputSchema = z.object({
    stdout: z.string(),
    stderr: z.string(),
    exitCode: z.number(),
    results: z.array(z.string()),
    images: z.number(),
    error: z.object({ name: z.string(), value: z.string(), traceback: z.string() }).optional(),
    timedOut: z.boolean(),
    truncated: z.boolean(),
    message: z.string().optional(),
  });

  return createTool({
    id: options.id ?? "run_code",
    description:
      options.description ?? describeTool({ mode, languages, ttlSeconds, timeoutSeconds, maxOutputChars, onThreadIdle }),
    inputSchema,
    outputSchema,
    execute: async (input, context) => {
      const ctx = context as unknown as ThreadContextLike | undefined;
      const language = (input.language ?? languages[0]) as Language;
      return persistent ? perThread(input.code, language, ctx) : perCall(input.code, language, ctx);
    },
  });
}

export interface SweepOrphansOptions extends ConnectionOptions {
  /** Threads that are still in use; sandboxes of every other thread are killed. */
  activeThreadIds: Iterable<string>;
  /** Only sandboxes with this extra metadata too (use the same as the tool's `metadata`). */
  metadata?: Record<string, string>;
  /** Also kill per-call sandboxes whose thread is not active (left behind by a crash). Default false. */
  includePerCall?: boolean;
}

/**
 * Kills the sandboxes this package created whose conversation thread is no
 * longer active, and returns their ids. Sandboxes not created by this tool
 * are never touched. A hibernated sandbox of an active thread is left as it
 * is (not woken: it is only listed); one of an inactive thread is killed
 * like any other, which frees its files on the daemon's disk.
 */
export async function sweepOrphans(options: SweepOrphansOptions): Promise<string[]> {
  const conn = connectionOf(options);
  const active = new Set(options.activeThreadIds);
  const modes = options.includePerCall ? ["per-thread", "per-call"] : ["per-thread"];
  const killed: string[] = [];
  for (const mode of modes) {
    const listed = await Sandbox.list({
      ...conn,
      metadata: { ...options.metadata, [TOOL_METADATA_KEY]: TOOL_METADATA_VALUE, mode },
    });
    for (const info of listed) {
      const threadId = info.metadata?.threadId;
      if (mode === "per-thread" && !threadId) continue;
      if (threadId && active.has(threadId)) continue;
      if (mode === "per-call" && !threadId) continue;
      try {
        const sb = await Sandbox.get(info.id, conn);
        await sb.kill();
        killed.push(info.id);
      } catch (err) {
        if (!isNotFound(err)) throw err;
      }
    }
  }
  return killed;
}
