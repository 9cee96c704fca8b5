/**
 * Strict JSON for headers, indexes and config files (RFC 8259 as restricted by I-JSON, RFC 7493):
 *
 * - UTF-8 without a byte order mark; invalid UTF-8 is an error, never U+FFFD;
 * - no duplicate keys in any object (JSON.parse keeps the last one silently);
 * - no lone surrogate escapes (`"\ud800"`), which have no UTF-8 encoding;
 * - nesting at most MAX_JSON_DEPTH arrays/objects deep (JSON.parse overflows the stack near 5000);
 * - one value, with only JSON whitespace around it.
 *
 * It also records which numbers were written as integers (`-?(0|[1-9][0-9]*)`, no fraction, no
 * exponent), because KDTR's integer fields must be written that way: `2.0` and `4.096e3` are JSON
 * numbers of integral value but not integers in the spec's sense, and a strict reader in another
 * language (Python's json, Rust's serde_json with u64 fields) rejects them.
 */
import { HeaderParseError, truncate, type ErrorFormat } from './errors.js';

/** Deepest nesting of arrays and objects accepted (a HuggingFace config nests 3-4 levels). */
export const MAX_JSON_DEPTH = 64;

const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/** Numbers in `container[key]` that were written with a fraction or an exponent. */
const nonIntegerLiterals = new WeakMap<object, Set<string | number>>();

/**
 * Whether `container[key]` is a number written as a JSON integer literal (no fraction, no
 * exponent). Values that did not come from parseStrictJson count as integers when integral.
 */
export function isIntegerLiteral(container: object, key: string | number): boolean {
  const value = (container as Record<string | number, unknown>)[key];
  if (typeof value !== 'number' || !Number.isInteger(value)) return false;
  return !(nonIntegerLiterals.get(container)?.has(key) ?? false);
}

export interface StrictJsonContext {
  file: string;
  format: ErrorFormat;
  /** What the bytes are, for messages: "header", "index", "model config". */
  what?: string;
}

/** Decodes UTF-8 (no BOM, fatal on invalid sequences) and parses strictly. */
export function parseStrictJsonBytes(bytes: Uint8Array, context: StrictJsonContext): unknown {
  const what = context.what ?? 'header';
  if (bytes.byteLength >= 3 && bytes[0] === 0xef && bytes[1] === 0xbb && bytes[2] === 0xbf) {
    throw new HeaderParseError(`${what} starts with a UTF-8 byte order mark`, { file: context.file, format: context.format, expected: 'UTF-8 JSON without a BOM' });
  }
  let text: string;
  try {
    text = utf8.decode(bytes);
  } catch (cause) {
    const at = firstInvalidUtf8(bytes);
    throw new HeaderParseError(`${what} is not valid UTF-8`, { file: context.file, format: context.format, actual: `invalid byte sequence at byte ${at}`, cause });
  }
  return parseStrictJson(text, context);
}

/** Parses JSON text strictly (see the module comment); errors name the character offset. */
export function parseStrictJson(text: string, context: StrictJsonContext): unknown {
  return new Parser(text, context).parseDocument();
}

class Parser {
  private i = 0;
  private readonly what: string;

  constructor(
    private readonly s: string,
    private readonly context: StrictJsonContext,
  ) {
    this.what = context.what ?? 'header';
  }

  parseDocument(): unknown {
    this.skipSpace();
    if (this.i >= this.s.length) throw this.fail('is empty', 'a JSON value');
    const value = this.parseValue(0);
    this.skipSpace();
    if (this.i < this.s.length) throw this.fail('has bytes after the JSON value', 'only whitespace after the value');
    return value;
  }

  private fail(message: string, expected?: string): HeaderParseError {
    const near = this.s.slice(Math.max(0, this.i - 20), this.i + 20);
    return new HeaderParseError(`${this.what} is not valid JSON: ${message} at character ${this.i}`, {
      file: this.context.file,
      format: this.context.format,
      expected,
      actual: truncate(JSON.stringify(near), 80),
    });
  }

  private skipSpace(): void {
    const s = this.s;
    let i = this.i;
    for (;;) {
      const c = s.charCodeAt(i);
      if (c === 0x20 || c === 0x0a || c === 0x0d || c === 0x09) i++;
      else break;
    }
    this.i = i;
  }

