// The newest glibc and libstdc++ symbol versions an ELF shared object needs (its .gnu.version_r
// section: the version the dynamic linker must find, per library). They are the platform floor a
// prebuilt binary sets: a system with an older glibc or libstdc++ refuses to load it.
import { readFileSync } from 'node:fs';

const SHT_GNU_VERNEED = 0x6ffffffe;

/** Compares dotted versions: negative when a < b. */
export function compareVersions(a, b) {
  const x = a.split('.').map(Number);
  const y = b.split('.').map(Number);
  for (let i = 0; i < Math.max(x.length, y.length); i++) {
    const d = (x[i] ?? 0) - (y[i] ?? 0);
    if (d !== 0) return d;
  }
  return 0;
}

/**
 * { glibc, glibcxx } of a 64-bit little-endian ELF file: the highest GLIBC_x and GLIBCXX_x
 * versions it needs (null where it needs none), or null for a file that is not such an ELF.
 */
export function elfNeeds(path) {
  const buf = readFileSync(path);
  if (buf.length < 64 || buf.readUInt32BE(0) !== 0x7f454c46 || buf[4] !== 2 || buf[5] !== 1) return null;
  const shoff = Number(buf.readBigUInt64LE(0x28));
  const shentsize = buf.readUInt16LE(0x3a);
  const shnum = buf.readUInt16LE(0x3c);
  const section = (i) => {
    const at = shoff + i * shentsize;
    return { type: buf.readUInt32LE(at + 4), offset: Number(buf.readBigUInt64LE(at + 0x18)), link: buf.readUInt32LE(at + 0x28), info: buf.readUInt32LE(at + 0x2c) };
  };
  const needs = { glibc: null, glibcxx: null };
  for (let i = 0; i < shnum; i++) {
    const s = section(i);
    if (s.type !== SHT_GNU_VERNEED) continue;
    const strtab = section(s.link).offset;
    const str = (off) => {
      const start = strtab + off;
      return buf.toString('latin1', start, buf.indexOf(0, start));
    };
    // Verneed entries (vn_version, vn_cnt, vn_file, vn_aux, vn_next), each with vn_cnt Vernaux
    // entries (vna_hash, vna_flags, vna_other, vna_name, vna_next)
    let vn = s.offset;
    for (let n = 0; n < s.info; n++) {
      let aux = vn + buf.readUInt32LE(vn + 8);
      for (let a = 0; a < buf.readUInt16LE(vn + 2); a++) {
        const m = /^(GLIBC|GLIBCXX)_(\d+(?:\.\d+)*)$/.exec(str(buf.readUInt32LE(aux + 8)));
        if (m) {
          const key = m[1] === 'GLIBC' ? 'glibc' : 'glibcxx';
          if (needs[key] === null || compareVersions(m[2], needs[key]) > 0) needs[key] = m[2];
        }
        const next = buf.readUInt32LE(aux + 12);
        if (next === 0) break;
        aux += next;
      }
      const next = buf.readUInt32LE(vn + 12);
      if (next === 0) break;
      vn += next;
    }
  }
  return needs;
}
