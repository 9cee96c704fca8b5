/**
 * A linear layer's weight on the device and the GEMM that applies it. INT4 weights are packed once,
 * at load, into the layout the W4A16 kernels read (packW4A16); float weights stay bf16 as the
 * checkpoint stores them and go through the bf16 GEMM. An MLP's gate and up projections are one
 * weight of 2I rows: INT4 packed with interleaveGateUp so the GEMM's SiLU epilogue writes
 * silu(gate) * up directly; bf16 as [gate; up], followed by the silu_mul op.
 */
import { DTYPE_BYTES, numel, packedW4A16Shapes, type DeviceTensor, type KdtreeBackend } from '@kdtree/cuda';
import type { HostBf16, HostInt4, WeightReader } from './model-source.js';
import { modelError } from './errors.js';
import type { Block, WeightRead } from './shard.js';

export type DeviceLinear =
  /** Packed W4A16: qw i32 and sc [(E,) N/16, ...] (packedW4A16Shapes); `gateUp`: packed for the SiLU epilogue. */
  | { kind: 'int4'; n: number; k: number; group: number; qw: DeviceTensor; sc: DeviceTensor; gateUp: boolean; experts?: number }
  /** bf16 [(E,) N, K] as stored. */
  | { kind: 'bf16'; n: number; k: number; w: DeviceTensor; gateUp: boolean; experts?: number };

/** What loadLinear reads of a weight source (a model's WeightReader, or a drafter checkpoint's tensors). */
export type LinearSource = Pick<WeightReader, 'path' | 'int4' | 'readBf16' | 'readInt4'>;

/** The parts one weight is read as: one tensor, or the rows of several stacked ([gate; up]). */
export interface LinearSpec {
  /** Tensor names whose rows are stacked in order (one name for most weights). */
  names: readonly string[];
  /** [rows, K] of each name. */
  shapes: readonly (readonly [number, number])[];
  /** Rows of each name to keep (all when absent), in order. */
  rows?: readonly (readonly number[] | undefined)[];
  /** The block of K every name keeps (a row-parallel shard; all of K when absent). */
  cols?: Block;
}

/** The reads loadLinear makes for `spec` (what a shard of it must hold). */
export function specReads(spec: LinearSpec): WeightRead[] {
  return spec.names.map((name, i) => ({ name, shape: spec.shapes[i], rows: spec.rows?.[i], cols: spec.cols }));
}

function rowsOf(spec: LinearSpec, i: number): number {
  return spec.rows?.[i]?.length ?? spec.shapes[i][0];
}

/** K of the weight as loaded (the shard's block of it). */
function colsOf(spec: LinearSpec): number {
  return spec.cols?.count ?? spec.shapes[0][1];
}

/** Whether every part of `spec` is INT4 (a mix is rejected: one GEMM applies the whole weight). */
function isInt4(source: LinearSource, spec: LinearSpec): boolean {
  const kinds = spec.names.map((n) => source.int4(n) !== undefined);
  if (kinds.some((k) => k !== kinds[0])) throw modelError(spec.names.join(' + '), 'mixes INT4 and float parts; quantize them alike', source.path);
  return kinds[0];
}

/** Device bytes of the weight once loaded, without loading it (the memory estimate). */
export function linearBytes(source: WeightReader, spec: LinearSpec, experts = 1): number {
  const n = spec.names.reduce((s, _, i) => s + rowsOf(spec, i), 0);
  const k = colsOf(spec);
  if (!isInt4(source, spec)) return experts * n * k * 2;
  const d = source.int4(spec.names[0])!;
  const shapes = packedW4A16Shapes(n, k, d.group_size);
  return experts * (numel(shapes.qw) * 4 + numel(shapes.sc) * (d.scale_dtype === 'BF16' ? 2 : 4));
}

async function readParts(source: LinearSource, spec: LinearSpec): Promise<HostInt4[] | HostBf16[]> {
  if (isInt4(source, spec)) return Promise.all(spec.names.map((n, i) => source.readInt4(n, spec.shapes[i] as [number, number], spec.rows?.[i], spec.cols)));
  return Promise.all(spec.names.map((n, i) => source.readBf16(n, spec.shapes[i] as [number, number], spec.rows?.[i], spec.cols)));
}

