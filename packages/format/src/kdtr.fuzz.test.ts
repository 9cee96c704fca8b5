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
import { FormatError } from './errors.js';
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
        const data = await bundle.read(info.name);
        const original = originals.get(info.name);
        if (!failed.has(info.name) && original !== undefined && !Buffer.from(data).equals(original)) {
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
function withHeader(header: unknown): Buffer {
  const view = preambleView(pristine);
  const headerOffset = Number(view.getBigUint64(16, true));
  const text = Buffer.from(JSON.stringify(header) ?? 'null');
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
