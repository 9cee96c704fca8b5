/**
 * Streaming quantization of a whole bundle: tensor by tensor, the selected weights become
 * `.qw`/`.sc` pairs and everything else is copied chunk by chunk, so memory stays at one weight
 * in f32 (plus its codes) whatever the model size.
 */
import type { KdtrWriter, ShardedKdtrWriter, TensorStore } from '@kdtree/format';
import { QuantShapeMismatchError } from './errors.js';
import { floatToF32, newQuantizationMetadata, qwName, scName, validateQuantizedStore, type QuantizationMetadata } from './descriptor.js';
import { type ErrorStats, type ScaleDtype, type ScaleRule } from './int4.js';
import { quantizeInt4Parallel } from './int4-parallel.js';
import { selectTensors, type SelectionRules } from './rules.js';

export interface QuantizeStoreOptions {
  rules: SelectionRules;
  rule?: ScaleRule;
  scaleDtype?: ScaleDtype;
  /** Recorded in metadata.quantization.preset. */
  preset?: string;
  onProgress?: (bytesDone: number, bytesTotal: number, tensor: string) => void;
}

export interface ClassSummary {
  /** routed expert, shared expert, dense mlp, attention, lm_head, other */
  tensorClass: string;
  tensors: number;
  weights: number;
  maxAbsError: number;
  meanAbsError: number;
}

export interface QuantizeSummary {
  quantized: number;
  copied: number;
  bytesBefore: number;
  bytesAfter: number;
  classes: ClassSummary[];
}

export function tensorClass(name: string): string {
  if (/\.experts\.\d+\./.test(name)) return 'routed expert';
  if (name.includes('shared_experts')) return 'shared expert';
  if (/mlp\.(gate|up|down|gate_up)_proj/.test(name)) return 'dense mlp';
  if (name.includes('self_attn')) return 'attention';
  if (name.includes('lm_head')) return 'lm_head';
  return 'other';
}

const FLOAT_DTYPES = new Set(['F32', 'BF16', 'F16', 'F64']);

export async function quantizeStore(input: TensorStore, writer: KdtrWriter | ShardedKdtrWriter, options: QuantizeStoreOptions): Promise<QuantizeSummary> {
  const existing = validateQuantizedStore(input);
  const parts = new Set(Object.values(existing?.tensors ?? {}).flatMap((d) => [d.qw, d.sc]));
  const candidates = input.tensors.filter((t) => !parts.has(t.name));
  const { selected } = selectTensors(candidates, options.rules);
  const rule = options.rule ?? 'minmax';
  const scaleDtype = options.scaleDtype ?? 'BF16';
  const quantization: QuantizationMetadata = newQuantizationMetadata({
    ...(existing ?? {}),
    preset: options.preset ?? existing?.preset,
    rules: { source: options.rules.source, groups: options.rules.groups, ignore: options.rules.ignore, rule, scale_dtype: scaleDtype },
    tensors: { ...(existing?.tensors ?? {}) },
  });
  const stats = new Map<string, ErrorStats & { tensors: number }>();
  const total = input.totalBytes;
  let done = 0;
  let bytesAfter = 0;
  let copied = 0;
  for (const t of input.tensors) {
    const groupSize = selected.get(t.name);
    if (groupSize === undefined) {
      await writer.add({ name: t.name, dtype: t.dtype, shape: t.shape }, progressChunks(input.chunks(t.name), (n) => options.onProgress?.((done += n), total, t.name)));
      bytesAfter += t.size;
      copied++;
      continue;
    }
    if (!FLOAT_DTYPES.has(t.dtype)) {
      throw new QuantShapeMismatchError(`is ${t.dtype}; only float weights (F32, BF16, F16, F64) can be quantized`, { tensor: t.name, file: t.file });
    }
    const [rows, cols] = t.shape;
    // f32 weights straight into shared memory, so the quantizer's threads need no copy
    const weights = floatToF32(t.dtype, await input.read(t.name), t.name, new Float32Array(new SharedArrayBuffer(rows * cols * 4)));
    const cls = tensorClass(t.name);
    const s = stats.get(cls) ?? { maxAbsError: 0, sumAbsError: 0, count: 0, tensors: 0 };
    stats.set(cls, s);
    const m = await quantizeInt4Parallel(weights, rows, cols, { groupSize, rule, scaleDtype, name: t.name }, s);
    s.tensors++;
    await writer.add({ name: qwName(t.name), dtype: 'I32', shape: [rows, cols / 8] }, m.packed);
    await writer.add({ name: scName(t.name), dtype: scaleDtype, shape: [rows, cols / groupSize] }, m.scales);
    bytesAfter += m.packed.byteLength + m.scales.byteLength;
    quantization.tensors[t.name] = { shape: [rows, cols], group_size: groupSize, scale_dtype: scaleDtype, scheme: rule, qw: qwName(t.name), sc: scName(t.name) };
    done += t.size;
    options.onProgress?.(done, total, t.name);
  }
  writer.metadata = { ...writer.metadata, quantization };
  return {
    quantized: selected.size,
    copied,
    bytesBefore: total,
    bytesAfter,
    classes: [...stats.entries()].map(([tensorClass, s]) => ({ tensorClass, tensors: s.tensors, weights: s.count, maxAbsError: s.maxAbsError, meanAbsError: s.count ? s.sumAbsError / s.count : 0 })),
  };
}

async function* progressChunks(chunks: AsyncIterable<Uint8Array>, onBytes: (n: number) => void): AsyncGenerator<Uint8Array> {
  for await (const chunk of chunks) {
    yield chunk;
    onBytes(chunk.byteLength);
  }
}
