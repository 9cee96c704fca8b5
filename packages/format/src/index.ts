export * from './errors.js';
export {
  DTYPES,
  DTYPE_SIZES,
  bytesOf,
  checkDtype,
  dtypeSize,
  elementCount,
  isDtype,
  typedView,
  type AnyTypedArray,
  type Dtype,
  type TypedArrayFor,
} from './dtypes.js';
export {
  bf16ArrayToF32,
  bf16ToF32,
  f16ArrayToF32,
  f16ToF32,
  f32ArrayToBf16,
  f32ArrayToF16,
  f32ToBf16,
  f32ToF16,
} from './half.js';
export { crc32, formatCrc32 } from './crc32.js';
export { AtomicFile, removeStaleTemps, tempPathFor, writeFileAtomic } from './atomic-file.js';
export { makeDirectories } from './directories.js';
export { MAX_JSON_FILE_BYTES, readJsonFile } from './file-access.js';
export { isIntegerLiteral, MAX_JSON_DEPTH, parseStrictJson, parseStrictJsonBytes, type StrictJsonContext } from './strict-json.js';
export type { TensorData } from './tensor-data.js';
export { TensorStore, type ChunkOptions, type ReadOptions, type TensorInfo, type VerifyFailure, type VerifyProgress, type VerifyResult } from './tensor-store.js';
export {
  KDTR_ALIGNMENT,
  KDTR_DEFAULT_MAX_HEADER_BYTES,
  KDTR_MAGIC,
  KDTR_PREAMBLE_BYTES,
  KDTR_VERSION_MAJOR,
  KDTR_VERSION_MINOR,
} from './kdtr-layout.js';
export type { KdtrTensorEntry } from './kdtr-header.js';
export { KdtrBundle, openBundle, type KdtrShardSummary, type OpenOptions } from './kdtr-reader.js';
export { KdtrWriter, ShardedKdtrWriter, type KdtrWriteResult, type ShardedWriterOptions, type TensorSpec } from './kdtr-writer.js';
export {
  SAFETENSORS_INDEX_NAME,
  SAFETENSORS_MAX_HEADER_BYTES,
  SafetensorsCheckpoint,
  findModelConfig,
  isSafetensorsPath,
  modelConfigNameFor,
  openSafetensors,
  referenceSafetensorsOrder,
  writeSafetensors,
  type SafetensorsTensor,
} from './safetensors.js';
export { encodeNpy, parseNpy, readNpy, writeNpy, type NpyArray } from './npy.js';
export { openTensors, type AnyTensorStore } from './open.js';