  private parseValue(depth: number): unknown {
    const c = this.s.charCodeAt(this.i);
    switch (c) {
      case 0x7b /* { */:
        return this.parseObject(depth + 1);
      case 0x5b /* [ */:
        return this.parseArray(depth + 1);
      case 0x22 /* " */:
        return this.parseString();
      case 0x74 /* t */:
        return this.literal('true', true);
      case 0x66 /* f */:
        return this.literal('false', false);
      case 0x6e /* n */:
        return this.literal('null', null);
      default:
        if (c === 0x2d || (c >= 0x30 && c <= 0x39)) return this.parseNumber();
        throw this.fail(Number.isNaN(c) ? 'ends early' : `unexpected character ${JSON.stringify(this.s[this.i])}`, 'a JSON value');
    }
  }

  private literal<T>(word: string, value: T): T {
    if (!this.s.startsWith(word, this.i)) throw this.fail('unexpected word', `"${word}"`);
    this.i += word.length;
    return value;
  }

  private checkDepth(depth: number): void {
    if (depth > MAX_JSON_DEPTH) throw this.fail(`nested deeper than ${MAX_JSON_DEPTH} levels`, `at most ${MAX_JSON_DEPTH} nested arrays/objects`);
  }

  private parseObject(depth: number): Record<string, unknown> {
    this.checkDepth(depth);
    this.i++;
    const out: Record<string, unknown> = {};
    this.skipSpace();
    if (this.s.charCodeAt(this.i) === 0x7d /* } */) {
      this.i++;
      return out;
    }
    for (;;) {
      this.skipSpace();
      if (this.s.charCodeAt(this.i) !== 0x22) throw this.fail('expected a string key', '"key": value');
      const keyAt = this.i;
      const key = this.parseString();
      if (Object.hasOwn(out, key)) {
        this.i = keyAt;
        throw this.fail(`duplicate key ${truncate(JSON.stringify(key), 60)}`, 'each key once per object');
      }
      this.skipSpace();
      if (this.s.charCodeAt(this.i) !== 0x3a /* : */) throw this.fail('expected ":"', '"key": value');
      this.i++;
      this.skipSpace();
      const numberAt = this.s.charCodeAt(this.i);
      const value = this.parseValue(depth);
      if ((numberAt === 0x2d || (numberAt >= 0x30 && numberAt <= 0x39)) && this.lastNumberNonInteger) markNonInteger(out, key);
      // An own data property even for "__proto__" (an assignment would set the prototype instead).
      if (key === '__proto__') Object.defineProperty(out, key, { value, enumerable: true, writable: true, configurable: true });
      else out[key] = value;
      this.skipSpace();
      const c = this.s.charCodeAt(this.i);
      this.i++;
      if (c === 0x2c /* , */) continue;
      if (c === 0x7d /* } */) return out;
      this.i--;
      throw this.fail('expected "," or "}"');
    }
  }

  private parseArray(depth: number): unknown[] {
    this.checkDepth(depth);
    this.i++;
    const out: unknown[] = [];
    this.skipSpace();
    if (this.s.charCodeAt(this.i) === 0x5d /* ] */) {
      this.i++;
      return out;
    }
    for (;;) {
      this.skipSpace();
      const numberAt = this.s.charCodeAt(this.i);
      out.push(this.parseValue(depth));
      if ((numberAt === 0x2d || (numberAt >= 0x30 && numberAt <= 0x39)) && this.lastNumberNonInteger) markNonInteger(out, out.length - 1);
      this.skipSpace();
      const c = this.s.charCodeAt(this.i);
      this.i++;
      if (c === 0x2c) continue;
      if (c === 0x5d) return out;
      this.i--;
      throw this.fail('expected "," or "]"');
    }
  }

  private lastNumberNonInteger = false;

