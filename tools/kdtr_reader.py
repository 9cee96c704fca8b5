#!/usr/bin/env python3
"""An independent KDTR v1 reader written from docs/format/kdtr-v1.md alone (standard library only).

It exists to prove the spec is complete: the test suite writes bundles with @kdtree/format and
checks that this reader validates them and reads the same tensor bytes.

    python3 tools/kdtr_reader.py FILE.kdtr          # prints a JSON listing, verifies every CRC
"""
import json
import os
import struct
import sys
import zlib

MAGIC = b"KDTR\r\n\x1a\n"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER = 512 * 1024 * 1024
MAX_SAFE = 2**53 - 1


class KdtrInvalid(Exception):
    pass


def read_kdtr(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pre = f.read(64)
        if len(pre) < 64 or pre[:8] != MAGIC:
            raise KdtrInvalid("bad magic or short file")
        if zlib.crc32(pre[:60]) != struct.unpack_from("<I", pre, 60)[0]:
            raise KdtrInvalid("preamble crc32")
        major, minor, align = struct.unpack_from("<HHI", pre, 8)
        h_off, h_len, f_len = struct.unpack_from("<QQQ", pre, 16)
        h_crc, count = struct.unpack_from("<II", pre, 40)
        if major != 1 or align != 4096 or any(pre[48:60]):
            raise KdtrInvalid("version, alignment or reserved bytes")
        if max(h_off, h_len, f_len) > MAX_SAFE or f_len != size or h_off < 64 or h_off + h_len != f_len:
            raise KdtrInvalid("lengths")
        if h_len > MAX_HEADER:
            raise KdtrInvalid("header too large")
        f.seek(h_off)
        raw = f.read(h_len)
        if zlib.crc32(raw) != h_crc:
            raise KdtrInvalid("header crc32")
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict) or not isinstance(header.get("metadata"), dict) or not isinstance(header.get("tensors"), list):
            raise KdtrInvalid("header shape")
        if minor == 0 and set(header) != {"metadata", "tensors"}:
            raise KdtrInvalid("unknown top-level key")
        if len(header["tensors"]) != count:
            raise KdtrInvalid("tensor_count")
        end, names, out = 4096, set(), []
        for t in header["tensors"]:
            name, dtype, shape = t["name"], t["dtype"], t["shape"]
            if not isinstance(name, str) or not name or "\0" in name or len(name.encode()) > 4096 or name in names:
                raise KdtrInvalid(f"name {name!r}")
            if minor == 0 and set(t) != {"name", "dtype", "shape", "offset", "size", "crc32"}:
                raise KdtrInvalid(f"{name}: keys")
            if dtype not in DTYPE_BYTES or not isinstance(shape, list) or len(shape) > 16:
                raise KdtrInvalid(f"{name}: dtype/shape")
            n = DTYPE_BYTES[dtype]
            for d in shape:
                if type(d) is not int or d < 0:
                    raise KdtrInvalid(f"{name}: shape")
                n *= d
            off, nbytes, crc = t["offset"], t["size"], t["crc32"]
            if any(type(v) is not int or v < 0 for v in (off, nbytes, crc)) or crc > 0xFFFFFFFF:
                raise KdtrInvalid(f"{name}: integers")
            if nbytes != n or off % 4096 or off < end or off + nbytes > h_off:
                raise KdtrInvalid(f"{name}: size/offset")
            f.seek(off)
            data = f.read(nbytes)
            out.append({"name": name, "dtype": dtype, "shape": shape, "offset": off, "size": nbytes,
                        "crc_ok": zlib.crc32(data) == crc, "crc32": crc})
            names.add(name)
            end = off + nbytes
        return {"version": f"{major}.{minor}", "metadata": header["metadata"], "tensors": out}


if __name__ == "__main__":
    try:
        print(json.dumps(read_kdtr(sys.argv[1])))
    except KdtrInvalid as e:
        print(f"invalid: {e}", file=sys.stderr)
        sys.exit(1)
