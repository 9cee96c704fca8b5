#!/usr/bin/env python3
"""An independent KDTR v1 reader written from docs/format/kdtr-v1.md alone (standard library only).

It exists to prove the spec is complete: the test suite writes bundles with @kdtree/format and runs
the conformance set (packages/format/conformance) through this reader, which must accept and reject
exactly what the spec says.

    python3 tools/kdtr_reader.py FILE.kdtr|INDEX.kdtr.json    # JSON listing, verifies every CRC
    python3 tools/kdtr_reader.py --each FILE...              # one JSON line per file: {file, ok, error}

Exit status: 0 valid, 1 invalid (the reason on stderr), 2 a bug in this reader.
"""
import json
import os
import struct
import sys
import zlib

MAGIC = b"KDTR\r\n\x1a\n"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
ALIGN = 4096
MAX_HEADER = 512 * 1024 * 1024
MAX_SAFE = 2**53 - 1
MAX_DEPTH = 64
TENSOR_KEYS = {"name", "dtype", "shape", "offset", "size", "crc32"}


class KdtrInvalid(Exception):
    pass


class NonInteger(float):
    """A JSON number written with a fraction or exponent: never an integer in the spec's sense."""


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise KdtrInvalid(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name):
    raise KdtrInvalid(f"{name} is not JSON")


def _max_depth(text):
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_strings(value):
    """Section 4: no lone surrogates (an escaped one decodes to a str that has no UTF-8 form)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in v):
                raise KdtrInvalid("lone surrogate in a string")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def strict_json(raw):
    """Section 4: UTF-8 without BOM, one value, no duplicate keys, nesting <= 64, no lone surrogates."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raise KdtrInvalid("byte order mark")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KdtrInvalid(f"not UTF-8: {e}")
    if _max_depth(text) > MAX_DEPTH:
        raise KdtrInvalid("nested too deeply")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=NonInteger, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise KdtrInvalid(f"not JSON: {e}")
    _check_strings(value)
    return value


def is_uint(v, limit=MAX_SAFE):
    return type(v) is int and 0 <= v <= limit


def read_kdtr(path):
    if not os.path.isfile(path):
        raise KdtrInvalid("not a regular file")
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
        if major != 1 or align != ALIGN or any(pre[48:60]):
            raise KdtrInvalid("version, alignment or reserved bytes")
        if max(h_off, h_len, f_len) > MAX_SAFE or f_len != size or h_off < ALIGN or h_off + h_len != f_len:
            raise KdtrInvalid("lengths")
        if h_len > MAX_HEADER:
            raise KdtrInvalid("header too large")
        f.seek(h_off)
        raw = f.read(h_len)
        if zlib.crc32(raw) != h_crc:
            raise KdtrInvalid("header crc32")
        header = strict_json(raw)
        if not isinstance(header, dict) or not isinstance(header.get("metadata"), dict) or not isinstance(header.get("tensors"), list):
            raise KdtrInvalid("header shape")
        if minor == 0 and set(header) != {"metadata", "tensors"}:
            raise KdtrInvalid("unknown top-level key")
        if len(header["tensors"]) != count:
            raise KdtrInvalid("tensor_count")
        end, names, out = ALIGN, set(), []
        for t in header["tensors"]:
            if not isinstance(t, dict):
                raise KdtrInvalid("tensor entry")
            name = t.get("name")
            if not isinstance(name, str) or not name or "\0" in name or len(name.encode()) > 4096 or name in names:
                raise KdtrInvalid(f"name {name!r}")
            if minor == 0 and set(t) != TENSOR_KEYS:
                raise KdtrInvalid(f"{name}: keys")
            if not TENSOR_KEYS <= set(t):
                raise KdtrInvalid(f"{name}: missing keys")
            dtype, shape = t["dtype"], t["shape"]
            if dtype not in DTYPE_BYTES or not isinstance(shape, list) or len(shape) > 16:
                raise KdtrInvalid(f"{name}: dtype/shape")
            if not all(is_uint(d) for d in shape):
                raise KdtrInvalid(f"{name}: shape")
            n = DTYPE_BYTES[dtype]
            for d in shape:
                n *= d
            off, nbytes, crc = t["offset"], t["size"], t["crc32"]
            if not (is_uint(off) and is_uint(nbytes) and is_uint(crc, 0xFFFFFFFF)):
                raise KdtrInvalid(f"{name}: integers")
            if nbytes != n or off % ALIGN or off < end or off + nbytes > h_off:
                raise KdtrInvalid(f"{name}: size/offset")
            f.seek(off)
            data = f.read(nbytes)
            out.append({"name": name, "dtype": dtype, "shape": shape, "offset": off, "size": nbytes,
                        "crc_ok": zlib.crc32(data) == crc, "crc32": crc})
            names.add(name)
            end = off + nbytes
        return {"version": f"{major}.{minor}", "metadata": header["metadata"], "tensors": out, "header_crc32": h_crc, "file_length": f_len}


