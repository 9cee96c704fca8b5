/**
 * Property-based robustness tests: mutate valid KDTR files and require that the reader either
 * rejects them with a typed FormatError or opens them without ever returning silently corrupted
 * tensor data. Any other exception (RangeError from an allocation sized by a hostile field,
 * TypeError from an unchecked field) fails the property. KDTREE_FUZZ_RUNS scales the run count.
 */
import { readFileSync, unlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import fc from 'fast-check';
import { beforeAll, describe, expect, it } from 'vitest';
import { crc32 } from './crc32.js';
import { ChecksumMismatchError, FormatError, HeaderParseError, InvalidFieldError } from './errors.js';
import { KDTR_PREAMBLE_BYTES } from './kdtr-layout.js';
import { openBundle } from './kdtr-reader.js';
import { KdtrWriter } from './kdtr-writer.js';
import { seededBytes, tempDir } from './test-support/tmp.js';

const RUNS = Number(process.env.KDTREE_FUZZ_RUNS ?? 300);
const dir = tempDir('kdtree-fuzz-');
let pristine: Buffer;
const originals = new Map<string, Buffer>();
let caseId = 0;

beforeAll(async () => {
  const file = join(dir, 'base.kdtr');
  const w = await KdtrWriter.create(file, { metadata: { config: { hidden_size: 8 }, golden: [1, 2, 3] } });
  const specs = [
    { name: 'a', dtype: 'F32', shape: [3, 5] },
    { name: 'b.weight', dtype: 'BF16', shape: [4100] },
    { name: 'c', dtype: 'I32', shape: [2, 2, 2] },
    { name: 'empty', dtype: 'U8', shape: [0] },
  ] as const;
  for (const [i, s] of specs.entries()) {
    const n = s.shape.reduce((x: number, y: number) => x * y, 1) * { F32: 4, BF16: 2, I32: 4, U8: 1 }[s.dtype];
    const bytes = Buffer.from(seededBytes(n, 100 + i));
    originals.set(s.name, bytes);
    await w.add({ name: s.name, dtype: s.dtype, shape: s.shape }, bytes);
  }
  await w.close();
  pristine = readFileSync(file);
});

/**
 * Opens `bytes` as a bundle. Returns 'rejected' for a FormatError; rethrows anything else. When it
 * opens, every tensor must read back either with a checksum failure or identical to the original.
 */
async function checkFile(bytes: Uint8Array): Promise<'rejected' | 'opened'> {
  const file = join(dir, `case-${caseId++}.kdtr`);
  writeFileSync(file, bytes);
  try {
    const bundle = await openBundle(file).catch((error: unknown) => {
      if (error instanceof FormatError) return undefined;
      throw error;
    });
    if (bundle === undefined) return 'rejected';
    try {
      const result = await bundle.verify();
      const failed = new Set(result.failures.map((f) => f.tensor));
      for (const info of bundle.tensors) {
        // A plain read checks the CRC: it returns the stored bytes or throws, never other bytes.
        const data = await bundle.read(info.name).catch((error: unknown) => {
          if (error instanceof ChecksumMismatchError && failed.has(info.name)) return undefined;
          throw error;
        });
        if (data === undefined) continue;
        if (failed.has(info.name)) throw new Error(`read() returned tensor '${info.name}' that verify() found corrupt`);
        const original = originals.get(info.name);
        if (original !== undefined && !Buffer.from(data).equals(original)) {
          // A tensor whose name and bytes both changed can't be compared; one that kept its name must match.
          if (info.size === original.length) throw new Error(`silent corruption of tensor '${info.name}'`);
        }
      }
    } catch (error) {
      if (!(error instanceof FormatError)) throw error;
    } finally {
      await bundle.close();
    }
    return 'opened';
  } finally {
    unlinkSync(file);
  }
}

function preambleView(bytes: Buffer): DataView {
  return new DataView(bytes.buffer, bytes.byteOffset, KDTR_PREAMBLE_BYTES);
}

function resealPreamble(bytes: Buffer): void {
  preambleView(bytes).setUint32(60, crc32(bytes.subarray(0, 60)), true);
}

/** Rebuilds the file with a replaced header, with every checksum and length made consistent. */
function withHeader(header: unknown, raw?: string | Buffer): Buffer {
  const view = preambleView(pristine);
  const headerOffset = Number(view.getBigUint64(16, true));
  const text = raw === undefined ? Buffer.from(JSON.stringify(header) ?? 'null') : Buffer.from(raw);
  const out = Buffer.concat([pristine.subarray(0, headerOffset), text]);
  const v = preambleView(out);
  v.setBigUint64(24, BigInt(text.length), true);
  v.setBigUint64(32, BigInt(out.length), true);
  v.setUint32(40, crc32(text), true);
  const tensors = (header as { tensors?: unknown })?.tensors;
  v.setUint32(44, Array.isArray(tensors) ? tensors.length : 0, true);
  resealPreamble(out);
  return out;
}

async function drain(chunks: AsyncIterable<Uint8Array>): Promise<number> {
  let n = 0;
  for await (const c of chunks) n += c.byteLength;
  return n;
}

/** Opens a file that must be rejected while the header is parsed or validated; returns the error. */
async function rejection(bytes: Buffer): Promise<FormatError> {
  const file = join(dir, `reject-${caseId++}.kdtr`);
  writeFileSync(file, bytes);
  try {
    const error = await openBundle(file).then(
      async (b) => {
        await b.close();
        return undefined;
      },
      (e: unknown) => e,
    );
    if (!(error instanceof FormatError)) throw new Error(`expected a FormatError, got ${error === undefined ? 'an open bundle' : String(error)}`);
    return error;
  } finally {
    unlinkSync(file);
  }
}

function pristineHeader(): { metadata: unknown; tensors: Record<string, unknown>[] } {
  const view = preambleView(pristine);
  const headerOffset = Number(view.getBigUint64(16, true));
  return JSON.parse(pristine.subarray(headerOffset).toString('utf8'));
}

const hostileValue = fc.oneof(
  fc.integer({ min: -5, max: 1 << 20 }),
  fc.constantFrom(-1, 0, 1, 4095, 4096, 4097, 2 ** 31, 2 ** 32, 2 ** 32 - 1, 2 ** 53, 2 ** 53 - 1, 2 ** 64, 1e300, 0.5, -0),
  fc.constant(null),
  fc.string({ maxLength: 6 }),
  fc.constantFrom('F32', 'BF16', 'I64', 'F12', ''),
  fc.array(fc.integer({ min: -2, max: 5000 }), { maxLength: 4 }),
  fc.constantFrom([1e9, 1e9, 1e9], [2 ** 40, 2 ** 40], [-1], [0.5]),
  fc.object({ maxDepth: 1 }),
  fc.boolean(),
);

describe('KDTR reader under mutation (fast-check)', () => {
  it('the pristine file opens and verifies', async () => {
    expect(await checkFile(pristine)).toBe('opened');
  });

  it('random byte flips anywhere: typed rejection or no silent corruption', async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.record({ at: fc.nat(), xor: fc.integer({ min: 1, max: 255 }) }), { minLength: 1, maxLength: 8 }),
        async (flips) => {
          const bytes = Buffer.from(pristine);
          for (const { at, xor } of flips) bytes[at % bytes.length] ^= xor;
          await checkFile(bytes);
        },
      ),
      { numRuns: RUNS },
    );
  });

  it('flips inside tensor data are always caught by verify', async () => {
    const header = pristineHeader();
    await fc.assert(
      fc.asyncProperty(fc.nat(), fc.nat(), fc.integer({ min: 1, max: 255 }), async (which, where, xor) => {
        const nonEmpty = header.tensors.filter((t) => (t.size as number) > 0);
        const t = nonEmpty[which % nonEmpty.length];
        const bytes = Buffer.from(pristine);
        bytes[(t.offset as number) + (where % (t.size as number))] ^= xor;
        const file = join(dir, `data-${caseId++}.kdtr`);
        writeFileSync(file, bytes);
        const bundle = await openBundle(file);
        const result = await bundle.verify();
        // Every read path checks the CRC, not only verify().
        await expect(bundle.read(t.name as string)).rejects.toThrow(ChecksumMismatchError);
        await expect(drain(bundle.chunks(t.name as string, { chunkBytes: 4096 }))).rejects.toThrow(ChecksumMismatchError);
        await bundle.close();
        unlinkSync(file);
        expect(result.failures.map((f) => f.tensor)).toEqual([t.name]);
      }),
      { numRuns: RUNS },
    );
  });

  it('truncation and appended bytes are rejected', async () => {
    await fc.assert(
      fc.asyncProperty(fc.nat(), fc.uint8Array({ minLength: 1, maxLength: 64 }), async (cut, extra) => {
        expect(await checkFile(pristine.subarray(0, cut % pristine.length))).toBe('rejected');
        expect(await checkFile(Buffer.concat([pristine, extra]))).toBe('rejected');
      }),
      { numRuns: Math.ceil(RUNS / 2) },
    );
  });

  it('rewritten preamble fields (checksum resealed) never cause untyped errors or huge allocations', async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.constantFrom(8, 10, 12, 16, 24, 32, 40, 44, 48),
        fc.oneof(fc.bigInt({ min: 0n, max: 2n ** 64n - 1n }), fc.constantFrom(0n, 1n, 63n, 64n, 4096n, 2n ** 53n, 2n ** 62n)),
        async (offset, value) => {
          const bytes = Buffer.from(pristine);
          const v = preambleView(bytes);
          if (offset === 16 || offset === 24 || offset === 32) v.setBigUint64(offset, value, true);
          else if (offset === 8 || offset === 10) v.setUint16(offset, Number(value & 0xffffn), true);
          else v.setUint32(offset, Number(value & 0xffffffffn), true);
          resealPreamble(bytes);
          await checkFile(bytes);
        },
      ),
      { numRuns: RUNS },
    );
  });

  it('rewritten header fields (checksums resealed) are validated before use', async () => {
    const fields = ['name', 'dtype', 'shape', 'offset', 'size', 'crc32', 'extra'];
    await fc.assert(
      fc.asyncProperty(fc.nat(), fc.constantFrom(...fields), hostileValue, fc.boolean(), async (which, field, value, remove) => {
        const header = pristineHeader();
        const t = header.tensors[which % header.tensors.length];
        if (remove) delete t[field];
        else t[field] = value;
        await checkFile(withHeader(header));
      }),
      { numRuns: RUNS },
    );
  });

  it('header text the strict JSON rules forbid (checksums resealed) is rejected wherever it is', async () => {
    const text = JSON.stringify(pristineHeader());
    // Positions just after a '{' or ',' where a key starts.
    const keyStarts = [...text.matchAll(/[{,](?=")/g)].map((m) => m.index! + 1);
    const mutations: Record<string, (at: number, n: number) => string | Buffer> = {
      // A key repeated inside the same object: take the key at a key start and insert it again.
      duplicateKey: (at) => {
        const key = /^"(?:[^"\\]|\\.)*"/.exec(text.slice(keyStarts[at % keyStarts.length]))![0];
        const where = keyStarts[at % keyStarts.length];
        return `${text.slice(0, where)}${key}:0,${text.slice(where)}`;
      },
      bom: () => `\ufeff${text}`,
      trailing: (_at, n) => `${text}${['\0', ' x', '{}', '\u0000\u0000', ']', ',', '\u00a0'][n % 7]}`,
      // Valid JSON but for its depth: a key "deep" holding nested arrays, inserted before any key.
      deepNesting: (at, n) => {
        const where = keyStarts[at % keyStarts.length];
        const depth = 64 + (n % 5000); // at the top level: the header object and 64 arrays, 65 levels
        return `${text.slice(0, where)}"deep":${'['.repeat(depth)}${']'.repeat(depth)},${text.slice(where)}`;
      },
      loneSurrogate: (at, n) => {
        const where = keyStarts[at % keyStarts.length] + 1;
        return `${text.slice(0, where)}${['\\ud800', '\\udfff', '\\udbff\\u0041'][n % 3]}${text.slice(where)}`;
      },
      invalidUtf8: (at, n) => {
        const b = Buffer.from(text);
        const i = keyStarts[at % keyStarts.length] + 1;
        return Buffer.concat([b.subarray(0, i), Buffer.from([[0xff], [0xc3, 0x28], [0xed, 0xa0, 0x80], [0xf8, 0x88, 0x80, 0x80, 0x80]][n % 4]), b.subarray(i)]);
      },
    };
    await fc.assert(
      fc.asyncProperty(fc.constantFrom(...Object.keys(mutations)), fc.nat(), fc.nat(), async (kind, at, n) => {
        const raw = mutations[kind](at, n);
        const error = await rejection(withHeader(pristineHeader(), raw));
        expect(error, `${kind} at ${at}`).toBeInstanceOf(HeaderParseError);
      }),
      { numRuns: RUNS },
    );
  });

  it('integer fields written with a fraction or an exponent are rejected; metadata numbers are free', async () => {
    await fc.assert(
      fc.asyncProperty(fc.nat(), fc.constantFrom('offset', 'size', 'crc32', 'shape'), fc.constantFrom('.0', '.00', 'e0', 'E+0', 'e-0'), async (which, field, suffix) => {
        const header = pristineHeader();
        const t = header.tensors[which % header.tensors.length];
        const name = JSON.stringify(t.name);
        const text = JSON.stringify(header);
        const entry = text.indexOf(`"name":${name}`);
        // Rewrite the first number of the field inside this tensor's entry: 4096 -> 4096.0, 4096e0, ...
        const re = new RegExp(`("${field}":\\[?)(\\d+)`, 'g');
        re.lastIndex = entry;
        const m = re.exec(text)!;
        const raw = text.slice(0, m.index) + m[1] + m[2] + suffix + text.slice(m.index + m[0].length);
        const error = await rejection(withHeader(header, raw));
        expect(error).toBeInstanceOf(InvalidFieldError);
        expect(error.field).toBe(field);
        expect(error.tensor).toBe(t.name);
      }),
      { numRuns: Math.ceil(RUNS / 3) },
    );
    // The same spellings inside metadata (free-form JSON) are accepted.
    const header = pristineHeader();
    const raw = JSON.stringify(header).replace('"hidden_size":8', '"hidden_size":8.0,"eps":1e-5,"big":4.096e3');
    const file = join(dir, `meta-${caseId++}.kdtr`);
    writeFileSync(file, withHeader(header, raw));
    const b = await openBundle(file);
    expect(b.metadata.config).toEqual({ hidden_size: 8, eps: 1e-5, big: 4096 });
    await b.close();
  });

  it('unknown keys in entries and at the top are rejected at minor 0, ignored at minor 1', async () => {
    await fc.assert(
      fc.asyncProperty(fc.nat(), fc.string({ minLength: 1, maxLength: 8 }).filter((k) => !['name', 'dtype', 'shape', 'offset', 'size', 'crc32', 'metadata', 'tensors', '__proto__'].includes(k)), fc.jsonValue({ maxDepth: 2 }), fc.boolean(), async (which, key, value, top) => {
        const header = pristineHeader() as Record<string, unknown> & ReturnType<typeof pristineHeader>;
        if (top) header[key] = value;
        else header.tensors[which % header.tensors.length][key] = value;
        const bytes = withHeader(header);
        const error = await rejection(bytes);
        expect(error).toBeInstanceOf(InvalidFieldError);
        expect(error.field).toBe(key);
        const minor1 = Buffer.from(bytes);
        preambleView(minor1).setUint16(10, 1, true);
        resealPreamble(minor1);
        expect(await checkFile(minor1)).toBe('opened');
      }),
      { numRuns: Math.ceil(RUNS / 3) },
    );
  });

  it('zero-element shapes open whatever their other dimensions; nonzero products past 2^53 do not', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(fc.integer({ min: 0, max: Number.MAX_SAFE_INTEGER }), { minLength: 1, maxLength: 6 }), fc.nat(), async (dims, at) => {
        const shape = [...dims];
        shape.splice(at % (shape.length + 1), 0, 0);
        const header = pristineHeader();
        const empty = header.tensors.find((t) => t.name === 'empty')!;
        empty.shape = shape;
        expect(await checkFile(withHeader(header))).toBe('opened');
      }),
      { numRuns: Math.ceil(RUNS / 3) },
    );
    const header = pristineHeader();
    header.tensors.find((t) => t.name === 'empty')!.shape = [2 ** 30, 2 ** 30, 2 ** 30];
    expect(await checkFile(withHeader(header))).toBe('rejected');
  });

  it('structural header rewrites: duplicates, reordering, wrong top-level types', async () => {
    const rewrites: ((h: ReturnType<typeof pristineHeader>) => unknown)[] = [
      (h) => ({ ...h, tensors: [...h.tensors, h.tensors[0]] }),
      (h) => ({ ...h, tensors: [...h.tensors].reverse() }),
      (h) => ({ ...h, tensors: h.tensors.map((t) => ({ ...t, name: 'same' })) }),
      (h) => ({ ...h, tensors: h.tensors.map((t, i) => (i === 1 ? { ...t, offset: h.tensors[0].offset } : t)) }),
      (h) => ({ ...h, metadata: [] }),
      (h) => ({ ...h, metadata: null }),
      (h) => ({ metadata: h.metadata }),
      (h) => ({ ...h, tensors: {} }),
      (h) => ({ ...h, extra: 1 }),
      () => [],
      () => 'text',
      () => null,
    ];
    for (const rewrite of rewrites) {
      expect(await checkFile(withHeader(rewrite(pristineHeader())))).toBe('rejected');
    }
    await fc.assert(
      fc.asyncProperty(fc.jsonValue({ maxDepth: 3 }), async (json) => {
        // Almost every random JSON value is rejected; the rare valid empty table may open.
        await checkFile(withHeader(json));
      }),
      { numRuns: Math.ceil(RUNS / 3) },
    );
  });
});
