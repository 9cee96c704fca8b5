/** The data a writer accepts for one tensor: bytes, a typed array, or a stream of chunks. */
export type TensorData = ArrayBufferView | Iterable<Uint8Array> | AsyncIterable<Uint8Array>;

export function isView(data: TensorData): data is ArrayBufferView {
  return ArrayBuffer.isView(data);
}

/** Chunks of tensor data as byte views, whatever form the caller gave it in. */
export async function* dataChunks(data: TensorData): AsyncGenerator<Uint8Array> {
  if (isView(data)) {
    yield new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    return;
  }
  for await (const chunk of data as AsyncIterable<Uint8Array>) {
    yield ArrayBuffer.isView(chunk) ? new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength) : chunk;
  }
}
