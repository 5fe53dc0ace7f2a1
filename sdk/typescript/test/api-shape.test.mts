// The public API, checked by the compiler against the shape other packages
// (the Mastra tool) are written against. If a name or type drifts, `tsc -p
// tsconfig.test.json` fails, and with it scripts/test-sdk.sh.
import { test } from "node:test";
import assert from "node:assert/strict";
import * as runcell from "runcell";
import type {
  CellError,
  CodeContext,
  ConnectionOptions,
  ExecResult,
  Language,
  Limits,
  FileStat,
  NetworkInfo,
  NetworkPolicy,
  StreamOptions,
  Result,
  RunResult,
  Sandbox,
  SandboxCreateOptions,
  SandboxInfo,
  OnIdle,
  VolumeMount,
  MountedVolume,
  SnapshotInfo,
  VolumeInfo,
  ForkOptions,
  ForkTree,
  PromoteResult,
} from "runcell";

type Equal<A, B> = (<T>() => T extends A ? 1 : 2) extends <T>() => T extends B ? 1 : 2 ? true : false;
function same<A, B>(ok: Equal<A, B>): void {
  assert.equal(ok, true);
}

interface SpecLimits { memoryMb?: number; cpu?: number; pids?: number; diskMb?: number; timeoutSeconds?: number; outputBytes?: number }
interface SpecConnectionOptions { apiUrl?: string; apiKey?: string }
type SpecNetworkMode = "none" | "allowlist" | "open";
type SpecNetworkPolicy = SpecNetworkMode | { mode?: SpecNetworkMode; allow?: string[]; presets?: string[] };
interface SpecNetworkInfo { mode: SpecNetworkMode; allow: string[]; presets: string[]; bytesIn: number; bytesOut: number; connectionsAllowed: number; connectionsRefused: number; refusedHosts: string[] }
interface SpecFileStat { name: string; isDir: boolean; type: "file" | "dir" | "symlink"; size: number; permissions: string; mtime: number }
interface SpecStreamOptions { onStdout?: (chunk: string) => void; onStderr?: (chunk: string) => void; onResult?: (result: SpecResult) => void; signal?: AbortSignal }
interface SpecSandboxCreateOptions extends SpecConnectionOptions { template?: string; ttlSeconds?: number; metadata?: Record<string, string>; network?: SpecNetworkPolicy; limits?: SpecLimits; envs?: Record<string, string>; persistent?: boolean; isolation?: "jail" | "gvisor" | "microvm"; fromSnapshot?: string; volumes?: SpecVolumeMount[]; onIdle?: "delete" | "hibernate" }
interface SpecVolumeMount { name: string; readOnly?: boolean; path?: string }
interface SpecMountedVolume { name: string; path: string; readOnly: boolean }
interface SpecSnapshotInfo { id: string; sandboxId: string; workspace: string; template: string; createdAt: string; sizeBytes: number; memory: boolean }
interface SpecVolumeInfo { name: string; sizeMb: number; createdAt: string; usedBytes: number; attachedTo: string[] }
interface SpecForkOptions { metadata?: Record<string, string>; ttlSeconds?: number }
interface SpecPromoteResult { winner: string; treeId: string; deleted: string[]; failures: Record<string, string> }
interface SpecSandboxInfo { id: string; template: string; metadata: Record<string, string>; status: string; createdAt: string; ttlSeconds?: number; isolation?: "jail" | "gvisor" | "microvm"; onIdle?: "delete" | "hibernate"; fromSnapshot?: string; forkedFrom?: string; volumes?: SpecMountedVolume[]; stateLost?: boolean; raw: Record<string, unknown> }
interface SpecResultAccessors { readonly text?: string; readonly html?: string; readonly markdown?: string; readonly png?: string; readonly jpeg?: string; readonly svg?: string; readonly json?: string; readonly latex?: string }
type SpecResult = { [mime: string]: string } & SpecResultAccessors;
interface SpecCellError { name: string; value: string; traceback: string }
interface SpecRunResult { stdout: string; stderr: string; exitCode: number; results: SpecResult[]; error?: SpecCellError; timedOut: boolean; truncated: boolean; stateLost: boolean; durationMs: number; messages: string[] }
interface SpecExecResult { stdout: string; stderr: string; exitCode: number; timedOut: boolean; truncated: boolean; durationMs: number; messages: string[] }

