import { describe, expect, it } from 'vitest';
import { StopMatcher } from './stop-matcher.js';

/** Feeds the pieces; what went out, and whether it stopped. */
function run(stops: string[], pieces: string[]): { out: string[]; stopped: boolean } {
  const m = new StopMatcher(stops);
  const out: string[] = [];
  for (const piece of pieces) {
    const r = m.push(piece);
    out.push(r.text);
    if (r.stopped) return { out, stopped: true };
  }
  out.push(m.flush());
  return { out, stopped: false };
}

describe('StopMatcher', () => {
  it('passes text through at once when no stop sequence could start in it', () => {
    expect(run(['END'], ['hello ', 'world'])).toEqual({ out: ['hello ', 'world', ''], stopped: false });
    expect(run([], ['a', 'END'])).toEqual({ out: ['a', 'END', ''], stopped: false });
  });

  it('holds back an end that a stop sequence starts with, and releases it when the next text settles it', () => {
    expect(run(['END'], ['say E', 'N', 'ough'])).toEqual({ out: ['say ', '', 'ENough', ''], stopped: false });
    expect(run(['END'], ['say E', 'N', 'D and more'])).toEqual({ out: ['say ', '', ''], stopped: true });
  });

  it('cuts at the earliest of several stop sequences; the sequence is not in the text', () => {
    expect(run(['b c', 'c'], ['a b c d'])).toEqual({ out: ['a '], stopped: true });
    expect(run(['xyz', 'y'], ['ax', 'yz'])).toEqual({ out: ['a', ''], stopped: true });
    expect(run(['xyz', 'y'], ['ax', 'y!'])).toEqual({ out: ['a', 'x'], stopped: true });
  });

  it('an answer that ends inside a possible stop sequence gets the held text at the end', () => {
    expect(run(['</answer>'], ['done </ans'])).toEqual({ out: ['done ', '</ans'], stopped: false });
  });

  it('works on whole characters beyond the BMP', () => {
    expect(run(['😀!'], ['hi 😀', '😀!'])).toEqual({ out: ['hi ', '😀'], stopped: true });
  });
});
