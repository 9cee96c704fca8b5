/**
 * How INT4 tensors live in a KDTR bundle: `<name>.qw` (I32 [N, K/8]) and `<name>.sc` (BF16 or F32
 * [N, K/G]) for a float weight `<name>` of shape [N, K], described in the metadata under
 * `quantization.tensors[<name>]`. Readers ask for `<name>` and get it dequantized.
 */
import { bf16ArrayToF32, f16ArrayToF32, parseStrictJson, typedView, type Dtype, type TensorInfo, type TensorStore } from '@kdtree/format';
import { MissingPartError, QuantConfigError, QuantShapeMismatchError } from './errors.js';
import { checkInt4Shape, dequantizeInt4, GROUP_SIZES, type Int4Matrix, type ScaleDtype } from './int4.js';

export const QUANT_FORMAT = 'kdtree.int4/1';

export interface Int4Descriptor {
  /** [N, K] of the float weight. */
  shape: [number, number];
  group_size: number;
  scale_dtype: ScaleDtype;
  /** How the scales were made: a kdtree rule, or imported from a compressed-tensors checkpoint. */
  scheme: 'minmax' | 'absmax7' | 'compressed-tensors';
  qw: string;
  sc: string;
  /** Dtype of compressed-tensors' weight_shape tensor, kept for byte-identical export. */
  shape_dtype?: 'I32' | 'I64';
}

export interface QuantizationMetadata {
  format: typeof QUANT_FORMAT;
  bits: 4;
  symmetric: true;
  /** "int32 words, element 8j+i of a row in bits 4i..4i+3 of word j, nibble = q + 8" */
  packing: string;
  preset?: string;
  rules?: unknown;
  /** The quantization_config of an imported compressed-tensors checkpoint, verbatim. */
  compressed_tensors_config?: Record<string, unknown>;
  tensors: Record<string, Int4Descriptor>;
}

export const PACKING = 'int32 little-endian words [N, K/8]; element 8j+i of row n in bits 4i..4i+3 of word (n, j); nibble = q + 8';

export const qwName = (name: string) => `${name}.qw`;
export const scName = (name: string) => `${name}.sc`;

export function newQuantizationMetadata(extra: Partial<QuantizationMetadata> = {}): QuantizationMetadata {
  return { format: QUANT_FORMAT, bits: 4, symmetric: true, packing: PACKING, ...extra, tensors: { ...(extra.tensors ?? {}) } };
}

/**
 * Where a safetensors file keeps the quantization metadata: its `__metadata__` holds only strings,
 * so the descriptor object is stored there as JSON text under this key (`kdtree export` writes it).
 */
export const SAFETENSORS_QUANTIZATION_KEY = 'kdtree.quantization';

const TOP_KEYS = new Set(['format', 'bits', 'symmetric', 'packing', 'preset', 'rules', 'compressed_tensors_config', 'tensors']);
const DESCRIPTOR_KEYS = new Set(['shape', 'group_size', 'scale_dtype', 'scheme', 'qw', 'sc', 'shape_dtype']);
const SCHEMES = ['minmax', 'absmax7', 'compressed-tensors'];

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/**
 * The quantization metadata of a store, checked against its schema (docs/quant/int4.md section 5);
 * undefined when it holds none. A KDTR bundle keeps it as `metadata.quantization`; a safetensors
 * file as JSON text in `__metadata__["kdtree.quantization"]`.
 */
export function readQuantizationMetadata(store: Pick<TensorStore, 'metadata' | 'path'> & { format?: string }): QuantizationMetadata | undefined {
  const meta = store.metadata as Record<string, unknown>;
  let q = meta.quantization;
  let where = 'metadata.quantization';
  if (q === undefined && typeof meta[SAFETENSORS_QUANTIZATION_KEY] === 'string' && (store.format === undefined || store.format.startsWith('safetensors'))) {
    where = `__metadata__["${SAFETENSORS_QUANTIZATION_KEY}"]`;
    try {
      q = parseStrictJson(meta[SAFETENSORS_QUANTIZATION_KEY] as string, { file: store.path, format: 'json', what: where });
    } catch (cause) {
      throw new QuantConfigError(`${where} is not JSON: ${(cause as Error).message}`, { file: store.path, cause });
    }
  }
  if (q === undefined) return undefined;
  return checkQuantizationMetadata(q, store.path, where);
}