/**
 * Loads one linear weight, or E experts' weights stacked ([E, N, K]) when `specs` has several: each
 * expert's parts are uploaded into one staging tensor in the checkpoint layout, then packed once.
 */
export async function loadLinear(b: KdtreeBackend, source: LinearSource, specs: readonly LinearSpec[], options: { gateUp?: boolean } = {}): Promise<DeviceLinear> {
  const experts = specs.length;
  const first = specs[0];
  const n = first.names.reduce((s, _, i) => s + rowsOf(first, i), 0);
  const k = colsOf(first);
  const gateUp = options.gateUp ?? false;
  const lead = experts > 1 ? [experts] : [];
  if (!isInt4(source, first)) {
    const w = b.empty('bf16', [...lead, n, k]);
    try {
      for (let e = 0; e < experts; e++) {
        let offset = e * n * k * 2;
        for (const part of (await readParts(source, specs[e])) as HostBf16[]) {
          b.native.upload(w.buffer, part.bits, offset);
          offset += part.bits.byteLength;
        }
      }
    } catch (error) {
      b.free(w);
      throw error;
    }
    return { kind: 'bf16', n, k, w, gateUp, experts: experts > 1 ? experts : undefined };
  }
  const d = source.int4(first.names[0])!;
  const group = d.group_size;
  const scaleDtype = d.scale_dtype === 'BF16' ? 'bf16' : 'f32';
  for (const spec of specs) {
    for (const name of spec.names) {
      const other = source.int4(name)!;
      if (other.group_size !== group || other.scale_dtype !== d.scale_dtype) {
        throw modelError(name, `is INT4 in groups of ${other.group_size} with ${other.scale_dtype} scales, but ${first.names[0]} uses ${group} / ${d.scale_dtype}: one GEMM applies them together`, source.path);
      }
    }
  }
  const qw = b.empty('i32', [...lead, n, k / 8]);
  const sc = b.empty(scaleDtype, [...lead, n, k / group]);
  try {
    const scBytes = scaleDtype === 'bf16' ? 2 : 4;
    for (let e = 0; e < experts; e++) {
      let q = e * n * (k / 8) * 4;
      let s = e * n * (k / group) * scBytes;
      for (const part of (await readParts(source, specs[e])) as HostInt4[]) {
        b.native.upload(qw.buffer, part.qw, q);
        b.native.upload(sc.buffer, part.sc, s);
        q += part.qw.byteLength;
        s += part.sc.byteLength;
      }
    }
    const packed = b.packW4A16(qw, sc, group, undefined, { interleaveGateUp: gateUp });
    return { kind: 'int4', n, k, group, qw: packed.qw, sc: packed.sc, gateUp, experts: experts > 1 ? experts : undefined };
  } finally {
    b.free(qw, sc);
  }
}

/** The device tensors a linear weight holds. */
export function linearTensors(w: DeviceLinear): DeviceTensor[] {
  return w.kind === 'int4' ? [w.qw, w.sc] : [w.w];
}

/**
 * y [M, N] = x [M, K] . W^T. A gate_up weight writes y [M, I] = silu(gate) * up: the W4A16 GEMM in
 * its epilogue, the bf16 GEMM through `scratch` [M, 2I] and silu_mul.
 */
export function applyLinear(b: KdtreeBackend, w: DeviceLinear, x: DeviceTensor, y: DeviceTensor, stream: number, scratch?: DeviceTensor): void {
  if (w.kind === 'int4') {
    b.native.w4a16Gemm({ x, qw: w.qw, sc: w.sc, y, group: w.group, epilogue: w.gateUp ? 'siluMul' : 'none', stream });
    return;
  }
  if (!w.gateUp) {
    b.native.gemm({ x, w: w.w, y, stream });
    return;
  }
  const m = x.shape[0];
  const both = view(scratch!, [m, w.n]);
  b.native.gemm({ x, w: w.w, y: both, stream });
  b.native.siluMul({ x: both, out: y, stream });
}

/** `t` seen as another shape over the start of its buffer (at `offsetElements` elements in). */
export function view(t: DeviceTensor, shape: number[], offsetElements = 0): DeviceTensor {
  return { buffer: t.buffer, dtype: t.dtype, shape, offset: (t.offset ?? 0) + offsetElements * DTYPE_BYTES[t.dtype] };
}
