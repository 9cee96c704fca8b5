import { formatBytes, formatDuration } from './output.js';

export interface ProgressOptions {
  /** 'bytes' shows sizes and throughput; 'items' shows counts. */
  unit?: 'bytes' | 'items';
  stream?: NodeJS.WriteStream;
  enabled?: boolean;
}

/**
 * A progress bar on stderr. On a terminal it redraws one line at most 10 times a second; in logs
 * (not a TTY) it stays quiet for work that ends within 2 seconds, then prints a line every 10%
 * or 10 seconds, so CI output stays short but alive.
 */
export class Progress {
  private readonly start = performance.now();
  private lastDraw = 0;
  private lastLoggedFraction = 0;
  private readonly stream: NodeJS.WriteStream;
  private readonly tty: boolean;
  private readonly enabled: boolean;
  private readonly unit: 'bytes' | 'items';
  private finished = false;
  private logged = false;

  constructor(
    private readonly label: string,
    private readonly total: number,
    options: ProgressOptions = {},
  ) {
    this.stream = options.stream ?? process.stderr;
    this.tty = Boolean(this.stream.isTTY);
    this.enabled = options.enabled ?? true;
    this.unit = options.unit ?? 'bytes';
  }

  update(done: number, note = ''): void {
    if (!this.enabled || this.finished) return;
    const now = performance.now();
    const fraction = this.total > 0 ? Math.min(1, done / this.total) : 1;
    if (this.tty) {
      if (now - this.lastDraw < 100 && done < this.total) return;
      this.lastDraw = now;
      this.stream.write(`\r${this.render(done, fraction, now, note)}\x1b[K`);
    } else if (now - this.start > 2000 && (fraction - this.lastLoggedFraction >= 0.1 || now - this.lastDraw > 10_000)) {
      // Logs: nothing for work that ends within 2 s, then a line per 10% or per 10 s.
      this.lastDraw = now;
      this.lastLoggedFraction = fraction;
      this.logged = true;
      this.stream.write(`${this.render(done, fraction, now, note)}\n`);
    }
  }

  finish(note = ''): void {
    if (!this.enabled || this.finished) return;
    this.finished = true;
    const line = this.render(this.total, 1, performance.now(), note);
    if (this.tty) this.stream.write(`\r${line}\x1b[K\n`);
    else if (this.logged) this.stream.write(`${line}\n`);
  }

  private render(done: number, fraction: number, now: number, note: string): string {
    const width = 24;
    const filled = Math.round(fraction * width);
    const seconds = (now - this.start) / 1000;
    const rate = seconds > 0 ? done / seconds : 0;
    const eta = rate > 0 ? (this.total - done) / rate : Infinity;
    const amount = this.unit === 'bytes' ? `${formatBytes(done)}/${formatBytes(this.total)} ${formatBytes(rate)}/s` : `${done}/${this.total}`;
    const tail = fraction < 1 ? ` eta ${formatDuration(eta)}` : ` in ${formatDuration(seconds)}`;
    return `${this.label} [${'#'.repeat(filled)}${'-'.repeat(width - filled)}] ${(fraction * 100).toFixed(0).padStart(3)}% ${amount}${tail}${note ? ` ${note}` : ''}`;
  }
}
