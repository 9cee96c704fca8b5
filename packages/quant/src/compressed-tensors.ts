/**
 * compressed-tensors `pack-quantized` checkpoints (the format of the real Kimi K2.x releases):
 *
 *   <module>.weight_packed  I32 [N, K/8]    codes, packed as in int4.ts
 *   <module>.weight_scale   BF16 [N, K/G]   scales (no zero point: symmetric)
 *   <module>.weight_shape   I32 [2]         [N, K]
 *
 * plus `quantization_config` in config.json (top level, or inside `text_config` for the K2.5/K2.6
 * wrapper). Import renames the parts to `<module>.weight.qw` / `.sc` without touching a byte;
 * export renames them back and restores weight_shape, in the reference writer's tensor order.
 */
import { referenceSafetensorsOrder, type Dtype, type TensorInfo } from '@kdtree/format';
import { MissingPartError, QuantConfigError, QuantShapeMismatchError } from './errors.js';
import { GROUP_SIZES } from './int4.js';
import { newQuantizationMetadata, qwName, scName, type Int4Descriptor, type QuantizationMetadata } from './descriptor.js';
import { checkWeightsArgs, isLinearModule, KIMI_K2_IGNORE } from './rules.js';

const PACKED = '.weight_packed';
const SCALE = '.weight_scale';
const SHAPE = '.weight_shape';
const UNSUPPORTED_PARTS = ['.weight_zero_point', '.weight_g_idx'];

