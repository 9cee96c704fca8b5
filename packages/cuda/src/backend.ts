/**
 * The typed face of the addon: explicit device memory (tensors are a buffer + dtype + shape),
 * streams, events, and every op. The native side checks every argument again (liveness, owner,
 * dtypes, shapes, sizes) and throws an Error with a `code` and all shapes involved.
 */
import type { NativeError } from './errors.js';
import { loadAddon, type LoadedAddon, type LoadOptions } from './loader.js';
import { packedW4A16Shapes } from './w4a16-layout.js';
import type { NativeBackend, NativeBuffer, NativeDeviceInfo, NativeDtype, NativeGraph, TensorArg } from './native-types.js';

export type Dtype = NativeDtype;
export type DeviceBuffer = NativeBuffer;
export type Graph = NativeGraph;

/**
 * W4A16 weights in the GEMMs' layout (packW4A16), with the matrix they hold: the packed shapes
 * are padded to 16 rows and 128 k, so N and K are kept here.
 */
export interface PackedW4A16 {
  qw: DeviceTensor;
  sc: DeviceTensor;
  /** Rows of the checkpoint matrix (2I for gate_up weights). */
  n: number;
  k: number;
  group: number;
  /** E, for a stack of experts [E, N, K]; absent for one matrix. */
  experts?: number;
  /** Rows in the siluMul epilogue's order (tiles of 8 gate rows, then the same 8 up rows). */
  interleaveGateUp: boolean;
}

/** A tensor in device memory: the unit every op takes. */
export interface DeviceTensor extends TensorArg {
  buffer: DeviceBuffer;
  dtype: Dtype;
  shape: number[];
}

export const DTYPE_BYTES: Record<Dtype, number> = { f32: 4, f16: 2, bf16: 2, i32: 4, u8: 1, f64: 8 };

type HostArray = Float32Array | Float64Array | Int32Array | Uint8Array | Uint16Array;

function hostArrayFor(dtype: Dtype, n: number): HostArray {
  switch (dtype) {
    case 'f32':
      return new Float32Array(n);
    case 'f64':
      return new Float64Array(n);
    case 'i32':
      return new Int32Array(n);
    case 'u8':
      return new Uint8Array(n);
    default:
      return new Uint16Array(n); // f16 / bf16 bits
  }
}

