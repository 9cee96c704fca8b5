#!/usr/bin/env node
// Writes the KDTR v1 conformance set: valid and invalid files, each with the rule of
// docs/format/kdtr-v1.md it exercises, and manifest.json saying what a conforming reader must do.
//
//   node packages/format/scripts/gen-conformance.mjs [OUT_DIR]   (default: packages/format/conformance)
//
// Files are assembled byte by byte here (node:zlib's CRC-32, no code of @kdtree/format), so the
// set checks the reader against the text rather than against our own writer. Output is
// deterministic: running it again gives the same bytes (a test checks the committed set is that).
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { crc32 } from 'node:zlib';

const ALIGN = 4096;
const MAGIC = Buffer.from('KDTR\r\n\x1a\n', 'latin1');
const SIZES = { F64: 8, F32: 4, F16: 2, BF16: 2, I64: 8, I32: 4, I16: 2, I8: 1, U64: 8, U32: 4, U16: 2, U8: 1, BOOL: 1, F8_E4M3: 1, F8_E5M2: 1 };

/** Deterministic bytes (xorshift32). */
function bytes(n, seed) {
  const out = Buffer.alloc(n);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    out[i] = x & 0xff;
  }
  return out;
}

const alignUp = (n) => Math.ceil(n / ALIGN) * ALIGN;

/**
 * Lays tensors out as the spec's writer does: from 4096, each at the next multiple of 4096.
 * `gapPages` inserts empty pages before a tensor (valid: padding between tensors).
 */
function layout(specs) {
  let position = ALIGN;
  const data = [];
  const entries = [];
  for (const [i, s] of specs.entries()) {
    const count = s.shape.reduce((a, b) => a * b, 1);
    const payload = s.data ?? bytes(count * SIZES[s.dtype], 100 + i);
    position += (s.gapPages ?? 0) * ALIGN;
    entries.push({ name: s.name, dtype: s.dtype, shape: s.shape, offset: position, size: payload.length, crc32: crc32(payload) });
    data.push({ offset: position, bytes: payload });
    position = alignUp(position + payload.length);
  }
  const last = entries.at(-1);
  return { data, entries, end: last ? last.offset + last.size : ALIGN };
}

/**
 * A whole file from its parts. `header` is the header's bytes or text (written verbatim, so a
 * case can hold JSON that JSON.stringify would never produce); every length and checksum is made
 * consistent unless the case overrides it.
 */
function assemble({ data = [], header, headerOffset, tensorCount, versionMajor = 1, versionMinor = 0, alignment = ALIGN, reserved, fileLength, headerCrc32, preambleCrc32Xor = 0, trailing }) {
  const headerBytes = typeof header === 'string' ? Buffer.from(header, 'utf8') : Buffer.from(header);
  const end = data.reduce((m, d) => Math.max(m, d.offset + d.bytes.length), 0);
  const offset = headerOffset ?? Math.max(end, ALIGN);
  const total = Math.max(offset + headerBytes.length, end);
  const file = Buffer.alloc(total);
  for (const d of data) d.bytes.copy(file, d.offset);
  headerBytes.copy(file, offset);
  const p = Buffer.alloc(64);
  MAGIC.copy(p, 0);
  p.writeUInt16LE(versionMajor, 8);
  p.writeUInt16LE(versionMinor, 10);
  p.writeUInt32LE(alignment, 12);
  p.writeBigUInt64LE(BigInt(offset), 16);
  p.writeBigUInt64LE(BigInt(headerBytes.length), 24);
  p.writeBigUInt64LE(BigInt(fileLength ?? total), 32);
  p.writeUInt32LE(headerCrc32 ?? crc32(headerBytes), 40);
  p.writeUInt32LE(tensorCount ?? 0, 44);
  if (reserved) Buffer.from(reserved).copy(p, 48);
  p.writeUInt32LE((crc32(p.subarray(0, 60)) ^ preambleCrc32Xor) >>> 0, 60);
  p.copy(file, 0);
  return trailing ? Buffer.concat([file, Buffer.from(trailing)]) : file;
}

/** A standard file from tensor specs, with hooks to rewrite entries, the header text or the preamble. */
function kdtr(specs, { metadata = {}, entries: rewrite = (e) => e, text: retext = (t) => t, tensorCount, ...preamble } = {}) {
  const { data, entries } = layout(specs);
  const rows = rewrite(entries.map((e) => ({ ...e })));
  const header = retext(JSON.stringify({ metadata, tensors: rows }));
  return assemble({ data, header, tensorCount: tensorCount ?? (Array.isArray(rows) ? rows.length : 0), ...preamble });
}

