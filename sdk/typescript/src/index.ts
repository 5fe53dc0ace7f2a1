/**
 * runcell: sandboxes and code contexts for AI agents, over runcell's HTTP API.
 *
 *   import { Sandbox } from "runcell";
 *   await using sb = await Sandbox.create({ ttlSeconds: 600 });
 *   const r = await sb.runCode("x = 6\nx * 7");   // r.results[0]["text/plain"] === "42"
 */

export {
  Sandbox,
  CodeContext,
  type Language,
  type Limits,
  type SandboxCreateOptions,
  type SandboxInfo,
  type Result,
  type CellError,
  type RunResult,
  type ExecResult,
  type FileEntry,
  type SandboxFiles,
  type FileStat,
  type NetworkMode,
  type Isolation,
  type NetworkPolicy,
  type NetworkInfo,
  type StreamOptions,
  type ResultAccessors,
  type OnIdle,
  type VolumeMount,
  type MountedVolume,
  type SnapshotInfo,
  type VolumeInfo,
  type ForkOptions,
  type ForkTree,
  type PromoteResult,
  snapshots,
  volumes,
} from "./sandbox.js";
export { type ConnectionOptions, DEFAULT_URL, DEFAULT_KEY_FILE } from "./client.js";
export {
  RuncellError,
  AuthError,
  NotFoundError,
  BadRequestError,
  CapacityError,
  ConflictError,
  QuotaError,
  ServerError,
  ConnectionError,
} from "./errors.js";
