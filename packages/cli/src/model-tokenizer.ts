import { stat } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { readShardIndex, shardIndexPath } from '@kdtree/engine';
import { openBundle } from '@kdtree/format';
import { loadTokenizer, TOKENIZER_METADATA_KEY, tokenizerFromMetadata, type Tokenizer } from '@kdtree/tokenizer';
import { CliError } from './cli-error.js';

/**
 * The tokenizer of a model: a model directory's files (tiktoken.model, tokenizer_config.json,
 * chat_template.jinja), or what a KDTR bundle carries in its metadata (`metadata.tokenizer`, see
 * docs/tokenizer.md), or the files beside a safetensors checkpoint. A shard directory's rank files
 * each carry the source bundle's: rank 0's is read. `elsewhere`: how the command takes another
 * source, which the errors suggest.
 */
export async function openTokenizer(path: string, elsewhere = 'with --tokenizer DIR'): Promise<Tokenizer> {
  const info = await stat(path).catch(() => undefined);
  if (info === undefined) throw new CliError(`${path}: no such file or directory (expected a model directory or a KDTR bundle)`);
  const index = await shardIndexPath(path);
  if (index !== undefined) return openTokenizer(join(path, (await readShardIndex(index)).ranks[0].file), elsewhere);
  if (info.isDirectory()) return loadTokenizer(path);
  if (/\.safetensors$/i.test(path)) {
    const dir = dirname(path);
    if ((await stat(join(dir, 'tiktoken.model')).catch(() => undefined)) !== undefined) return loadTokenizer(dir);
    throw new CliError(`${path}: no tokenizer beside it (no ${join(dir, 'tiktoken.model')}); give its model directory ${elsewhere}`);
  }
  const bundle = await openBundle(path);
  try {
    const tokenizer = tokenizerFromMetadata(bundle.metadata, path);
    if (tokenizer === undefined) throw new CliError(`${path}: the bundle carries no tokenizer (metadata.${TOKENIZER_METADATA_KEY}); give the model directory it came from ${elsewhere}, or import it from there`);
    return tokenizer;
  } finally {
    await bundle.close();
  }
}
