// Reads a .tgz as npm and pnpm write it (ustar, with pax headers for long names): path -> bytes.
import { readFileSync } from 'node:fs';
import { gunzipSync } from 'node:zlib';

export function readTarball(path) {
  const tar = gunzipSync(readFileSync(path));
  const files = new Map();
  let pax = null;
  for (let at = 0; at + 512 <= tar.length; ) {
    const header = tar.subarray(at, at + 512);
    if (header.every((b) => b === 0)) break;
    const field = (start, length) => header.toString('utf8', start, start + length).replace(/\0.*$/s, '');
    const size = parseInt(field(124, 12).trim() || '0', 8);
    const type = field(156, 1) || '0';
    const prefix = field(345, 155);
    let name = prefix ? `${prefix}/${field(0, 100)}` : field(0, 100);
    const body = tar.subarray(at + 512, at + 512 + size);
    at += 512 + Math.ceil(size / 512) * 512;
    if (type === 'x') {
      pax = /(?:^|\n)\d+ path=([^\n]*)\n/.exec(body.toString('utf8'))?.[1] ?? null;
      continue;
    }
    if (pax) {
      name = pax;
      pax = null;
    }
    if (type === '0' || type === '\0') files.set(name.replace(/^package\//, ''), Buffer.from(body));
  }
  return files;
}
