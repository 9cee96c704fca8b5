import { readdir, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { makeDirectories } from '@kdtree/format';
import { ModelSource, rankFileName, SHARD_INDEX_NAME, shardIndexPath, writeShards } from '@kdtree/engine';
import { parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { jsonReport, type CommandIO } from '../io.js';
import { refuseOverwritingInputs, storeFiles } from '../output-paths.js';
import { formatBytes, formatDuration } from '../output.js';

export const shardSpec: CommandSpec = {
  name: 'shard',
  summary: `Cut a model into N tensor-parallel shards: one KDTR file per rank (rank-R.kdtr) holding that rank's block of every weight, and an index (${SHARD_INDEX_NAME}) naming each weight's split. The split is the one the engine's layers cut at load time (heads, intermediate channels, vocabulary; INT4 groups are never split); written in one streaming pass in bounded memory. kdtree run DIR --tp N then reads on each rank only its own file.`,
  usage: 'kdtree shard MODEL --tp N -o DIR [--config config.json] [--force] [--json] [--quiet]',
  help: [
    '--tp N                the number of ranks (it must divide the heads, every MLP intermediate size in whole INT4 groups, and the vocabulary)',
    '-o, --output DIR      the shard directory to write (created; an existing one must be empty unless --force)',
    '--config FILE         a config.json for a checkpoint that has none beside it',
    "--force               write into a non-empty DIR (its rank files and index are replaced; other files are left)",
    '--json                print a JSON summary (schema "kdtree.shard/1")',
    '-q, --quiet           no progress on stderr',
  ],
  options: {
    tp: { type: 'string' },
    output: { type: 'string', short: 'o' },
    config: { type: 'string' },
    force: { type: 'boolean' },
    json: { type: 'boolean' },
    quiet: { type: 'boolean', short: 'q' },
  },
  positionals: [1, 1],
};

/** Refuses a DIR that is a file, or a non-empty directory without --force. */
async function checkOutputDir(dir: string, force: boolean): Promise<void> {
  const info = await stat(dir).catch(() => undefined);
  if (info === undefined) return;
  if (!info.isDirectory()) throw new CliUsageError(`shard: -o ${dir} exists and is not a directory (the shards go into a directory)`, 'shard');
  const entries = await readdir(dir);
  if (entries.length > 0 && !force) throw new CliUsageError(`shard: -o ${dir} is not empty (${entries.length} entries); choose an empty or new directory, or pass --force to write into it`, 'shard');
}

export async function runShard(p: Parsed, io: CommandIO): Promise<number> {
  const model = p.positionals[0];
  const tp = parseIntArg(p.values.tp as string | undefined, '--tp', { min: 1, max: 64 });
  if (tp === undefined) throw new CliUsageError('shard: --tp N is required', 'shard');
  const dir = p.values.output as string | undefined;
  if (!dir) throw new CliUsageError('shard: -o DIR is required', 'shard');
  const configPath = p.values.config as string | undefined;
  if ((await stat(model).catch(() => undefined)) === undefined) throw new CliError(`${model}: no such file or directory`);
  if ((await shardIndexPath(model)) !== undefined) throw new CliUsageError(`shard: ${model} is already a shard directory (${SHARD_INDEX_NAME}); cut the bundle it came from`, 'shard');
  await checkOutputDir(dir, Boolean(p.values.force));
  const source = await ModelSource.open(model, { config: configPath });
  try {
    const outputs = [SHARD_INDEX_NAME, ...Array.from({ length: tp }, (_, r) => rankFileName(r))].map((name) => ({ flag: '-o', path: join(dir, name) }));
    await refuseOverwritingInputs('shard', outputs, [...storeFiles([source.store]), ...(configPath ? [configPath] : [])]);
    // the first directory this made, removed again when the model does not split (nothing else is in it then)
    const created = await makeDirectories(dir);
    const quiet = Boolean(p.values.quiet || p.values.json);
    const started = performance.now();
    let bar: ReturnType<CommandIO['progress']> | undefined;
    const result = await writeShards(source, tp, dir, {
      onProgress: (q) => {
        bar ??= io.progress('shard', q.bytesTotal, { enabled: !quiet });
        bar.update(q.bytesDone, q.tensor);
      },
    }).catch(async (error: unknown) => {
      if (created !== undefined) await rm(created, { recursive: true, force: true });
      throw error;
    });
    bar?.finish();
    const seconds = (performance.now() - started) / 1000;
    const tensors = Object.keys(result.index.tensors).length;
    if (p.values.json) {
      io.out(
        jsonReport('kdtree.shard/1', {
          model,
          output: dir,
          index: result.indexPath,
          tp,
          tensors,
          splits: result.splits,
          bytes_read: result.bytesRead,
          ranks: result.index.ranks.map((r) => ({ rank: r.rank, file: join(dir, r.file), bytes: r.file_length, header_crc32: r.header_crc32 })),
          seconds: Number(seconds.toFixed(3)),
        }),
      );
    } else {
      const s = result.splits;
      io.out(`sharded ${model} over ${tp} rank${tp === 1 ? '' : 's'} into ${dir} in ${formatDuration(seconds)}: ${tensors} weights (${s.column} column-parallel, ${s.row} row-parallel, ${s.replicated} replicated), ${formatBytes(Math.max(...result.rankBytes))} per rank at most; index ${result.indexPath}`);
    }
    return 0;
  } finally {
    await source.close();
  }
}