const F32 = (name, values) => ({ name, dtype: 'F32', shape: [values.length], data: Buffer.from(new Float32Array(values).buffer) });
const W = { name: 'w', dtype: 'F32', shape: [2, 3] };
const B = { name: 'b', dtype: 'BF16', shape: [4100] };

/** [file, expect, section, description, error?, build] */
const CASES = [
  // Valid files.
  ['valid/spec-example.kdtr', 'valid', '8', 'the worked example of the spec, byte for byte', null, () => kdtr([F32('w', [1, -2])], { metadata: { config: { hidden_size: 2 } } })],
  ['valid/empty-bundle.kdtr', 'valid', '2, 6', 'no tensors: the header at 4096', null, () => kdtr([])],
  ['valid/every-dtype.kdtr', 'valid', '4.2', 'one tensor of each dtype, a scalar and an empty tensor', null, () => kdtr([
    ...Object.keys(SIZES).map((dtype, i) => ({ name: `t.${dtype}`, dtype, shape: [3, i + 1] })),
    { name: 'scalar', dtype: 'F64', shape: [] },
    { name: 'empty', dtype: 'F32', shape: [0, 7] },
  ])],
  ['valid/zero-product-huge-dims.kdtr', 'valid', '4.1', 'a zero dimension beside dimensions near 2^53: 0 elements, size 0', null, () => kdtr([{ name: 'z', dtype: 'F32', shape: [4503599627370496, 9007199254740991, 0] }, W])],
  ['valid/gap-between-tensors.kdtr', 'valid', '4.1', 'padding pages between tensors and before the header', null, () => kdtr([W, { ...B, gapPages: 3 }], { headerOffset: 5 * ALIGN + 8200 + 100 /* B ends at 5 x 4096 + 8200 */ })],
  ['valid/header-whitespace.kdtr', 'valid', '4', 'JSON whitespace before and after the header value', null, () => kdtr([W], { text: (t) => ` \n\t${t}\r\n  ` })],
  ['valid/unicode-names.kdtr', 'valid', '4.1', 'names in UTF-8 and as escaped surrogate pairs, 4096 bytes long', null, () => kdtr([
    { name: 'ünï.wéight', dtype: 'U8', shape: [3] },
    { name: '\u{1F600}', dtype: 'U8', shape: [1] },
    { name: 'x'.repeat(4096), dtype: 'U8', shape: [1] },
  ], { text: (t) => t.replace('"\u{1F600}"', '"\\ud83d\\ude00"') })],
  ['valid/metadata-any-json.kdtr', 'valid', '4.3', 'metadata is free-form: fractions, exponents, negative numbers; nesting to 64 levels (header object 1, metadata 2, 62 arrays)', null, () => kdtr([W], { metadata: { eps: 1e-5, two: 2.0, big: 4.096e3, neg: -7, deep: JSON.parse('['.repeat(62) + ']'.repeat(62)) }, text: (t) => t.replace('"two":2', '"two":2.0').replace('"big":4096', '"big":4.096e3') })],
  ['valid/minor-1-unknown-keys.kdtr', 'valid', '3, 9', 'version 1.1: unknown keys at the top and in entries are ignored', null, () => kdtr([W], { versionMinor: 1, entries: (e) => e.map((t) => ({ ...t, future: { x: 1 } })), text: (t) => t.replace(/}$/, ',"index":{}}') })],
  ['valid/negative-zero.kdtr', 'valid', '4.1', 'an integer written -0 is 0 (the integer grammar allows the sign)', null, () => kdtr([{ name: 'e', dtype: 'U8', shape: [0] }], { text: (t) => t.replace('"crc32":0', '"crc32":-0') })],

  // Preamble.
  ['invalid/bad-magic.kdtr', 'invalid', '3', 'magic with LF CR swapped (a text-mode transfer)', ['KDTREE_BAD_MAGIC'], () => { const f = kdtr([W]); f[4] = 0x0a; f[5] = 0x0d; return f; }],
  ['invalid/short-file.kdtr', 'invalid', '5.1', 'the magic and nothing else', ['KDTREE_TRUNCATED'], () => Buffer.from(MAGIC)],
  ['invalid/preamble-crc.kdtr', 'invalid', '3', 'preamble_crc32 off by one bit', ['KDTREE_CHECKSUM_MISMATCH', 'preamble_crc32'], () => kdtr([W], { preambleCrc32Xor: 1 })],
  ['invalid/major-2.kdtr', 'invalid', '3', 'version_major 2', ['KDTREE_UNSUPPORTED_VERSION', 'version_major'], () => kdtr([W], { versionMajor: 2 })],
  ['invalid/alignment-64.kdtr', 'invalid', '3', 'alignment 64', ['KDTREE_INVALID_FIELD', 'alignment'], () => kdtr([W], { alignment: 64 })],
  ['invalid/reserved-nonzero.kdtr', 'invalid', '3', 'a reserved byte set', ['KDTREE_INVALID_FIELD', 'reserved'], () => kdtr([W], { reserved: [0, 0, 0, 0, 0, 1] })],
  ['invalid/u64-above-2-53.kdtr', 'invalid', '3', 'file_length 2^53', ['KDTREE_INVALID_FIELD', 'file_length'], () => kdtr([W], { fileLength: 2 ** 53 })],
  ['invalid/truncated.kdtr', 'invalid', '5.2', 'the last header byte cut off', ['KDTREE_TRUNCATED', 'file_length'], () => kdtr([W]).subarray(0, -1)],
  ['invalid/trailing-bytes.kdtr', 'invalid', '5.2', 'one byte after file_length', ['KDTREE_INVALID_FIELD', 'file_length'], () => kdtr([W], { trailing: [0x0a] })],
  ['invalid/header-offset-64.kdtr', 'invalid', '3, 5.2', 'an empty bundle whose header starts at 64 (inside the preamble page)', ['KDTREE_INVALID_FIELD', 'header_offset'], () => assemble({ header: '{"metadata":{},"tensors":[]}', headerOffset: 64 })],
  ['invalid/header-crc.kdtr', 'invalid', '5.4', 'header_crc32 of another header', ['KDTREE_CHECKSUM_MISMATCH', 'header_crc32'], () => kdtr([W], { headerCrc32: 12345 })],

  // Header bytes and JSON.
  ['invalid/header-bom.kdtr', 'invalid', '4', 'the header starts with a UTF-8 byte order mark', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { text: (t) => `\ufeff${t}` })],
  ['invalid/header-bad-utf8.kdtr', 'invalid', '4', 'a Latin-1 byte in a name (not UTF-8)', ['KDTREE_HEADER_PARSE'], () => { const f = kdtr([{ ...W, name: 'caf_' }]); f[f.indexOf('caf_', ALIGN) + 3] = 0xe9; return reseal(f); }],
  ['invalid/header-nul-padding.kdtr', 'invalid', '4', 'NUL bytes after the JSON value, inside header_length', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { text: (t) => `${t}\0\0\0\0` })],
  ['invalid/header-two-values.kdtr', 'invalid', '4', 'a second JSON value after the header object', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { text: (t) => `${t} {}` })],
  ['invalid/duplicate-key-entry.kdtr', 'invalid', '4', 'a tensor entry with "offset" twice', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { text: (t) => t.replace('"offset":4096', '"offset":8192,"offset":4096') })],
  ['invalid/duplicate-key-metadata.kdtr', 'invalid', '4', 'metadata with a key twice', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { metadata: { a: 1 }, text: (t) => t.replace('"a":1', '"a":1,"a":2') })],
  ['invalid/lone-surrogate-name.kdtr', 'invalid', '4', 'a name holding an escaped lone surrogate', ['KDTREE_HEADER_PARSE'], () => kdtr([{ ...W, name: 'w?' }], { text: (t) => t.replace('"w?"', '"w\\ud800"') })],
  ['invalid/nesting-65.kdtr', 'invalid', '4', 'nesting of 65 levels: the header object, metadata and 63 arrays', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { metadata: { deep: 0 }, text: (t) => t.replace('"deep":0', `"deep":${'['.repeat(63)}${']'.repeat(63)}`) })],
  ['invalid/nesting-100000.kdtr', 'invalid', '4', 'arrays nested 100000 deep (a stack overflow for a recursive parser)', ['KDTREE_HEADER_PARSE'], () => kdtr([W], { metadata: { deep: 0 }, text: (t) => t.replace('"deep":0', `"deep":${'['.repeat(100000)}${']'.repeat(100000)}`) })],
  ['invalid/header-not-object.kdtr', 'invalid', '4', 'the header is a JSON array', ['KDTREE_HEADER_PARSE'], () => assemble({ header: '[]' })],
  ['invalid/unknown-top-key.kdtr', 'invalid', '5.5', 'version 1.0 with a third top-level key', ['KDTREE_INVALID_FIELD', 'index'], () => kdtr([W], { text: (t) => t.replace(/}$/, ',"index":{}}') })],
  ['invalid/unknown-entry-key.kdtr', 'invalid', '4.1, 5.6', 'version 1.0 with an unknown key in a tensor entry', ['KDTREE_INVALID_FIELD', 'layout'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, layout: 'row-major' })) })],
  ['invalid/metadata-array.kdtr', 'invalid', '5.5', 'metadata is an array', ['KDTREE_INVALID_FIELD', 'metadata'], () => kdtr([W], { metadata: [] })],
  ['invalid/tensor-count.kdtr', 'invalid', '5.5', 'tensor_count one more than the entries', ['KDTREE_INVALID_FIELD', 'tensor_count'], () => kdtr([W], { tensorCount: 2 })],

  // Integers.
  ['invalid/offset-with-fraction.kdtr', 'invalid', '4.1', 'offset written 4096.0', ['KDTREE_INVALID_FIELD', 'offset'], () => kdtr([W], { text: (t) => t.replace('"offset":4096', '"offset":4096.0') })],
  ['invalid/size-with-exponent.kdtr', 'invalid', '4.1', 'size written 2.4e1', ['KDTREE_INVALID_FIELD', 'size'], () => kdtr([W], { text: (t) => t.replace('"size":24', '"size":2.4e1') })],
  ['invalid/shape-with-fraction.kdtr', 'invalid', '4.1', 'a dimension written 2.0', ['KDTREE_INVALID_FIELD', 'shape'], () => kdtr([W], { text: (t) => t.replace('"shape":[2,3]', '"shape":[2.0,3]') })],
  ['invalid/crc-with-exponent.kdtr', 'invalid', '4.1', 'crc32 written with an exponent', ['KDTREE_INVALID_FIELD', 'crc32'], () => kdtr([{ name: 'e', dtype: 'U8', shape: [0] }], { text: (t) => t.replace('"crc32":0', '"crc32":0e0') })],
  ['invalid/dim-2-53.kdtr', 'invalid', '4.1', 'a dimension of 2^53 (above 2^53 - 1) beside a zero', ['KDTREE_INVALID_FIELD', 'shape'], () => kdtr([{ name: 'z', dtype: 'U8', shape: [0] }], { text: (t) => t.replace('"shape":[0]', '"shape":[0,9007199254740992]') })],
  ['invalid/negative-dim.kdtr', 'invalid', '4.1', 'a dimension of -1', ['KDTREE_INVALID_FIELD', 'shape'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, shape: [-1, -6] })) })],
  ['invalid/crc-above-u32.kdtr', 'invalid', '4.1', 'crc32 of 2^32', ['KDTREE_INVALID_FIELD', 'crc32'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, crc32: 2 ** 32 })) })],

  // Entries.
  ['invalid/rank-17.kdtr', 'invalid', '4.1', '17 dimensions', ['KDTREE_INVALID_FIELD', 'shape'], () => kdtr([{ name: 'r', dtype: 'U8', shape: Array(17).fill(1) }])],
  ['invalid/unknown-dtype.kdtr', 'invalid', '4.2', 'dtype "F12"', ['KDTREE_UNKNOWN_DTYPE', 'dtype'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, dtype: 'F12' })) })],
  ['invalid/dtype-lowercase.kdtr', 'invalid', '4.2', 'dtype "f32" (names are case-sensitive)', ['KDTREE_UNKNOWN_DTYPE', 'dtype'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, dtype: 'f32' })) })],
  ['invalid/size-mismatch.kdtr', 'invalid', '4.1', 'size 4 bytes short of shape x dtype', ['KDTREE_SHAPE_SIZE_MISMATCH', 'size'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, size: t.size - 4 })) })],
  ['invalid/misaligned.kdtr', 'invalid', '4.1', 'an offset of 4160', ['KDTREE_MISALIGNED', 'offset'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, offset: 4160 })) })],
  ['invalid/offset-in-preamble-page.kdtr', 'invalid', '4.1', 'an offset of 0', ['KDTREE_OVERLAP', 'offset'], () => kdtr([W], { entries: (e) => e.map((t) => ({ ...t, offset: 0 })) })],
  ['invalid/overlap.kdtr', 'invalid', '4.1', 'two tensors at the same offset', ['KDTREE_OVERLAP', 'offset'], () => kdtr([W, B], { entries: (e) => [e[0], { ...e[1], offset: e[0].offset }] })],
  ['invalid/out-of-order.kdtr', 'invalid', '4.1', 'entries not in file order', ['KDTREE_OVERLAP', 'offset'], () => kdtr([W, B], { entries: (e) => [e[1], e[0]] })],
  ['invalid/runs-into-header.kdtr', 'invalid', '4.1', 'offset + size past header_offset', ['KDTREE_OUT_OF_RANGE', 'size'], () => kdtr([W], { headerOffset: ALIGN + 16 })],
  ['invalid/duplicate-name.kdtr', 'invalid', '4.1', 'two tensors named "w"', ['KDTREE_DUPLICATE_TENSOR', 'tensors[1].name'], () => kdtr([W, { ...B, name: 'w' }])],
  ['invalid/empty-name.kdtr', 'invalid', '4.1', 'an empty name', ['KDTREE_INVALID_FIELD', 'tensors[0].name'], () => kdtr([{ ...W, name: '' }])],
  ['invalid/nul-in-name.kdtr', 'invalid', '4.1', 'a NUL in a name', ['KDTREE_INVALID_FIELD', 'tensors[0].name'], () => kdtr([{ ...W, name: 'a\0b' }])],
  ['invalid/name-4097-bytes.kdtr', 'invalid', '4.1', 'a name of 4097 UTF-8 bytes in 2049 characters (the limit counts bytes)', ['KDTREE_INVALID_FIELD', 'tensors[0].name'], () => kdtr([{ ...W, name: `${'é'.repeat(2048)}x` }])],
  ['invalid/data-crc.kdtr', 'invalid', '4.1, 5', 'one flipped bit in tensor data: opens, fails when the tensor is read', ['KDTREE_CHECKSUM_MISMATCH', 'crc32'], () => { const f = kdtr([W, B]); f[ALIGN + 5] ^= 0x10; return f; }],
  ['invalid/empty-tensor-crc.kdtr', 'invalid', '4.1', 'an empty tensor whose crc32 is not 0', ['KDTREE_CHECKSUM_MISMATCH', 'crc32'], () => kdtr([{ name: 'e', dtype: 'U8', shape: [0] }], { entries: (e) => e.map((t) => ({ ...t, crc32: 1 })) })],
];