/** Validates a parsed quantization object; every problem names the key and what was expected. */
export function checkQuantizationMetadata(q: unknown, file: string, where = 'metadata.quantization'): QuantizationMetadata {
  const fail = (key: string, expected: string, actual?: unknown) =>
    new QuantConfigError(`${where}${key ? `.${key}` : ''}: expected ${expected}${actual === undefined ? '' : `, found ${JSON.stringify(actual)?.slice(0, 80)}`}`, { file });
  if (!isObject(q)) throw fail('', `a ${QUANT_FORMAT} object`, q);
  if (q.format !== QUANT_FORMAT) throw fail('format', `"${QUANT_FORMAT}"`, q.format);
  for (const key of Object.keys(q)) if (!TOP_KEYS.has(key)) throw fail(key, `no such key (keys: ${[...TOP_KEYS].join(', ')})`);
  if (q.bits !== 4) throw fail('bits', '4', q.bits);
  if (q.symmetric !== true) throw fail('symmetric', 'true (no zero points)', q.symmetric);
  if (typeof q.packing !== 'string') throw fail('packing', 'a string', q.packing);
  if (q.preset !== undefined && typeof q.preset !== 'string') throw fail('preset', 'a string', q.preset);
  if (q.compressed_tensors_config !== undefined && !isObject(q.compressed_tensors_config)) throw fail('compressed_tensors_config', 'an object', q.compressed_tensors_config);
  if (!isObject(q.tensors)) throw fail('tensors', 'an object of weight name -> descriptor', q.tensors);
  for (const [name, d] of Object.entries(q.tensors)) {
    const at = `tensors["${name}"]`;
    if (!isObject(d)) throw fail(at, 'a descriptor object', d);
    for (const key of Object.keys(d)) if (!DESCRIPTOR_KEYS.has(key)) throw fail(`${at}.${key}`, `no such key (keys: ${[...DESCRIPTOR_KEYS].join(', ')})`);
    const shape = d.shape;
    if (!Array.isArray(shape) || shape.length !== 2 || !shape.every((v) => Number.isSafeInteger(v) && (v as number) > 0)) throw fail(`${at}.shape`, '[N, K] of positive integers', shape);
    if (!(GROUP_SIZES as readonly unknown[]).includes(d.group_size)) throw fail(`${at}.group_size`, `one of ${GROUP_SIZES.join(', ')}`, d.group_size);
    if (d.scale_dtype !== 'BF16' && d.scale_dtype !== 'F32') throw fail(`${at}.scale_dtype`, '"BF16" or "F32"', d.scale_dtype);
    if (!SCHEMES.includes(d.scheme as string)) throw fail(`${at}.scheme`, `one of ${SCHEMES.join(', ')}`, d.scheme);
    if (typeof d.qw !== 'string' || d.qw === '') throw fail(`${at}.qw`, 'the name of the packed tensor', d.qw);
    if (typeof d.sc !== 'string' || d.sc === '') throw fail(`${at}.sc`, 'the name of the scales tensor', d.sc);
    if (d.shape_dtype !== undefined && d.shape_dtype !== 'I32' && d.shape_dtype !== 'I64') throw fail(`${at}.shape_dtype`, '"I32" or "I64"', d.shape_dtype);
  }
  return q as unknown as QuantizationMetadata;
}

/**
 * Checks that every descriptor's parts exist with consistent shapes, and that no `.qw`/`.sc`
 * tensor lacks a descriptor or its partner.
 */
