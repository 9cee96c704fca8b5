import { stat } from 'node:fs/promises';
import { BadMagicError } from './errors.js';
import { openRegularFile } from './file-access.js';
import { KDTR_MAGIC } from './kdtr-layout.js';
import { openBundle, type KdtrBundle, type OpenOptions } from './kdtr-reader.js';
import { preadFully } from './positional-io.js';
import { openSafetensors, type SafetensorsCheckpoint } from './safetensors.js';

export type AnyTensorStore = KdtrBundle | SafetensorsCheckpoint;

/**
 * Opens whatever holds tensors at `path`: a .kdtr file or KDTR index, a .safetensors file, a
 * model.safetensors.index.json, or a HuggingFace model directory. Decided by content, not name;
 * a file that is none of these is a BadMagicError saying so.
 */
export async function openTensors(path: string, options: OpenOptions = {}): Promise<AnyTensorStore> {
  if ((await stat(path)).isDirectory()) return openSafetensors(path, options);
  const { handle, size } = await openRegularFile(path, 'kdtr');
  const head = new Uint8Array(Math.min(256, size));
  try {
    await preadFully(handle, head, 0, head.byteLength, 0, { file: path, format: 'kdtr' });
  } finally {
    await handle.close();
  }
  if (head.byteLength >= KDTR_MAGIC.byteLength && KDTR_MAGIC.every((b, i) => head[i] === b)) return openBundle(path, options);
  const text = new TextDecoder().decode(head);
  if (/^\s*\{/.test(text)) {
    // A JSON index: ours says "format": "kdtr-index"; HuggingFace's has "weight_map" of file names.
    return /"format"\s*:\s*"kdtr-index"/.test(text) ? openBundle(path, options) : openSafetensors(path, options);
  }
  if (looksLikeSafetensors(head)) return openSafetensors(path, options);
  throw new BadMagicError('neither a KDTR bundle nor a safetensors file (nor a JSON index of either)', {
    file: path,
    expected: 'the KDTR magic "KDTR\\r\\n\\x1a\\n", a u64 header length followed by "{" (safetensors), or a JSON index',
    actual: head.byteLength === 0 ? '(empty file)' : Array.from(head.subarray(0, 16), (b) => b.toString(16).padStart(2, '0')).join(' '),
  });
}

/**
 * A safetensors file starts with its header length (u64, little-endian, at least 2 for "{}") and
 * the header, which the reference library requires to begin with "{". A zeroed or foreign file
 * fails this, so it is not reported as a safetensors file with bad JSON.
 */
function looksLikeSafetensors(head: Uint8Array): boolean {
  if (head.byteLength < 9) return false;
  const length = new DataView(head.buffer, head.byteOffset, 8).getBigUint64(0, true);
  return length >= 2n && head[8] === 0x7b;
}
