/**
 * What a command may write. Two checks run before any output is created:
 *
 * - no output is the same file as an input, or as another output: compared by device and inode
 *   (so `a.kdtr`, `./a.kdtr`, a hard link or a symlink to it all count as the same file), and for
 *   outputs that do not exist yet by their resolved directory and name;
 * - an output's name does not promise another format than what is written into it (KDTR bytes in
 *   `x.safetensors` would be read by other tools as a corrupt safetensors file).
 */
import { realpath, stat } from 'node:fs/promises';
import { basename, dirname, join, resolve } from 'node:path';
import { ShardedKdtrWriter, type AnyTensorStore } from '@kdtree/format';
import { CliUsageError } from './cli-error.js';

export interface OutputPath {
  /** The flag that named it, for messages: "-o", "--logits". */
  flag: string;
  path: string;
  /** A multi-file KDTR index: its shards (`<stem>-00001.kdtr`, ...) are outputs too. */
  sharded?: boolean;
}

/** A file's identity: device and inode when it exists, else its resolved path. */
async function identity(path: string): Promise<string> {
  const info = await stat(path).catch(() => undefined);
  if (info !== undefined) return `inode ${info.dev}:${info.ino}`;
  const dir = await realpath(dirname(path)).catch(() => resolve(dirname(path)));
  return `path ${join(dir, basename(path))}`;
}

/** Every file a store reads: the path it was opened from and each file holding its tensors. */
export function storeFiles(stores: readonly AnyTensorStore[]): string[] {
  return [...new Set(stores.flatMap((s) => [s.path, ...s.tensors.map((t) => t.file), ...('fileNames' in s ? s.fileNames : [])]))];
}

/**
 * Refuses outputs that would overwrite an input (or each other). `inputs` are every file the
 * command reads: the stores' files (storeFiles), config and rules files.
 */
export async function refuseOverwritingInputs(command: string, outputs: readonly OutputPath[], inputs: readonly string[]): Promise<void> {
  const inputIds = new Map<string, string>();
  for (const input of inputs) {
    const info = await stat(input).catch(() => undefined);
    if (info?.isFile()) inputIds.set(await identity(input), input);
  }
  const outputIds = new Map<string, OutputPath>();
  for (const out of outputs) {
    const id = await identity(out.path);
    const input = inputIds.get(id);
    if (input !== undefined) {
      throw new CliUsageError(`${command}: ${out.flag} ${out.path} is the input ${input}; writing it would destroy the input (choose another output name)`, command);
    }
    const other = outputIds.get(id);
    if (other !== undefined) throw new CliUsageError(`${command}: ${out.flag} ${out.path} and ${other.flag} ${other.path} are the same file; give each output its own name`, command);
    outputIds.set(id, out);
    if (out.sharded) {
      for (const [, file] of inputIds) {
        if (await wouldBeShard(out.path, file)) {
          throw new CliUsageError(`${command}: ${out.flag} ${out.path} would write its shards over the input ${file} (choose another output name)`, command);
        }
      }
    }
  }
}

/** Whether `file` is where a shard of the index `indexPath` would go (both resolved). */
async function wouldBeShard(indexPath: string, file: string): Promise<boolean> {
  const dir = await realpath(dirname(indexPath)).catch(() => resolve(dirname(indexPath)));
  const real = await realpath(file).catch(() => resolve(file));
  return ShardedKdtrWriter.isShardPath(join(dir, basename(indexPath)), real);
}

export type OutputContent = 'kdtr' | 'kdtr-index' | 'safetensors' | 'npy';

const WHAT: Record<OutputContent, string> = {
  kdtr: 'a KDTR bundle (name it NAME.kdtr)',
  'kdtr-index': 'the JSON index of a multi-file KDTR bundle (name it NAME.kdtr.json)',
  safetensors: 'a safetensors file (name it NAME.safetensors)',
  npy: 'a NumPy .npy array (name it NAME.npy)',
};

/** The content a file name promises, from its extension; undefined when it promises nothing known. */
function promised(path: string): OutputContent | 'json' | undefined {
  const name = basename(path).toLowerCase();
  if (name.endsWith('.safetensors')) return 'safetensors';
  if (name.endsWith('.safetensors.index.json')) return 'json';
  if (name.endsWith('.kdtr.json')) return 'kdtr-index';
  if (name.endsWith('.kdtr')) return 'kdtr';
  if (name.endsWith('.npy')) return 'npy';
  if (name.endsWith('.json')) return 'json';
  return undefined;
}

/**
 * Refuses a name whose extension says another format than `content` (KDTR bytes into
 * `x.safetensors`, a safetensors file into `x.kdtr`, an index into `x.kdtr`). A name without a
 * known extension is accepted; a multi-file index must end in .json.
 */
export function checkOutputName(command: string, flag: string, path: string, content: OutputContent): void {
  const says = promised(path);
  const lower = path.toLowerCase();
  const ok = content === 'kdtr-index' ? lower.endsWith('.json') && !lower.endsWith('.safetensors.index.json') : says === undefined || says === content;
  if (ok) return;
  const named = content === 'kdtr-index' ? 'not a .kdtr.json name' : says === 'json' ? 'a .json name' : `named as ${WHAT[says!].replace(/ \(.*$/, '')}`;
  throw new CliUsageError(`${command}: ${flag} ${path} is ${named}, but ${command} writes ${WHAT[content]}`, command);
}
