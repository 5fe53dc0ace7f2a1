/**
 * Turns a runcell `RunResult` into what the model sees: bounded strings,
 * a short summary of rich results, and plain sentences for what went wrong.
 * Pure functions, no I/O.
 */
import type { RunResult } from "runcell";

/** What the tool returns to the model (and what its output schema describes). */
export interface RunCodeOutput {
  /** Standard output, verbatim up to the limit. */
  stdout: string;
  /** Standard error, verbatim up to the limit. */
  stderr: string;
  /** Exit status of the cell (0 on success). */
  exitCode: number;
  /** Rich results in order: `text/plain` values as they are; other kinds (images, HTML) as a short note. */
  results: string[];
  /** How many images (PNG, JPEG, SVG) the code produced; they are not sent to the model. */
  images: number;
  /** The uncaught exception, if the code raised one. */
  error?: { name: string; value: string; traceback: string };
  /** True when the code ran past its time limit and was interrupted. */
  timedOut: boolean;
  /** True when any output was cut (by this tool's limit or the sandbox's output cap). */
  truncated: boolean;
  /** Plain sentences about the run that the model should act on (timeout, lost state, a new sandbox). */
  message?: string;
}

const IMAGE_MIMES = ["image/png", "image/jpeg", "image/svg+xml", "image/gif"];

/**
 * Cuts `text` to at most `max` characters, keeping its head and its tail
 * (tracebacks and final answers are at the end) around a marker that says
 * it was truncated and gives the total size. Text within the limit is
 * returned unchanged.
 */
export function truncate(text: string, max: number): { text: string; truncated: boolean } {
  if (text.length <= max) return { text, truncated: false };
  const total = text.length;
  const markerFor = (omitted: number) =>
    `\n[... output truncated: ${omitted} of ${total} characters omitted (total ${total} characters) ...]\n`;
  // The marker's length depends on the number it prints; size it for the worst case.
  const budget = Math.max(0, max - markerFor(total).length);
  const head = Math.ceil(budget * 0.6);
  const tail = budget - head;
  const omitted = total - head - tail;
  return {
    text: text.slice(0, head) + markerFor(omitted) + (tail > 0 ? text.slice(total - tail) : ""),
    truncated: true,
  };
}

export interface FormatOptions {
  maxOutputChars: number;
  /** The time limit the cell ran under, for the timeout message. */
  timeoutSeconds?: number;
  /** Whether state persists between calls (per-thread mode); changes what a timeout or lost state means. */
  persistent: boolean;
  /** Extra sentences to put in `message` (e.g. "a new sandbox was created"). */
  notes?: string[];
}

/** Builds the tool's output from a run's result. */
export function formatRunResult(r: RunResult, opts: FormatOptions): RunCodeOutput {
  const max = opts.maxOutputChars;
  let cut = false;
  const bound = (s: string) => {
    const t = truncate(s, max);
    if (t.truncated) cut = true;
    return t.text;
  };

  const results: string[] = [];
  let images = 0;
  for (const item of r.results ?? []) {
    const mimes = Object.keys(item);
    const image = mimes.find((m) => IMAGE_MIMES.includes(m));
    if (image) images += 1;
    const plain = item["text/plain"];
    if (plain !== undefined && !image) {
      results.push(bound(plain));
    } else if (image) {
      results.push(`[${image} image${plain !== undefined ? `: ${bound(plain)}` : ""}; not shown to you]`);
    } else if (mimes.length > 0) {
      results.push(`[${mimes.join(", ")} result; not shown to you]`);
    }
  }

  const notes = [...(opts.notes ?? [])];
  if (r.timedOut) {
    const after = opts.timeoutSeconds !== undefined ? ` after ${opts.timeoutSeconds}s` : "";
    let sentence = `Execution timed out${after} and was interrupted; the output above is what it printed before that.`;
    if (opts.persistent && !r.stateLost) {
      sentence += " Variables and files from before this call are kept.";
    }
    sentence +=
      " Make the code faster, work on less data, or split the work into smaller steps" +
      (opts.persistent ? " across several calls." : ", each one self-contained.");
    notes.push(sentence);
  }
  if (r.stateLost && opts.persistent) {
    notes.push(
      "The interpreter had to be restarted: variables, imports and functions defined in earlier calls are gone (files on disk are kept). Re-run the setup you need.",
    );
  }
  for (const m of r.messages ?? []) {
    // The timeout sentence above already says what the daemon's would.
    if (r.timedOut && /timed out|timeout/i.test(m)) continue;
    if (m && !notes.includes(m)) notes.push(m);
  }
  if (images > 0) {
    notes.push(`The code produced ${images} image${images === 1 ? "" : "s"} (not shown to you).`);
  }

  const out: RunCodeOutput = {
    stdout: bound(r.stdout ?? ""),
    stderr: bound(r.stderr ?? ""),
    exitCode: r.exitCode,
    results,
    images,
    timedOut: r.timedOut,
    truncated: false,
  };
  if (r.error) {
    out.error = { name: r.error.name, value: bound(r.error.value), traceback: bound(r.error.traceback) };
  }
  out.truncated = cut || r.truncated;
  if (notes.length > 0) out.message = notes.join(" ");
  return out;
}
