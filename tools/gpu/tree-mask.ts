/**
 * The ancestor mask of a DDTree-shaped tree of `nodes` nodes (node 0 the root; node i's parent is
 * (i - 1) >> 1, a binary heap: depth ~log2(nodes)), for benchmarks and profiles of tree verify.
 * mask[i * nodes + j] = 1 when j is i or one of its ancestors.
 */
export function treeMask(nodes: number): Uint8Array {
  const mask = new Uint8Array(nodes * nodes);
  for (let i = 0; i < nodes; i++) for (let j = i; ; j = (j - 1) >> 1) {
    mask[i * nodes + j] = 1;
    if (j === 0) break;
  }
  return mask;
}