/** Recomputes header_crc32 and preamble_crc32 after a byte of the header was edited. */
function reseal(file) {
  const offset = Number(file.readBigUInt64LE(16));
  file.writeUInt32LE(crc32(file.subarray(offset)), 40);
  file.writeUInt32LE(crc32(file.subarray(0, 60)), 60);
  return file;
}

/** Multi-file bundles: an index and its shards, in a directory of their own. */
function indexCase(dir, { mutateIndex = (i) => i, indexText = (t) => t, shardBytes } = {}) {
  const shards = [kdtr([W], { metadata: { 'kdtr.shard': { index: 0 } } }), kdtr([B], { metadata: { 'kdtr.shard': { index: 1 } } })];
  const index = {
    format: 'kdtr-index',
    version: 1,
    metadata: { config: { hidden_size: 2 } },
    shards: shards.map((s, i) => ({ file: `model-0000${i + 1}.kdtr`, file_length: s.length, header_crc32: s.readUInt32LE(40), tensor_count: 1 })),
    weight_map: { w: 0, b: 1 },
  };
  const files = { 'model.kdtr.json': indexText(`${JSON.stringify(mutateIndex(index), null, 1)}\n`) };
  shards.forEach((s, i) => (files[`model-0000${i + 1}.kdtr`] = shardBytes ? shardBytes(s, i) : s));
  return { dir, files };
}

