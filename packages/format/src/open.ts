import { open, stat } from 'node:fs/promises';
import { KDTR_MAGIC } from './kdtr-layout.js';
import { openBundle, type KdtrBundle, type OpenOptions } from './kdtr-reader.js';
import { openSafetensors, type SafetensorsCheckpoint } from './safetensors.js';

export type AnyTensorStore = KdtrBundle | SafetensorsCheckpoint;

/**
 * Opens whatever holds tensors at `path`: a .kdtr file or KDTR index, a .safetensors file, a
 * model.safetensors.index.json, or a HuggingFace model directory. Decided by content, not name.
 */
export async function openTensors(path: string, options: OpenOptions = {}): Promise<AnyTensorStore> {
  if ((await stat(path)).isDirectory()) return openSafetensors(path, options);
  const handle = await open(path, 'r');
  const head = new Uint8Array(256);
  let n: number;
  try {
    ({ bytesRead: n } = await handle.read(head, 0, head.byteLength, 0));
  } finally {
    await handle.close();
  }
  if (n >= KDTR_MAGIC.byteLength && KDTR_MAGIC.every((b, i) => head[i] === b)) return openBundle(path, options);
  const text = new TextDecoder().decode(head.subarray(0, n));
  if (/^\s*\{/.test(text)) {
    // A JSON index: ours says "format": "kdtr-index"; HuggingFace's has "weight_map" of file names.
    return /"format"\s*:\s*"kdtr-index"/.test(text) ? openBundle(path, options) : openSafetensors(path, options);
  }
  return openSafetensors(path, options);
}
