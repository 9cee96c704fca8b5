/**
 * The OpenAI `stop` parameter on streamed text: text passes through as it arrives, except an end
 * that could be the start of a stop sequence, which is held back until the next text settles it.
 * When a stop sequence completes, the text before it is the last to go out (the sequence itself
 * is not part of the answer, as in the OpenAI API).
 */
export class StopMatcher {
  private held = '';
  private stopped = false;

  constructor(private readonly stops: readonly string[]) {}

  /** The text that can go out now, and whether a stop sequence ended the answer. */
  push(text: string): { text: string; stopped: boolean } {
    if (this.stopped) return { text: '', stopped: true };
    if (this.stops.length === 0) return { text, stopped: false };
    const buffer = this.held + text;
    let cut = -1;
    for (const stop of this.stops) {
      const at = buffer.indexOf(stop);
      if (at >= 0 && (cut < 0 || at < cut)) cut = at;
    }
    if (cut >= 0) {
      this.held = '';
      this.stopped = true;
      return { text: buffer.slice(0, cut), stopped: true };
    }
    // the longest end of the buffer that a stop sequence starts with
    let keep = 0;
    for (const stop of this.stops) {
      for (let k = Math.min(stop.length - 1, buffer.length); k > keep; k--) {
        if (buffer.endsWith(stop.slice(0, k))) {
          keep = k;
          break;
        }
      }
    }
    this.held = buffer.slice(buffer.length - keep);
    return { text: buffer.slice(0, buffer.length - keep), stopped: false };
  }

  /** The answer ended without a stop sequence: what was held back goes out. */
  flush(): string {
    const text = this.held;
    this.held = '';
    return text;
  }
}
