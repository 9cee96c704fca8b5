import { describe, expect, it } from 'vitest';
import { newQuantizationMetadata, readQuantizationMetadata, SAFETENSORS_QUANTIZATION_KEY, validateQuantizedStore } from './descriptor.js';
import { MissingPartError, QuantConfigError } from './errors.js';

const descriptor = { shape: [64, 256], group_size: 32, scale_dtype: 'BF16', scheme: 'minmax', qw: 'w.qw', sc: 'w.sc' };
const valid = () => ({ ...newQuantizationMetadata({ preset: 'seed' }), tensors: { w: { ...descriptor } } }) as Record<string, unknown> & { tensors: Record<string, Record<string, unknown>> };
const kdtrStore = (quantization: unknown) => ({ path: 'm.kdtr', format: 'kdtr', metadata: { quantization } });

function tensor(name: string, dtype: string, shape: number[]) {
  return { name, dtype, shape, size: 0, file: 'm.kdtr', offset: 4096 } as never;
}

function storeWith(quantization: unknown, names: [string, string, number[]][]) {
  const tensors = names.map(([n, d, s]) => tensor(n, d, s));
  return { ...kdtrStore(quantization), tensors, has: (n: string) => names.some(([m]) => m === n), get: (n: string) => tensors.find((t: { name: string }) => t.name === n)! };
}

describe('quantization metadata schema', () => {
  it('accepts what newQuantizationMetadata writes', () => {
    expect(readQuantizationMetadata(kdtrStore(valid()))?.tensors.w).toEqual(descriptor);
    expect(readQuantizationMetadata({ path: 'm.kdtr', metadata: {} })).toBeUndefined();
  });

  it('names the key and what it expected for every violation', () => {
    const cases: [string, (q: ReturnType<typeof valid>) => void, RegExp][] = [
      ['format', (q) => (q.format = 'kdtree.int4/2'), /metadata\.quantization\.format: expected "kdtree\.int4\/1", found "kdtree\.int4\/2"/],
      ['bits', (q) => (q.bits = 8), /\.bits: expected 4, found 8/],
      ['symmetric', (q) => (q.symmetric = false), /\.symmetric: expected true/],
      ['packing', (q) => delete q.packing, /\.packing: expected a string/],
      ['tensors', (q) => (q.tensors = [] as never), /\.tensors: expected an object/],
      ['unknown key', (q) => (q.tensor = {}), /\.tensor: expected no such key/],
      ['descriptor key', (q) => (q.tensors.w.groupsize = 32), /tensors\["w"\]\.groupsize: expected no such key/],
      ['shape', (q) => (q.tensors.w.shape = [64]), /tensors\["w"\]\.shape: expected \[N, K\] of positive integers/],
      ['group_size', (q) => (q.tensors.w.group_size = 16), /\.group_size: expected one of 32, 64, 128, found 16/],
      ['scale_dtype', (q) => (q.tensors.w.scale_dtype = 'F16'), /\.scale_dtype: expected "BF16" or "F32"/],
      ['scheme', (q) => delete q.tensors.w.scheme, /\.scheme: expected one of minmax, absmax7, compressed-tensors/],
      ['qw', (q) => (q.tensors.w.qw = 7), /\.qw: expected the name of the packed tensor/],
      ['sc', (q) => delete q.tensors.w.sc, /\.sc: expected the name of the scales tensor/],
      ['shape_dtype', (q) => (q.tensors.w.shape_dtype = 'I16'), /\.shape_dtype: expected "I32" or "I64"/],
    ];
    for (const [what, mutate, message] of cases) {
      const q = valid();
      mutate(q);
      expect(() => readQuantizationMetadata(kdtrStore(q)), what).toThrow(QuantConfigError);
      expect(() => readQuantizationMetadata(kdtrStore(q)), what).toThrow(message);
    }
  });

  it('reads the metadata a safetensors file carries as JSON text in __metadata__', () => {
    const st = { path: 'm.safetensors', format: 'safetensors', metadata: { format: 'pt', [SAFETENSORS_QUANTIZATION_KEY]: JSON.stringify(valid()) } };
    expect(readQuantizationMetadata(st)?.tensors.w).toEqual(descriptor);
    expect(() => readQuantizationMetadata({ ...st, metadata: { [SAFETENSORS_QUANTIZATION_KEY]: '{"format": 1,' } })).toThrow(/__metadata__\["kdtree\.quantization"\] is not JSON/);
    // In a KDTR bundle that key is just a string; only metadata.quantization counts there.
    expect(readQuantizationMetadata({ path: 'm.kdtr', format: 'kdtr', metadata: { [SAFETENSORS_QUANTIZATION_KEY]: JSON.stringify(valid()) } })).toBeUndefined();
  });

  it('a .qw or .sc tensor without a descriptor is an error, with or without its partner', () => {
    const parts: [string, string, number[]][] = [['w.qw', 'I32', [64, 32]], ['w.sc', 'BF16', [64, 8]]];
    expect(validateQuantizedStore(storeWith(valid(), parts) as never)?.tensors.w).toBeDefined();
    expect(() => validateQuantizedStore(storeWith(undefined, parts) as never)).toThrow(MissingPartError);
    expect(() => validateQuantizedStore(storeWith(undefined, parts) as never)).toThrow(/'w\.qw' has no descriptor in metadata\.quantization\.tensors/);
    expect(() => validateQuantizedStore(storeWith(undefined, [parts[1]]) as never)).toThrow(/'w\.sc' has no packed codes 'w\.qw'/);
    expect(() => validateQuantizedStore(storeWith(valid(), [parts[0]]) as never)).toThrow(/scales 'w\.sc' missing from the bundle/);
  });
});
