/**
 * Test helpers: a scripted language model (the `ai` package's
 * MockLanguageModelV4) that makes the tool calls a test asks for, and a
 * direct view of the daemon's sandboxes that does not go through the SDK.
 */
import { MockLanguageModelV4 } from "ai/test";

type Usage = {
  inputTokens: { total: number; noCache: number; cacheRead: number; cacheWrite: number };
  outputTokens: { total: number; text: number; reasoning: number };
};
const usage: Usage = {
  inputTokens: { total: 10, noCache: 10, cacheRead: 0, cacheWrite: 0 },
  outputTokens: { total: 5, text: 5, reasoning: 0 },
};

/** One model turn: call the tool (once or several times in parallel), or answer with text. */
export type Step =
  | { call: { code: string; language?: string } | { code: string; language?: string }[]; toolName?: string }
  | { text: string }
  /** Answer with the stdout of the last tool result the model was sent (checks the round trip). */
  | { echoLastToolResult: true };

interface PromptPart {
  type: string;
  output?: { type: string; value: unknown };
}
interface PromptMessage {
  role: string;
  content: string | PromptPart[];
}

/** The output values of every tool result in a prompt, in order. */
export function toolResultsInPrompt(prompt: unknown): unknown[] {
  const out: unknown[] = [];
  for (const m of prompt as PromptMessage[]) {
    if (m.role !== "tool" || typeof m.content === "string") continue;
    for (const p of m.content) {
      if (p.type === "tool-result" && p.output) out.push(p.output.value);
    }
  }
  return out;
}

/**
 * A model that plays `steps` in order, one per model call, across
 * `agent.generate` calls. `prompts` keeps every prompt it was sent.
 */
export class ScriptedModel {
  readonly steps: Step[] = [];
  readonly prompts: unknown[] = [];
  readonly toolDescriptions: Record<string, string | undefined>[] = [];
  private n = 0;
  readonly model: MockLanguageModelV4;

  constructor(private defaultToolName = "run_code") {
    this.model = new MockLanguageModelV4({
      doGenerate: async (options) => {
        this.prompts.push(options.prompt);
        const tools: Record<string, string | undefined> = {};
        for (const t of options.tools ?? []) {
          if (t.type === "function") tools[t.name] = t.description;
        }
        this.toolDescriptions.push(tools);
        const step = this.steps.shift();
        if (!step) throw new Error("ScriptedModel: the agent asked for more model calls than the test scripted");
        this.n += 1;
        if ("call" in step) {
          const calls = Array.isArray(step.call) ? step.call : [step.call];
          return {
            content: calls.map((args, i) => ({
              type: "tool-call" as const,
              toolCallId: `call-${this.n}-${i}`,
              toolName: step.toolName ?? this.defaultToolName,
              input: JSON.stringify(args),
            })),
            finishReason: { unified: "tool-calls" as const, raw: undefined },
            usage,
            warnings: [],
          };
        }
        let text: string;
        if ("text" in step) {
          text = step.text;
        } else {
          const results = toolResultsInPrompt(options.prompt);
          const last = results[results.length - 1] as { stdout?: string } | undefined;
          text = `stdout was: ${last?.stdout ?? "(no tool result)"}`;
        }
        return {
          content: [{ type: "text" as const, text }],
          finishReason: { unified: "stop" as const, raw: undefined },
          usage,
          warnings: [],
        };
      },
    });
  }

  /** Scripts one agent turn: the tool call(s), then a text answer echoing the result. */
  turn(call: { code: string; language?: string } | { code: string; language?: string }[]): this {
    this.steps.push({ call }, { echoLastToolResult: true });
    return this;
  }
}

// --- the daemon, seen directly ---------------------------------------------

export const apiUrl = (): string => {
  const u = process.env.RUNCELL_URL;
  if (!u) throw new Error("RUNCELL_URL is not set: run these tests through scripts/test-mastra.sh");
  return u.replace(/\/+$/, "");
};
const apiKey = (): string => {
  const k = process.env.RUNCELL_API_KEY;
  if (!k) throw new Error("RUNCELL_API_KEY is not set: run these tests through scripts/test-mastra.sh");
  return k;
};

export interface RawSandbox {
  id: string;
  metadata: Record<string, string>;
  ttl_seconds: number;
  template: string;
  /** "running", "paused" or "hibernated" (issue 14). */
  status?: string;
  /** "delete" or "hibernate" (issue 14). */
  on_idle?: string;
}

/** One sandbox as the daemon describes it, or undefined once it is gone. */
export async function getSandbox(id: string): Promise<RawSandbox | undefined> {
  const res = await api("GET", `/v1/sandboxes/${id}`);
  if (res.status === 404) return undefined;
  if (!res.ok) throw new Error(`GET /v1/sandboxes/${id}: ${res.status} ${await res.text()}`);
  return (await res.json()) as RawSandbox;
}

/** Polls the sandbox until `done` holds (true) or `seconds` pass (false). */
export async function waitFor(id: string, done: (sb: RawSandbox | undefined) => boolean, seconds: number): Promise<boolean> {
  const until = Date.now() + seconds * 1000;
  for (;;) {
    if (done(await getSandbox(id))) return true;
    if (Date.now() > until) return false;
    await new Promise((r) => setTimeout(r, 250));
  }
}

async function api(method: string, path: string, body?: unknown): Promise<Response> {
  const init: RequestInit = { method, headers: { Authorization: `Bearer ${apiKey()}` } };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    (init.headers as Record<string, string>)["Content-Type"] = "application/json";
  }
  return fetch(`${apiUrl()}${path}`, init);
}

/** Live sandboxes whose metadata has all of `metadata`. */
export async function listSandboxes(metadata: Record<string, string> = {}): Promise<RawSandbox[]> {
  const q = new URLSearchParams(Object.entries(metadata).map(([k, v]): [string, string] => [`metadata.${k}`, v]));
  const res = await api("GET", `/v1/sandboxes?${q}`);
  if (!res.ok) throw new Error(`GET /v1/sandboxes: ${res.status} ${await res.text()}`);
  return (await res.json()) as RawSandbox[];
}

export async function deleteSandbox(id: string): Promise<void> {
  const res = await api("DELETE", `/v1/sandboxes/${id}`);
  if (!res.ok && res.status !== 404) throw new Error(`DELETE /v1/sandboxes/${id}: ${res.status} ${await res.text()}`);
}

/** Creates a sandbox through the HTTP API, not through this package. */
export async function createRawSandbox(metadata: Record<string, string>): Promise<string> {
  const res = await api("POST", "/v1/sandboxes", { template: "code-interpreter", ttl_seconds: 300, metadata });
  if (res.status !== 201 && res.status !== 200) throw new Error(`POST /v1/sandboxes: ${res.status} ${await res.text()}`);
  return ((await res.json()) as RawSandbox).id;
}

/** A thread id no other test uses. */
export function uniqueId(prefix: string): string {
  return `${prefix}-${process.pid}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}