  private parseNumber(): number {
    const s = this.s;
    const start = this.i;
    let i = start;
    if (s.charCodeAt(i) === 0x2d) i++;
    const first = s.charCodeAt(i);
    if (first === 0x30) i++;
    else if (first >= 0x31 && first <= 0x39) while (isDigit(s.charCodeAt(i))) i++;
    else {
      this.i = i;
      throw this.fail('bad number', 'a digit');
    }
    let integer = true;
    if (s.charCodeAt(i) === 0x2e /* . */) {
      integer = false;
      i++;
      if (!isDigit(s.charCodeAt(i))) {
        this.i = i;
        throw this.fail('bad number', 'a digit after "."');
      }
      while (isDigit(s.charCodeAt(i))) i++;
    }
    const e = s.charCodeAt(i);
    if (e === 0x65 || e === 0x45) {
      integer = false;
      i++;
      const sign = s.charCodeAt(i);
      if (sign === 0x2b || sign === 0x2d) i++;
      if (!isDigit(s.charCodeAt(i))) {
        this.i = i;
        throw this.fail('bad number', 'a digit in the exponent');
      }
      while (isDigit(s.charCodeAt(i))) i++;
    }
    this.i = i;
    this.lastNumberNonInteger = !integer;
    return Number(s.slice(start, i));
  }

  private parseString(): string {
    const s = this.s;
    let i = this.i + 1;
    let out = '';
    let runStart = i;
    for (;;) {
      const c = s.charCodeAt(i);
      if (c === 0x22) {
        out += s.slice(runStart, i);
        this.i = i + 1;
        return out;
      }
      if (Number.isNaN(c)) {
        this.i = i;
        throw this.fail('string not terminated', '"');
      }
      if (c < 0x20) {
        this.i = i;
        throw this.fail('control character in a string', 'control characters escaped (\\n, \\u0000)');
      }
      if (c === 0x5c /* \ */) {
        out += s.slice(runStart, i);
        const esc = s.charCodeAt(i + 1);
        i += 2;
        switch (esc) {
          case 0x22: out += '"'; break;
          case 0x5c: out += '\\'; break;
          case 0x2f: out += '/'; break;
          case 0x62: out += '\b'; break;
          case 0x66: out += '\f'; break;
          case 0x6e: out += '\n'; break;
          case 0x72: out += '\r'; break;
          case 0x74: out += '\t'; break;
          case 0x75 /* u */: {
            const unit = this.hex4(i);
            i += 4;
            if (unit >= 0xd800 && unit <= 0xdbff) {
              const low = s.charCodeAt(i) === 0x5c && s.charCodeAt(i + 1) === 0x75 ? this.hex4(i + 2) : -1;
              if (low < 0xdc00 || low > 0xdfff) {
                this.i = i - 6;
                throw this.fail('lone surrogate escape', 'a high surrogate followed by a low one (I-JSON)');
              }
              out += String.fromCharCode(unit, low);
              i += 6;
            } else if (unit >= 0xdc00 && unit <= 0xdfff) {
              this.i = i - 6;
              throw this.fail('lone surrogate escape', 'a low surrogate only after a high one (I-JSON)');
            } else {
              out += String.fromCharCode(unit);
            }
            break;
          }
          default:
            this.i = i - 2;
            throw this.fail('bad escape', 'one of \\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX');
        }
        runStart = i;
        continue;
      }
      i++;
    }
  }

  private hex4(at: number): number {
    const h = this.s.slice(at, at + 4);
    if (!/^[0-9a-fA-F]{4}$/.test(h)) {
      this.i = at;
      throw this.fail('bad \\u escape', 'four hex digits');
    }
    return Number.parseInt(h, 16);
  }
}

function isDigit(c: number): boolean {
  return c >= 0x30 && c <= 0x39;
}

function markNonInteger(container: object, key: string | number): void {
  let set = nonIntegerLiterals.get(container);
  if (set === undefined) nonIntegerLiterals.set(container, (set = new Set()));
  set.add(key);
}

/** Byte offset of the first invalid UTF-8 sequence (for messages). */
function firstInvalidUtf8(bytes: Uint8Array): number {
  let i = 0;
  while (i < bytes.length) {
    const b = bytes[i];
    const n = b < 0x80 ? 1 : b >= 0xc2 && b < 0xe0 ? 2 : b >= 0xe0 && b < 0xf0 ? 3 : b >= 0xf0 && b < 0xf5 ? 4 : 0;
    if (n === 0 || i + n > bytes.length) return i;
    try {
      utf8.decode(bytes.subarray(i, i + n));
    } catch {
      return i;
    }
    i += n;
  }
  return i;
}