def read_index(path):
    """Section 7: the index, then every shard, cross-checked."""
    with open(path, "rb") as f:
        index = strict_json(f.read())
    if not isinstance(index, dict) or index.get("format") != "kdtr-index" or index.get("version") != 1 or type(index.get("version")) is not int:
        raise KdtrInvalid("not a version 1 KDTR index")
    if set(index) != {"format", "version", "metadata", "shards", "weight_map"}:
        raise KdtrInvalid("index keys")
    shards, weight_map = index["shards"], index["weight_map"]
    if not isinstance(index["metadata"], dict) or not isinstance(shards, list) or not shards or not isinstance(weight_map, dict):
        raise KdtrInvalid("index shape")
    files, tensors, owner = set(), [], {}
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or set(s) != {"file", "file_length", "header_crc32", "tensor_count"}:
            raise KdtrInvalid(f"shards[{i}]")
        name = s["file"]
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0") or name in files:
            raise KdtrInvalid(f"shards[{i}].file")
        files.add(name)
        if not (is_uint(s["file_length"]) and is_uint(s["header_crc32"], 0xFFFFFFFF) and is_uint(s["tensor_count"], 0xFFFFFFFF)):
            raise KdtrInvalid(f"shards[{i}] integers")
        shard = read_kdtr(os.path.join(os.path.dirname(path), name))
        if (shard["file_length"], shard["header_crc32"], len(shard["tensors"])) != (s["file_length"], s["header_crc32"], s["tensor_count"]):
            raise KdtrInvalid(f"shards[{i}] differs from its index entry")
        for t in shard["tensors"]:
            if t["name"] in owner:
                raise KdtrInvalid(f"{t['name']} in two shards")
            owner[t["name"]] = i
            tensors.append({**t, "file": name})
    for name, i in weight_map.items():
        if not is_uint(i) or i >= len(shards):
            raise KdtrInvalid(f"weight_map[{name!r}]")
    if weight_map != owner:
        raise KdtrInvalid("weight_map differs from the shards' tensors")
    return {"version": "index 1", "metadata": index["metadata"], "tensors": tensors}


def read_any(path):
    with open(path, "rb") as f:
        head = f.read(8)
    return read_kdtr(path) if head == MAGIC or not head.lstrip().startswith(b"{") else read_index(path)


def main(argv):
    if argv[:1] == ["--each"]:
        for path in argv[1:]:
            try:
                listing = read_any(path)
                bad = [t["name"] for t in listing["tensors"] if not t["crc_ok"]]
                print(json.dumps({"file": path, "ok": not bad, "error": f"crc32 of {bad[0]!r}" if bad else None}))
            except KdtrInvalid as e:
                print(json.dumps({"file": path, "ok": False, "error": str(e)}))
        return 0
    try:
        print(json.dumps(read_any(argv[0])))
    except KdtrInvalid as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:  # a bug here, not an invalid file
        import traceback
        traceback.print_exc()
        sys.exit(2)
