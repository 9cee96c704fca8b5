import { ApiError } from './errors.js';

/** A place in the queue: wait for `turn()`, then generate; `release()` when done (any number of times). */
export interface Ticket {
  /** Resolves when this request may use the engine; rejects with the signal's reason when it aborts first. */
  turn(signal: AbortSignal): Promise<void>;
  release(): void;
}

/**
 * The requests the server holds at once, in arrival order. The engine decodes one sequence at a
 * time, so one request generates and the others wait; `capacity` bounds them all (the one
 * generating included), and a request beyond it is refused at once with a 429 rather than left
 * to wait behind an unbounded line. A waiting request whose client goes away leaves the line
 * without touching the engine.
 */
export class RequestQueue {
  private readonly waiters: { start: () => void }[] = [];
  private admitted = 0;
  private busy = false;
  private closedReason: string | undefined;

  constructor(readonly capacity: number) {}

  /** Requests waiting for the engine (the one generating not counted). */
  get waiting(): number {
    return this.waiters.length;
  }

  /** Whether a request is generating now. */
  get running(): boolean {
    return this.busy;
  }

  /** Requests admitted and not yet released: generating, waiting, or between the two. */
  get size(): number {
    return this.admitted;
  }

  /** Admits a request or refuses it: 429 when `capacity` requests are already held, 503 once closed. */
  admit(): Ticket {
    if (this.closedReason !== undefined) throw new ApiError(503, 'server_error', this.closedReason, null, 'server_shutting_down');
    if (this.admitted >= this.capacity) {
      throw new ApiError(429, 'rate_limit_error', `the server is busy: ${this.admitted} requests are generating or waiting, the most it holds (--max-concurrency ${this.capacity}); retry later`, null, 'server_busy');
    }
    this.admitted++;
    let state: 'admitted' | 'waiting' | 'running' | 'released' = 'admitted';
    let entry: { start: () => void } | undefined;
    return {
      turn: (signal) =>
        new Promise<void>((resolve, reject) => {
          if (state !== 'admitted') return reject(new Error(`turn() on a ticket that is ${state}`));
          if (signal.aborted) return reject(signal.reason);
          const start = () => {
            signal.removeEventListener('abort', onAbort);
            state = 'running';
            this.busy = true;
            resolve();
          };
          const onAbort = () => {
            const i = this.waiters.indexOf(entry!);
            if (i >= 0) this.waiters.splice(i, 1);
            reject(signal.reason);
          };
          if (!this.busy) return start();
          state = 'waiting';
          entry = { start };
          this.waiters.push(entry);
          signal.addEventListener('abort', onAbort, { once: true });
        }),
      release: () => {
        if (state === 'released') return;
        if (state === 'waiting') {
          const i = this.waiters.indexOf(entry!);
          if (i >= 0) this.waiters.splice(i, 1);
        }
        const wasRunning = state === 'running';
        state = 'released';
        this.admitted--;
        if (wasRunning) {
          this.busy = false;
          this.waiters.shift()?.start();
        }
      },
    };
  }

  /** Refuses every later request with a 503 carrying `reason`; those admitted keep their place. */
  close(reason: string): void {
    this.closedReason = reason;
  }
}