const INDEX_CASES = [
  ['valid/index', 'valid', '7', 'an index and two shards', null, {}],
  ['invalid/index-weight-map-wrong-shard', 'invalid', '7', 'weight_map places "b" in shard 0', ['KDTREE_INVALID_FIELD', 'weight_map'], { mutateIndex: (i) => ({ ...i, weight_map: { w: 0, b: 0 } }) }],
  ['invalid/index-weight-map-one-based', 'invalid', '7', 'weight_map counted from 1 (it is a 0-based position in shards)', ['KDTREE_INVALID_FIELD', 'weight_map.b'], { mutateIndex: (i) => ({ ...i, weight_map: { w: 1, b: 2 } }) }],
  ['invalid/index-weight-map-empty', 'invalid', '7', 'an empty weight_map beside shards that hold tensors', ['KDTREE_INVALID_FIELD', 'weight_map'], { mutateIndex: (i) => ({ ...i, weight_map: {} }) }],
  ['invalid/index-weight-map-fraction', 'invalid', '7', 'a shard position written 1.0', ['KDTREE_INVALID_FIELD', 'weight_map.b'], { indexText: (t) => t.replace('"b": 1', '"b": 1.0') }],
  ['invalid/index-shard-path', 'invalid', '7', 'a shard file name with a directory part', ['KDTREE_INVALID_FIELD', 'shards[1].file'], { mutateIndex: (i) => ({ ...i, shards: [i.shards[0], { ...i.shards[1], file: '../model-00002.kdtr' }] }) }],
  ['invalid/index-shard-twice', 'invalid', '7', 'the same shard listed twice', ['KDTREE_INVALID_FIELD', 'shards[1].file'], { mutateIndex: (i) => ({ ...i, shards: [i.shards[0], i.shards[0]] }) }],
  ['invalid/index-foreign-shard', 'invalid', '7', 'a shard whose header differs from its index entry', ['KDTREE_INVALID_FIELD', 'shards[1].header_crc32'], { mutateIndex: (i) => ({ ...i, shards: [i.shards[0], { ...i.shards[1], header_crc32: 1 }] }) }],
  ['invalid/index-version-2', 'invalid', '7', 'index version 2', ['KDTREE_UNSUPPORTED_VERSION', 'version'], { mutateIndex: (i) => ({ ...i, version: 2 }) }],
  ['invalid/index-unknown-key', 'invalid', '7', 'an index key version 1 does not define', ['KDTREE_INVALID_FIELD', 'tensor_parallel'], { mutateIndex: (i) => ({ ...i, tensor_parallel: { world_size: 2 } }) }],
  ['invalid/index-duplicate-key', 'invalid', '7', 'weight_map names "w" twice', ['KDTREE_HEADER_PARSE'], { indexText: (t) => t.replace('"w": 0', '"w": 0, "w": 0') }],
  ['invalid/index-tensor-in-two-shards', 'invalid', '7', 'both shards hold a tensor "w"', ['KDTREE_DUPLICATE_TENSOR'], (() => {
    const second = kdtr([W], { metadata: { 'kdtr.shard': { index: 1 } } });
    return {
      shardBytes: (s, i) => (i === 1 ? second : s),
      mutateIndex: (i) => ({ ...i, shards: [i.shards[0], { ...i.shards[1], header_crc32: second.readUInt32LE(40), file_length: second.length }] }),
    };
  })()],
];

