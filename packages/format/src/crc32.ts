import * as zlib from 'node:zlib';

/**
 * CRC-32 (ISO-HDLC, the zlib/PNG polynomial 0xEDB88320, reflected, init and xorout 0xFFFFFFFF),
 * incremental: crc32(b, crc32(a)) === crc32(a ++ b). Node's zlib computes it with SIMD (about
 * 5 GB/s on one core here); every language has it in its standard library, which keeps KDTR easy
 * to implement elsewhere.
 */
export function crc32(data: Uint8Array, previous = 0): number {
  return zlib.crc32(data, previous) >>> 0;
}

export function formatCrc32(value: number): string {
  return value.toString(16).padStart(8, '0');
}
