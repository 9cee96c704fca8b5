/**
 * Bit-exactness against torch: tools/fixtures/gen_quant_fixtures.py computed weight_packed and
 * weight_scale with compressed-tensors' published calculate_qparams and pack_to_int32 (in torch, on
 * the CPU). The package must reproduce them byte for byte.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { openSafetensors } from '@kdtree/format';
import { quantizeInt4, type ScaleDtype, type ScaleRule } from './int4.js';

const FIXTURES = join(import.meta.dirname, '..', 'fixtures', 'torch');
const { cases } = JSON.parse(readFileSync(join(FIXTURES, 'cases.json'), 'utf8')) as {
  cases: { name: string; rows: number; cols: number; group: number; rule: ScaleRule; scale_dtype: 'bf16' | 'f32' }[];
};

function firstDifference(a: Uint8Array, b: Uint8Array): string {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return `byte ${i}: ${a[i]} vs ${b[i]}`;
  return a.length === b.length ? 'none' : `lengths ${a.length} vs ${b.length}`;
}

describe('bit-exact with torch / compressed-tensors', () => {
  it(`reproduces weight_packed and weight_scale of all ${cases.length} cases`, async () => {
    expect(cases.length).toBeGreaterThanOrEqual(28);
    const st = await openSafetensors(join(FIXTURES, 'cases.safetensors'));
    for (const c of cases) {
      const w = (await st.readTyped(`${c.name}.w`, 'F32')) as Float32Array;
      const scaleDtype: ScaleDtype = c.scale_dtype === 'bf16' ? 'BF16' : 'F32';
      const m = quantizeInt4(w, c.rows, c.cols, { groupSize: c.group, rule: c.rule, scaleDtype, name: c.name });
      const torchPacked = await st.read(`${c.name}.weight_packed`);
      const torchScales = await st.read(`${c.name}.weight_scale`);
      const ourPacked = new Uint8Array(m.packed.buffer);
      const ourScales = new Uint8Array(m.scales.buffer);
      expect(st.get(`${c.name}.weight_scale`).dtype, c.name).toBe(scaleDtype);
      expect(firstDifference(ourScales, torchScales), `${c.name} scales`).toBe('none');
      expect(firstDifference(ourPacked, torchPacked), `${c.name} packed`).toBe('none');
      expect(Array.from(new Int32Array((await st.read(`${c.name}.weight_shape`)).slice().buffer))).toEqual([c.rows, c.cols]);
    }
    await st.close();
  });
});