export function generate(outDir) {
  rmSync(join(outDir, 'valid'), { recursive: true, force: true });
  rmSync(join(outDir, 'invalid'), { recursive: true, force: true });
  const manifest = {
    format: 'kdtr-conformance',
    version: 1,
    spec: 'docs/format/kdtr-v1.md',
    rule: 'A reader conforms when it opens every "valid" case and reads each of its tensors with a matching CRC-32, and for every "invalid" case fails either to open it or to read one of its tensors. "error" is what @kdtree/format reports ({code, field}); other readers need not match it. Index cases are directories: open their model.kdtr.json.',
    cases: [],
  };
  for (const [file, expect, section, description, error, build] of CASES) {
    mkdirSync(dirname(join(outDir, file)), { recursive: true });
    writeFileSync(join(outDir, file), build());
    manifest.cases.push({ file, expect, section, description, ...(error ? { error: { code: error[0], ...(error[1] ? { field: error[1] } : {}) } } : {}) });
  }
  for (const [dir, expect, section, description, error, options] of INDEX_CASES) {
    const { files } = indexCase(dir, options);
    mkdirSync(join(outDir, dir), { recursive: true });
    for (const [name, content] of Object.entries(files)) writeFileSync(join(outDir, dir, name), content);
    manifest.cases.push({ file: `${dir}/model.kdtr.json`, expect, section, description, ...(error ? { error: { code: error[0], ...(error[1] ? { field: error[1] } : {}) } } : {}) });
  }
  writeFileSync(join(outDir, 'manifest.json'), `${JSON.stringify(manifest, null, 2)}\n`);
  return manifest;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const out = process.argv[2] ?? fileURLToPath(new URL('../conformance', import.meta.url));
  const manifest = generate(out);
  const count = (e) => manifest.cases.filter((c) => c.expect === e).length;
  console.log(`wrote ${manifest.cases.length} cases (${count('valid')} valid, ${count('invalid')} invalid) to ${out}`);
}
