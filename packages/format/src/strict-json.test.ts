import fc from 'fast-check';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { HeaderParseError } from './errors.js';
import { readJsonFile } from './file-access.js';
import { isIntegerLiteral, MAX_JSON_DEPTH, parseStrictJson, parseStrictJsonBytes } from './strict-json.js';
import { tempDir } from './test-support/tmp.js';

const where = { file: 'h.json', format: 'json' as const };
const parse = (text: string) => parseStrictJson(text, where);
const bytes = (...parts: (string | number[])[]) => Buffer.concat(parts.map((p) => (typeof p === 'string' ? Buffer.from(p, 'utf8') : Buffer.from(p))));

function rejects(text: string | Uint8Array, message: RegExp): void {
  const run = () => (typeof text === 'string' ? parse(text) : parseStrictJsonBytes(text, where));
  expect(run).toThrow(HeaderParseError);
  expect(run).toThrow(message);
}

describe('strict JSON', () => {
  it('parses what JSON.parse parses, to the same value', () => {
    fc.assert(
      fc.property(fc.jsonValue({ maxDepth: 6 }), (value) => {
        const text = JSON.stringify(value);
        expect(parse(text)).toEqual(JSON.parse(text));
        expect(parse(JSON.stringify(value, null, 2))).toEqual(JSON.parse(text));
      }),
      { numRuns: 300 },
    );
    expect(parse(' {"a": [1, -0, 2.5e-3, true, false, null, "\\u00e9\\ud83d\\ude00\\n"]} ')).toEqual({ a: [1, -0, 0.0025, true, false, null, 'é😀\n'] });
  });

  it('keeps "__proto__" as a plain key', () => {
    const value = parse('{"__proto__": {"polluted": 1}}') as Record<string, unknown>;
    expect(Object.getPrototypeOf(value)).toBe(Object.prototype);
    expect(Object.keys(value)).toEqual(['__proto__']);
    expect(({} as Record<string, unknown>).polluted).toBeUndefined();
  });

  it('tells integer literals from numbers written with a fraction or an exponent', () => {
    const v = parse('{"a": 4096, "b": 4096.0, "c": 4.096e3, "d": [1, 2.0, 3E0, -0], "e": 1.5}') as { d: number[] };
    expect(isIntegerLiteral(v, 'a')).toBe(true);
    expect(isIntegerLiteral(v, 'b')).toBe(false);
    expect(isIntegerLiteral(v, 'c')).toBe(false);
    expect(isIntegerLiteral(v, 'e')).toBe(false);
    expect([0, 1, 2, 3].map((i) => isIntegerLiteral(v.d, i))).toEqual([true, false, false, true]);
  });

  it('rejects duplicate keys at any depth', () => {
    rejects('{"a": 1, "a": 2}', /duplicate key "a"/);
    rejects('{"m": {"x": {"k": 1, "k": 1}}}', /duplicate key "k"/);
    expect(parse('[{"a": 1}, {"a": 2}]')).toEqual([{ a: 1 }, { a: 2 }]);
  });

  it('rejects lone surrogate escapes and keeps pairs', () => {
    rejects('"\\ud800"', /lone surrogate/);
    rejects('"\\udc00\\ud800"', /lone surrogate/);
    rejects('"a\\ud800b"', /lone surrogate/);
    rejects('"\\ud800\\u0041"', /lone surrogate/);
    expect(parse('"\\ud83d\\ude00"')).toBe('😀');
  });

  it('bounds nesting depth without overflowing the stack', () => {
    const deep = (n: number) => '['.repeat(n) + ']'.repeat(n);
    expect(() => parse(deep(MAX_JSON_DEPTH))).not.toThrow();
    rejects(deep(MAX_JSON_DEPTH + 1), /nested deeper than 64/);
    rejects(deep(100_000), /nested deeper than 64/);
    rejects('{"a":'.repeat(100_000), /nested deeper than 64/);
  });

  it('allows only whitespace after the value', () => {
    expect(parse('{} \n\t\r')).toEqual({});
    rejects('{}\0', /bytes after the JSON value/);
    rejects('{} {}', /bytes after the JSON value/);
    rejects('{}x', /bytes after the JSON value/);
  });

  it('rejects a BOM, invalid UTF-8 and what JSON itself forbids', () => {
    rejects(bytes([0xef, 0xbb, 0xbf], '{}'), /byte order mark/);
    rejects(bytes('{"a": "', [0xff], '"}'), /not valid UTF-8.*byte 7/);
    rejects(bytes('"', [0xed, 0xa0, 0x80], '"'), /not valid UTF-8/); // a surrogate encoded in UTF-8
    for (const bad of ['', ' ', '01', '1.', '.5', '+1', '1e', 'NaN', 'Infinity', "{'a': 1}", '{"a" 1}', '[1,]', '{"a":1,}', '"\t"', '"\\x41"', '"\\u12"', 'tru', 'nul', '"abc']) {
      expect(() => parse(bad), JSON.stringify(bad)).toThrow(HeaderParseError);
    }
  });

  it('readJsonFile reads a config strictly, naming the file', async () => {
    const dir = tempDir('kdtree-json-');
    const bad = join(dir, 'config.json');
    writeFileSync(bad, bytes('{"name": "caf', [0xe9], '"}')); // Latin-1 é: not UTF-8
    await expect(readJsonFile(bad, 'model config')).rejects.toThrow(`${bad}: model config is not valid UTF-8, found invalid byte sequence at byte 13`);
    writeFileSync(bad, `{"a": ${'['.repeat(10_000)}}`);
    await expect(readJsonFile(bad, 'model config')).rejects.toThrow(/model config is not valid JSON: nested deeper than 64 levels/);
    await expect(readJsonFile(dir, 'model config')).rejects.toThrow(`${dir}: is a directory, not a regular file`);
    writeFileSync(bad, '{"hidden_size": 7168}');
    expect(await readJsonFile(bad)).toEqual({ hidden_size: 7168 });
  });

  it('names the file and the position', () => {
    expect(() => parse('{"tensors": [1, 2,, 3]}')).toThrow(/^h\.json: header is not valid JSON: unexpected character "," at character 18/);
  });
});