export function numel(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

/** A bad argument caught on the JS side, coded like the native ops' errors. */
function invalidArgument(message: string): NativeError {
  const error = new Error(message) as NativeError;
  error.code = 'KDTREE_INVALID_ARGUMENT';
  return error;
}

export class KdtreeBackend {
  readonly native: NativeBackend;
  readonly kind: 'cpu' | 'cuda';
  readonly addonPath: string;
  readonly reason: string;

  constructor(readonly loaded: LoadedAddon) {
    this.native = loaded.native;
    this.kind = loaded.variant;
    this.addonPath = loaded.path;
    this.reason = loaded.reason;
  }

  /** NCCL's version code (see ncclVersionString); throws where NCCL is unavailable. */
  ncclVersion(): number {
    return this.loaded.module.ncclVersion();
  }

  /** A fresh ncclUniqueId (128 bytes): rank 0 makes it, every rank passes it to ncclInit. */
  ncclUniqueId(): Uint8Array {
    return this.loaded.module.ncclUniqueId();
  }

  info(): NativeDeviceInfo {
    return this.native.info();
  }

  /** An uninitialized tensor. */
  empty(dtype: Dtype, shape: readonly number[]): DeviceTensor {
    return { buffer: this.native.alloc(numel(shape) * DTYPE_BYTES[dtype]), dtype, shape: [...shape] };
  }

  zeros(dtype: Dtype, shape: readonly number[]): DeviceTensor {
    const t = this.empty(dtype, shape);
    this.native.fill(t.buffer, 0);
    return t;
  }

  /** A tensor holding `data` (bf16/f16 as raw Uint16 bits). */
  fromArray(dtype: Dtype, shape: readonly number[], data: ArrayBufferView): DeviceTensor {
    const bytes = numel(shape) * DTYPE_BYTES[dtype];
    if (data.byteLength !== bytes) {
      throw invalidArgument(`fromArray: ${dtype} [${shape.join(', ')}] needs ${bytes} bytes, the array has ${data.byteLength}`);
    }
    const t = this.empty(dtype, shape);
    this.native.upload(t.buffer, data);
    return t;
  }

  /** Copies a tensor to a new host array of its dtype (synchronizes with the default stream). */
  toArray(t: DeviceTensor): HostArray {
    const out = hostArrayFor(t.dtype, numel(t.shape));
    this.native.download(t.buffer, out, t.offset ?? 0);
    return out;
  }

  free(...tensors: (DeviceTensor | DeviceBuffer)[]): void {
    for (const t of tensors) {
      const buffer = 'buffer' in t ? t.buffer : t;
      if (!buffer.freed) this.native.free(buffer);
    }
  }

  /**
   * Packs checkpoint W4A16 weights (qw i32 [(E,) N, K/8], sc [(E,) N, K/G]) into the layout the
   * GEMM kernels read, as new tensors; the inputs are left as they are. `interleaveGateUp`: qw and
   * sc are an MLP's [gate; up] rows (N = 2I), packed for the GEMMs' 'siluMul' epilogue. The result
   * carries the matrix's true shape (the packed shapes are padded); the native side keeps it with
   * the packed buffers too, and the GEMMs reject an x, y or group that does not match it.
   */
  packW4A16(qw: DeviceTensor, sc: DeviceTensor, group: number, stream?: number, options: { interleaveGateUp?: boolean } = {}): PackedW4A16 {
    const lead = qw.shape.length - 2;
    if (lead !== 0 && lead !== 1) {
      throw invalidArgument(`packW4A16: qw must be [N, K/8] or [E, N, K/8], got [${qw.shape.join(', ')}]`);
    }
    const shapes = packedW4A16Shapes(qw.shape[lead], qw.shape[lead + 1] * 8, group, lead ? qw.shape[0] : undefined);
    const packed = { qw: this.empty('i32', shapes.qw), sc: this.empty(sc.dtype, shapes.sc) };
    try {
      this.native.w4a16Pack({ qw, sc, qwPacked: packed.qw, scPacked: packed.sc, group, interleaveGateUp: options.interleaveGateUp, stream });
    } catch (error) {
      this.free(packed.qw, packed.sc);
      throw error;
    }
    return { ...packed, n: qw.shape[lead], k: qw.shape[lead + 1] * 8, group, ...(lead ? { experts: qw.shape[0] } : {}), interleaveGateUp: options.interleaveGateUp ?? false };
  }

  /**
   * The ops `queue` issues on `stream` (a created stream), captured as a graph: launchGraph(graph,
   * stream) then replays them with one host call (a CUDA graph; the cpu twin replays the calls). If
   * `queue` throws, the capture ends and is dropped. Free the graph with freeGraph when done.
   */
  capture(stream: number, queue: () => void): Graph {
    this.native.beginCapture(stream);
    try {
      queue();
    } catch (error) {
      try {
        this.native.freeGraph(this.native.endCapture(stream));
      } catch {
        // the capture is over either way; the first error is the one to report
      }
      throw error;
    }
    return this.native.endCapture(stream);
  }

  synchronize(stream?: number): void {
    this.native.synchronize(stream);
  }

  /**
   * Device milliseconds of `fn`'s queued work, measured with events on `stream`. With `holdUs`, the
   * stream is held that long first, so the work queues up and runs back to back: the result is
   * device time even when launching is slower than the kernels (hold longer than queueing takes).
   */
  time(fn: () => void, stream = 0, holdUs = 0): number {
    const a = this.native.createEvent();
    const b = this.native.createEvent();
    try {
      if (holdUs > 0) this.native.hold(holdUs, stream);
      this.native.recordEvent(a, stream);
      fn();
      this.native.recordEvent(b, stream);
      return this.native.elapsedMs(a, b);
    } finally {
      this.native.destroyEvent(a);
      this.native.destroyEvent(b);
    }
  }
}

/** NCCL's version as major.minor.patch (ncclGetVersion's code is major * 10000 + minor * 100 + patch from 2.9 on). */
export function ncclVersionString(code: number): string {
  return `${Math.floor(code / 10000)}.${Math.floor((code % 10000) / 100)}.${code % 100}`;
}

/** Loads the addon (see loader.ts for the candidates and checks) and returns a backend. */
export function createBackend(options: LoadOptions = {}): KdtreeBackend {
  return new KdtreeBackend(loadAddon(options));
}
