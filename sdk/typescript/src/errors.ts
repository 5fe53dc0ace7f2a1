/**
 * Typed errors. Every error the SDK throws for a failed API call is a
 * `RuncellError`; the subclass says what kind of failure it was, and the
 * message is a sentence that includes the daemon's own `error` text.
 */

/** Base class of every error this SDK throws for a failed call. */
export class RuncellError extends Error {
  /** HTTP status, when the daemon answered. */
  readonly status?: number;
  /** The parsed JSON body (or the raw text) of the daemon's answer, when there was one. */
  readonly body?: unknown;

  constructor(message: string, options: { status?: number; body?: unknown; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    if (options.status !== undefined) this.status = options.status;
    if (options.body !== undefined) this.body = options.body;
  }
}

/** 401 or 403: the API key is missing, wrong or revoked. */
export class AuthError extends RuncellError {}

/** 404: the sandbox, code context, file or route does not exist. */
export class NotFoundError extends RuncellError {}

/** 400 or 413: the request was refused as invalid (or too large). */
export class BadRequestError extends RuncellError {}

/** 503 or 429: the daemon has no capacity right now; retry after `retryAfterSeconds` when given. */
export class CapacityError extends RuncellError {
  /** The daemon's Retry-After, in seconds, when it sent one. */
  readonly retryAfterSeconds?: number;

  constructor(
    message: string,
    options: { status?: number; body?: unknown; cause?: unknown; retryAfterSeconds?: number } = {},
  ) {
    super(message, options);
    if (options.retryAfterSeconds !== undefined) this.retryAfterSeconds = options.retryAfterSeconds;
  }
}

/**
 * 409: the call does not fit the sandbox's state (it is paused, or not paused for `resume`), or a
 * volume is in use (deleted while mounted, or a second read-write mount).
 */
export class ConflictError extends RuncellError {}

/** 507: the workspace's disk quota is used up (a snapshot, a fork). Not retried. */
export class QuotaError extends RuncellError {}

/** Any other 5xx: the daemon failed. */
export class ServerError extends RuncellError {}

/** The request never got an HTTP answer: connection refused, reset, DNS failure, and so on. */
export class ConnectionError extends RuncellError {}