export function validateQuantizedStore(store: Pick<TensorStore, 'metadata' | 'path' | 'has' | 'get' | 'tensors'> & { format?: string }, meta = readQuantizationMetadata(store)): QuantizationMetadata | undefined {
  const described = new Set<string>();
  for (const [name, d] of Object.entries(meta?.tensors ?? {})) {
    const [n, k] = d.shape;
    checkInt4Shape(n, k, d.group_size, name);
    for (const part of [d.qw, d.sc]) {
      if (!store.has(part)) throw new MissingPartError(`${part === d.qw ? 'packed codes' : 'scales'} '${part}' missing from the bundle`, { tensor: name, file: store.path });
      described.add(part);
    }
    const qw = store.get(d.qw);
    const sc = store.get(d.sc);
    if (qw.dtype !== 'I32' || qw.shape.length !== 2 || qw.shape[0] !== n || qw.shape[1] !== k / 8) {
      throw new QuantShapeMismatchError(`packed '${d.qw}' is ${qw.dtype} [${qw.shape.join(', ')}], expected I32 [${n}, ${k / 8}] for a weight [${n}, ${k}]`, { tensor: name, file: store.path });
    }
    if (sc.dtype !== d.scale_dtype || sc.shape.length !== 2 || sc.shape[0] !== n || sc.shape[1] !== k / d.group_size) {
      throw new QuantShapeMismatchError(`scales '${d.sc}' are ${sc.dtype} [${sc.shape.join(', ')}], expected ${d.scale_dtype} [${n}, ${k / d.group_size}] for a weight [${n}, ${k}] in groups of ${d.group_size}`, { tensor: name, file: store.path });
    }
  }
  for (const t of store.tensors) {
    if ((t.name.endsWith('.qw') || t.name.endsWith('.sc')) && !described.has(t.name)) {
      const base = t.name.slice(0, -3);
      const partner = t.name.endsWith('.qw') ? scName(base) : qwName(base);
      const message = store.has(partner) ? 'has no descriptor in metadata.quantization.tensors' : `has no ${t.name.endsWith('.qw') ? 'scales' : 'packed codes'} '${partner}'`;
      throw new MissingPartError(`'${t.name}' ${message}`, { tensor: base, file: store.path });
    }
  }
  return meta;
}

/** Reads the INT4 parts of one weight. */
export async function readInt4(store: TensorStore, name: string, d: Int4Descriptor): Promise<Int4Matrix> {
  const packed = (await store.readTyped(d.qw, 'I32')) as Int32Array;
  const scales = d.scale_dtype === 'BF16' ? ((await store.readTyped(d.sc, 'BF16')) as Uint16Array) : ((await store.readTyped(d.sc, 'F32')) as Float32Array);
  return { rows: d.shape[0], cols: d.shape[1], groupSize: d.group_size, scaleDtype: d.scale_dtype, packed, scales };
}

/** Any float tensor widened to f32 (F64 narrowed), into `out` when given. */
export function floatToF32(dtype: Dtype, bytes: Uint8Array, name: string, out?: Float32Array): Float32Array {
  switch (dtype) {
    case 'F32':
      if (out === undefined) return typedView('F32', bytes);
      out.set(typedView('F32', bytes));
      return out;
    case 'BF16':
      return bf16ArrayToF32(typedView('BF16', bytes), out);
    case 'F16':
      return f16ArrayToF32(typedView('F16', bytes), out);
    case 'F64': {
      const target = out ?? new Float32Array(bytes.byteLength / 8);
      target.set(typedView('F64', bytes));
      return target;
    }
    default:
      throw new QuantShapeMismatchError(`is ${dtype}, not a float tensor`, { tensor: name });
  }
}

/**
 * Reads a weight as f32: a float tensor widened, or an INT4 tensor dequantized exactly
 * (w = q * scale). This is how the reference and the engine see every weight.
 */
export async function readWeightF32(store: TensorStore, name: string, meta = readQuantizationMetadata(store)): Promise<{ data: Float32Array; shape: number[] }> {
  const d = meta?.tensors[name];
  if (d !== undefined) return { data: dequantizeInt4(await readInt4(store, name, d)), shape: [...d.shape] };
  if (!store.has(name) && store.has(qwName(name))) {
    throw new MissingPartError(`is stored as '${qwName(name)}' but metadata.quantization has no descriptor for it`, { tensor: name, file: store.path });
  }
  const info = store.get(name);
  return { data: floatToF32(info.dtype, await store.read(name), name), shape: [...info.shape] };
}
