#!/usr/bin/env python3
"""Hashes of the machine code of an addon's kernels, to tell whether two builds run the same code.

    python3 tools/gpu/kernel_text.py BUILD.node [NAME_REGEX]

Prints, per kernel whose mangled name matches NAME_REGEX (all by default), the md5 of its .text
section in each cubin of the binary's .nv_fatbin section (objcopy extracts it) and its size. Two
builds whose kernels print the same hashes run the same instructions, so a GPU run of one stands for
the other (a build that only renames template arguments or deletes another instance keeps them).
Needs binutils' objcopy; reads uncompressed cubins only.
"""
import hashlib
import re
import struct
import subprocess
import sys
import tempfile


def cubin_sections(blob, start):
    """(name, offset, size) of the sections of the ELF64 cubin at `start`."""
    shoff = struct.unpack_from('<Q', blob, start + 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', blob, start + 0x3A)
    headers = [struct.unpack_from('<IIQQQQ', blob, start + shoff + i * shentsize) for i in range(shnum)]
    names_at = start + headers[shstrndx][4]
    for name, _type, _flags, _addr, offset, size in headers:
        end = blob.index(b'\0', names_at + name)
        yield blob[names_at + name:end].decode(), start + offset, size


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else '')
    with tempfile.NamedTemporaryFile() as fatbin:
        subprocess.run(['objcopy', '-O', 'binary', '--only-section=.nv_fatbin', sys.argv[1], fatbin.name], check=True)
        blob = open(fatbin.name, 'rb').read()
    for match in re.finditer(b'\x7fELF', blob):
        try:
            sections = list(cubin_sections(blob, match.start()))
        except (struct.error, ValueError, IndexError):
            continue  # not a cubin header (the magic inside other data)
        for name, offset, size in sections:
            if name.startswith('.text.') and pattern.search(name):
                print(hashlib.md5(blob[offset:offset + size]).hexdigest(), size, name[len('.text.'):])


if __name__ == '__main__':
    main()