interface SpecSandbox {
  readonly id: string;
  readonly info: SpecSandboxInfo;
  runCode(code: string, language?: Language | ({ language?: Language; timeoutSeconds?: number } & SpecStreamOptions)): Promise<SpecRunResult>;
  exec(cmd: string, opts?: { timeoutSeconds?: number; envs?: Record<string, string>; cwd?: string } & SpecStreamOptions): Promise<SpecExecResult>;
  files: {
    read(path: string): Promise<string>;
    readBytes(path: string): Promise<Uint8Array>;
    write(path: string, data: string | Uint8Array): Promise<void>;
    list(path: string): Promise<{ name: string; isDir: boolean; size: number }[]>;
    exists(path: string): Promise<boolean>;
    stat(path: string): Promise<SpecFileStat>;
    mkdir(path: string): Promise<void>;
    remove(path: string): Promise<void>;
    rename(from: string, to: string): Promise<void>;
  };
  createCodeContext(language?: Language): Promise<CodeContext>;
  setTtl(seconds: number): Promise<void>;
  setTimeout(seconds: number): Promise<void>;
  refresh(): Promise<SpecSandboxInfo>;
  getNetwork(): Promise<SpecNetworkInfo>;
  setNetwork(policy: SpecNetworkPolicy): Promise<SpecNetworkInfo>;
  kill(): Promise<void>;
  pause(): Promise<void>;
  resume(): Promise<void>;
  hibernate(): Promise<void>;
  wake(): Promise<void>;
  snapshot(): Promise<SpecSnapshotInfo>;
  fork(opts?: SpecForkOptions): Promise<Sandbox>;
  forkTree(count: number, opts?: { metadata?: Record<string, string> }): Promise<{ treeId: string; children: Sandbox[] }>;
  promote(opts?: { cleanupSiblings?: boolean; treeId?: string }): Promise<SpecPromoteResult>;
  [Symbol.asyncDispose](): Promise<void>;
}
interface SpecCodeContext {
  readonly id: string;
  readonly language: Language;
  runCode(code: string, opts?: { timeoutSeconds?: number } & SpecStreamOptions): Promise<SpecRunResult>;
  restart(): Promise<void>;
  close(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}

test("the exported types are exactly the agreed ones", () => {
  same<Language, "python" | "javascript" | "bash">(true);
  same<Limits, SpecLimits>(true);
  same<ConnectionOptions, SpecConnectionOptions>(true);
  same<SandboxCreateOptions, SpecSandboxCreateOptions>(true);
  same<SandboxInfo, SpecSandboxInfo>(true);
  same<Result, SpecResult>(true);
  same<CellError, SpecCellError>(true);
  same<RunResult, SpecRunResult>(true);
  same<ExecResult, SpecExecResult>(true);
  same<NetworkPolicy, SpecNetworkPolicy>(true);
  same<NetworkInfo, SpecNetworkInfo>(true);
  same<FileStat, SpecFileStat>(true);
  same<StreamOptions, SpecStreamOptions>(true);
  same<OnIdle, "delete" | "hibernate">(true);
  same<VolumeMount, SpecVolumeMount>(true);
  same<MountedVolume, SpecMountedVolume>(true);
  same<SnapshotInfo, SpecSnapshotInfo>(true);
  same<VolumeInfo, SpecVolumeInfo>(true);
  same<ForkOptions, SpecForkOptions>(true);
  same<PromoteResult, SpecPromoteResult>(true);
  same<ForkTree, { treeId: string; children: Sandbox[] }>(true);
});

test("Sandbox and CodeContext have the agreed members and statics", () => {
  const asSpec = (sb: Sandbox): SpecSandbox => sb;
  const ctxAsSpec = (c: CodeContext): SpecCodeContext => c;
  const create: (opts?: SpecSandboxCreateOptions) => Promise<Sandbox> = runcell.Sandbox.create;
  const get: (id: string, opts?: SpecConnectionOptions) => Promise<Sandbox> = runcell.Sandbox.get;
  const connect: (id: string, opts?: SpecConnectionOptions) => Promise<Sandbox> = runcell.Sandbox.connect;
  const list: (opts?: SpecConnectionOptions & { metadata?: Record<string, string> }) => Promise<SpecSandboxInfo[]> =
    runcell.Sandbox.list;
  for (const f of [asSpec, ctxAsSpec, create, get, connect, list]) assert.equal(typeof f, "function");
  const snaps: {
    list(opts?: SpecConnectionOptions & { sandboxId?: string }): Promise<SpecSnapshotInfo[]>;
    get(id: string, opts?: SpecConnectionOptions): Promise<SpecSnapshotInfo>;
    delete(id: string, opts?: SpecConnectionOptions): Promise<void>;
  } = runcell.snapshots;
  const vols: {
    create(name: string, opts: SpecConnectionOptions & { sizeMb: number }): Promise<SpecVolumeInfo>;
    list(opts?: SpecConnectionOptions): Promise<SpecVolumeInfo[]>;
    get(name: string, opts?: SpecConnectionOptions): Promise<SpecVolumeInfo>;
    delete(name: string, opts?: SpecConnectionOptions): Promise<void>;
  } = runcell.volumes;
  for (const ns of [snaps, vols]) for (const f of Object.values(ns)) assert.equal(typeof f, "function");
  const errors = [
    runcell.AuthError,
    runcell.NotFoundError,
    runcell.BadRequestError,
    runcell.CapacityError,
    runcell.ServerError,
    runcell.ConnectionError,
    runcell.ConflictError,
    runcell.QuotaError,
  ];
  for (const E of errors) {
    const e = new E("m", { status: 1, body: { error: "x" } });
    assert.ok(e instanceof runcell.RuncellError && e instanceof Error);
    const s: number | undefined = e.status;
    const b: unknown = e.body;
    assert.equal(s, 1);
    assert.deepEqual(b, { error: "x" });
  }
  const cap: number | undefined = new runcell.CapacityError("m", { retryAfterSeconds: 2 }).retryAfterSeconds;
  assert.equal(cap, 2);
});