export interface FoundQuantizationConfig {
  config: Record<string, unknown>;
  /** Where it sits in config.json. */
  path: 'quantization_config' | 'text_config.quantization_config';
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/**
 * The compressed-tensors quantization_config of a model config, validated, or undefined when the
 * model is not compressed-tensors quantized (other methods import verbatim).
 */
export function findCompressedTensorsConfig(modelConfig: Record<string, unknown> | undefined, file = 'config.json'): FoundQuantizationConfig | undefined {
  if (modelConfig === undefined) return undefined;
  const candidates: [unknown, FoundQuantizationConfig['path']][] = [
    [modelConfig.quantization_config, 'quantization_config'],
    [isObject(modelConfig.text_config) ? modelConfig.text_config.quantization_config : undefined, 'text_config.quantization_config'],
  ];
  for (const [q, path] of candidates) {
    if (!isObject(q) || q.quant_method !== 'compressed-tensors') continue;
    if (q.format !== 'pack-quantized') {
      throw new QuantConfigError(`${path}.format is ${JSON.stringify(q.format)}; kdtree imports compressed-tensors "pack-quantized" (INT4) checkpoints`, { file });
    }
    if (isObject(q.config_groups)) {
      for (const [name, g] of Object.entries(q.config_groups)) {
        if (isObject(g) && isObject(g.weights)) checkWeightsArgs(g.weights, `${file}: ${path}.config_groups.${name}`);
      }
    }
    return { config: q, path };
  }
  return undefined;
}

export interface RenamedTensor {
  /** Name in the source checkpoint. */
  source: string;
  /** Name in the KDTR bundle. */
  target: string;
}

export interface ImportPlan {
  /** In source order; weight_shape tensors are absorbed into descriptors. */
  tensors: RenamedTensor[];
  quantization: QuantizationMetadata;
}

/**
 * Plans the import of a compressed-tensors checkpoint: which tensors are renamed to .qw/.sc, and
 * the descriptor of each quantized weight, after checking parts and shapes agree.
 * `readShape` reads a weight_shape tensor ([N, K]).
 */
export async function planCompressedTensorsImport(
  tensors: readonly TensorInfo[],
  found: FoundQuantizationConfig,
  readShape: (name: string) => Promise<number[]>,
): Promise<ImportPlan> {
  const byName = new Map(tensors.map((t) => [t.name, t]));
  const quantization = newQuantizationMetadata({ compressed_tensors_config: found.config });
  const out: RenamedTensor[] = [];
  for (const t of tensors) {
    for (const part of UNSUPPORTED_PARTS) {
      if (t.name.endsWith(part)) throw new QuantConfigError(`'${t.name}': ${part.slice(1)} (asymmetric or act-order quantization) is not supported; kdtree reads symmetric INT4`, { file: t.file });
    }
    if (t.name.endsWith(PACKED)) {
      const module = t.name.slice(0, -PACKED.length);
      const weight = `${module}.weight`;
      const scale = byName.get(module + SCALE);
      const shapeTensor = byName.get(module + SHAPE);
      if (scale === undefined) throw new MissingPartError(`'${t.name}' has no '${module}${SCALE}'`, { tensor: weight, file: t.file });
      if (shapeTensor === undefined) throw new MissingPartError(`'${t.name}' has no '${module}${SHAPE}'`, { tensor: weight, file: t.file });
      if ((shapeTensor.dtype !== 'I32' && shapeTensor.dtype !== 'I64') || shapeTensor.shape.length !== 1 || shapeTensor.shape[0] !== 2) {
        throw new QuantShapeMismatchError(`'${shapeTensor.name}' is ${shapeTensor.dtype} [${shapeTensor.shape.join(', ')}], expected I32 or I64 [2]`, { tensor: weight, file: t.file });
      }
      const [n, k] = await readShape(shapeTensor.name);
      if (!(n > 0 && k > 0)) throw new QuantShapeMismatchError(`'${shapeTensor.name}' holds [${n}, ${k}]`, { tensor: weight, file: t.file });
      if (k % 8 !== 0) throw new QuantShapeMismatchError(`K = ${k} (weight_shape [${n}, ${k}]) is not a multiple of 8; padded packing is not supported`, { tensor: weight, file: t.file });
      if (t.dtype !== 'I32' || t.shape.length !== 2 || t.shape[0] !== n || t.shape[1] !== k / 8) {
        throw new QuantShapeMismatchError(`'${t.name}' is ${t.dtype} [${t.shape.join(', ')}], but weight_shape [${n}, ${k}] needs I32 [${n}, ${k / 8}]`, { tensor: weight, file: t.file });
      }
      if ((scale.dtype !== 'BF16' && scale.dtype !== 'F32') || scale.shape.length !== 2 || scale.shape[0] !== n || scale.shape[1] === 0 || k % scale.shape[1] !== 0) {
        throw new QuantShapeMismatchError(`'${scale.name}' is ${scale.dtype} [${scale.shape.join(', ')}], expected BF16 or F32 [${n}, K/G] for weight_shape [${n}, ${k}]`, { tensor: weight, file: t.file });
      }
      const group = k / scale.shape[1];
      if (!(GROUP_SIZES as readonly number[]).includes(group)) {
        throw new QuantShapeMismatchError(`scales [${scale.shape.join(', ')}] imply a group size of ${group} for K = ${k}; supported: ${GROUP_SIZES.join(', ')}`, { tensor: weight, file: t.file });
      }
      const d: Int4Descriptor = { shape: [n, k], group_size: group, scale_dtype: scale.dtype, scheme: 'compressed-tensors', qw: qwName(weight), sc: scName(weight), shape_dtype: shapeTensor.dtype };
      quantization.tensors[weight] = d;
      out.push({ source: t.name, target: d.qw });
    } else if (t.name.endsWith(SCALE)) {
      const module = t.name.slice(0, -SCALE.length);
      if (!byName.has(module + PACKED)) throw new MissingPartError(`'${t.name}' has no '${module}${PACKED}'`, { tensor: `${module}.weight`, file: t.file });
      out.push({ source: t.name, target: scName(`${module}.weight`) });
    } else if (t.name.endsWith(SHAPE)) {
      const module = t.name.slice(0, -SHAPE.length);
      if (!byName.has(module + PACKED)) throw new MissingPartError(`'${t.name}' has no '${module}${PACKED}'`, { tensor: `${module}.weight`, file: t.file });
    } else {
      out.push({ source: t.name, target: t.name });
    }
  }
  if (Object.keys(quantization.tensors).length === 0) {
    throw new QuantConfigError(`config says compressed-tensors pack-quantized, but no '*${PACKED}' tensor was found`);
  }
  return { tensors: out, quantization };
}

export interface ExportTensor {
  name: string;
  dtype: Dtype;
  shape: number[];
  /** Copy this bundle tensor's bytes, or write these bytes. */
  from: { tensor: string } | { bytes: Uint8Array };
}

function shapeBytes(n: number, k: number, dtype: 'I32' | 'I64'): Uint8Array {
  if (dtype === 'I64') return new Uint8Array(BigInt64Array.of(BigInt(n), BigInt(k)).buffer);
  return new Uint8Array(Int32Array.of(n, k).buffer);
}

/**
 * Plans a compressed-tensors export: quantized weights back under their compressed-tensors names
 * with a weight_shape tensor each, everything else as is, in the order the reference writer uses.
 */
export function planCompressedTensorsExport(tensors: readonly TensorInfo[], meta: QuantizationMetadata): ExportTensor[] {
  const partOf = new Map<string, { weight: string; d: Int4Descriptor; kind: 'qw' | 'sc' }>();
  for (const [weight, d] of Object.entries(meta.tensors)) {
    if (!weight.endsWith('.weight')) {
      throw new QuantConfigError(`cannot name '${weight}' in compressed-tensors form: quantized weights must be '<module>.weight'`, { tensor: weight });
    }
    partOf.set(d.qw, { weight, d, kind: 'qw' });
    partOf.set(d.sc, { weight, d, kind: 'sc' });
  }
  const out: ExportTensor[] = [];
  for (const t of tensors) {
    const part = partOf.get(t.name);
    if (part === undefined) {
      out.push({ name: t.name, dtype: t.dtype, shape: [...t.shape], from: { tensor: t.name } });
      continue;
    }
    const module = part.weight.slice(0, -'.weight'.length);
    if (part.kind === 'qw') {
      out.push({ name: module + PACKED, dtype: 'I32', shape: [...t.shape], from: { tensor: t.name } });
      const shapeDtype = part.d.shape_dtype ?? 'I32';
      out.push({ name: module + SHAPE, dtype: shapeDtype, shape: [2], from: { bytes: shapeBytes(part.d.shape[0], part.d.shape[1], shapeDtype) } });
    } else {
      out.push({ name: module + SCALE, dtype: t.dtype, shape: [...t.shape], from: { tensor: t.name } });
    }
  }
  return referenceSafetensorsOrder(out);
}

/**
 * The quantization_config for an export: the imported one verbatim when there is one, else one
 * that describes the descriptors (symmetric INT4 groups, "Linear" targets, every linear module
 * left in float listed in `ignore`).
 */
export function quantizationConfigFor(meta: QuantizationMetadata, tensors: readonly TensorInfo[]): Record<string, unknown> {
  if (meta.compressed_tensors_config !== undefined) return meta.compressed_tensors_config;
  const descriptors = Object.values(meta.tensors);
  const groupSizes = [...new Set(descriptors.map((d) => d.group_size))].sort((a, b) => a - b);
  const quantizedModules = new Set(Object.keys(meta.tensors).map((w) => w.slice(0, -'.weight'.length)));
  const floatLinear = tensors
    .filter((t) => t.shape.length === 2 && t.name.endsWith('.weight'))
    .map((t) => t.name.slice(0, -'.weight'.length))
    .filter((m) => isLinearModule(m) && !quantizedModules.has(m));
  const weights = (groupSize: number) => ({ num_bits: 4, type: 'int', symmetric: true, strategy: 'group', group_size: groupSize, dynamic: false, actorder: null, block_structure: null, observer: 'minmax', observer_kwargs: {} });
  const configGroups: Record<string, unknown> = {};
  groupSizes.forEach((g, i) => {
    const targets = groupSizes.length === 1 ? ['Linear'] : Object.entries(meta.tensors).filter(([, d]) => d.group_size === g).map(([w]) => w.slice(0, -'.weight'.length));
    configGroups[`group_${i}`] = { targets, weights: weights(g), input_activations: null, output_activations: null, format: 'pack-quantized' };
  });
  return {
    quant_method: 'compressed-tensors',
    format: 'pack-quantized',
    quantization_status: 'compressed',
    config_groups: configGroups,
    ignore: meta.preset === 'kimi-k2' ? [...KIMI_K2_IGNORE] : floatLinear,
    kv_cache_scheme: null,
    global_compression_ratio: null,
    sparsity_config: {},
  };
}

/** A model config with its quantization_config replaced (where the model keeps it). */
export function withQuantizationConfig(modelConfig: Record<string, unknown> | undefined, q: Record<string, unknown>): Record<string, unknown> {
  const config = { ...(modelConfig ?? {}) };
  if (isObject(config.text_config) && !isObject(config.quantization_config) && isObject(config.text_config.quantization_config)) {
    config.text_config = { ...config.text_config, quantization_config: q };
  } else {
    config.quantization_config = q;
  }
  return config;
}

/**
 * Descriptors that read a compressed-tensors checkpoint in place (no import): each quantized
 * weight points at its `weight_packed` / `weight_scale` tensors under their original names.
 */
export async function describeCompressedTensors(
  tensors: readonly TensorInfo[],
  found: FoundQuantizationConfig,
  readShape: (name: string) => Promise<number[]>,
): Promise<QuantizationMetadata> {
  const { quantization } = await planCompressedTensorsImport(tensors, found, readShape);
  for (const [weight, d] of Object.entries(quantization.tensors)) {
    const module = weight.slice(0, -'.weight'.length);
    quantization.tensors[weight] = { ...d, qw: module + PACKED, sc: module + SCALE };
  }
  return quantization;
}
