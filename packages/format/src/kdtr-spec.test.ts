/**
 * The spec is complete enough to implement from: tools/kdtr_reader.py was written from
 * docs/format/kdtr-v1.md alone; it must accept what our writer writes, read the same bytes, and
 * reject what our reader rejects.
 */
import { spawnSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { crc32 } from './crc32.js';
import { KdtrWriter } from './kdtr-writer.js';
import { seededBytes, tempDir } from './test-support/tmp.js';

const PY_READER = fileURLToPath(new URL('../../../tools/kdtr_reader.py', import.meta.url));
const SPEC = fileURLToPath(new URL('../../../docs/format/kdtr-v1.md', import.meta.url));
const dir = tempDir();

function pyRead(file: string) {
  const r = spawnSync('python3', [PY_READER, file], { encoding: 'utf8' });
  if (r.error) throw new Error(`python3 is needed for the cross-language spec test: ${r.error.message}`);
  return r;
}

describe('KDTR v1 spec, read by an independent Python implementation', () => {
  it('CRC-32 is the ISO-HDLC check value', () => {
    expect(crc32(new TextEncoder().encode('123456789'))).toBe(0xcbf43926);
  });

  it('the worked example is what our writer writes, byte for byte, and its numbers agree', async () => {
    const text = readFileSync(SPEC, 'utf8');
    const example = text.slice(text.indexOf('## 8. Worked example'), text.indexOf('## 9.'));
    const file = join(dir, 'example.kdtr');
    const w = await KdtrWriter.create(file, { metadata: { config: { hidden_size: 2 } } });
    await w.add({ name: 'w', dtype: 'F32', shape: [2] }, new Float32Array([1, -2]));
    await w.close();
    const bytes = readFileSync(file);
    expect(example).toContain(`${bytes.length} bytes`);
    // Every hex row of the dump, at its offset.
    const rows = [...example.matchAll(/^([0-9a-f]{8}): ((?:[0-9a-f]{4} ?)+)/gm)];
    expect(rows.length).toBe(5);
    for (const [, offset, hex] of rows) {
      const expected = Buffer.from(hex.replace(/\s/g, ''), 'hex');
      const at = Number.parseInt(offset, 16);
      expect(bytes.subarray(at, at + expected.length).toString('hex'), `row ${offset}`).toBe(expected.toString('hex'));
    }
    const headerOffset = Number(bytes.readBigUInt64LE(16));
    const header = /^00001008: ([^\n]*)\n\s+([^\n]*)/m.exec(example)!;
    expect(bytes.subarray(headerOffset).toString('utf8')).toBe(header[1] + header[2]);
    // Each "0x... = decimal" pair names the same number, and each CRC is the real one.
    for (const [, hex, dec] of example.matchAll(/0x([0-9a-f]{8}) = (\d+)/g)) expect(Number.parseInt(hex, 16), hex).toBe(Number(dec));
    const dataCrc = crc32(bytes.subarray(4096, 4104));
    expect(example).toContain(`crc32 0x${dataCrc.toString(16)} = ${dataCrc}`);
    expect(example).toContain(`header_crc32 0x${crc32(bytes.subarray(headerOffset)).toString(16)}`);
    expect(example).toContain(`preamble_crc32 0x${crc32(bytes.subarray(0, 60)).toString(16).padStart(8, '0')}`);
  });

  it('reads what our writer writes, with the same bytes and checksums', async () => {
    const file = join(dir, 'x.kdtr');
    const w = await KdtrWriter.create(file, { metadata: { config: { a: 1 }, golden: { tokens: [1, 2] } } });
    const data = [seededBytes(10_000, 1), seededBytes(6, 2), new Uint8Array(0)];
    await w.add({ name: 'ünï.weight', dtype: 'BF16', shape: [100, 50] }, data[0]);
    await w.add({ name: 'b', dtype: 'I16', shape: [3] }, data[1]);
    await w.add({ name: 'e', dtype: 'F32', shape: [0, 7] }, data[2]);
    await w.close();
    const r = pyRead(file);
    expect(r.stderr).toBe('');
    const listing = JSON.parse(r.stdout);
    expect(listing.metadata).toEqual({ config: { a: 1 }, golden: { tokens: [1, 2] } });
    expect(listing.tensors.map((t: { name: string; crc_ok: boolean; crc32: number }) => [t.name, t.crc_ok, t.crc32])).toEqual([
      ['ünï.weight', true, crc32(data[0])],
      ['b', true, crc32(data[1])],
      ['e', true, 0],
    ]);
    const bytes = readFileSync(file);
    bytes[listing.tensors[1].offset] ^= 0xff;
    writeFileSync(file, bytes);
    expect(JSON.parse(pyRead(file).stdout).tensors[1].crc_ok).toBe(false);
    bytes[5] ^= 1;
    writeFileSync(file, bytes);
    expect(pyRead(file).status).toBe(1);
  });
});
