import { KdtrWriter, ShardedKdtrWriter } from '@kdtree/format';
import { checkGroupSize, parseRules, PRESETS, presetRules, quantizeStore, SCALE_RULES, type GroupSize, type SelectionRules } from '@kdtree/quant';
import { parseByteSize, parseChoice, parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import { jsonReport, type CommandIO } from '../io.js';
import { checkOutputName, refuseOverwritingInputs, storeFiles } from '../output-paths.js';
import { formatBytes, formatDuration, renderTable } from '../output.js';
import { MIN_SHARD_BYTES, openSources, readJsonObject } from './import.js';

export const quantizeSpec: CommandSpec = {
  name: 'quantize',
  summary: 'Quantize the weights of a bundle to INT4 W4A16 (symmetric groups, compressed-tensors packing), streaming tensor by tensor. Selected weights become <name>.qw (I32 [N, K/8]) and <name>.sc ([N, K/G]); everything else is copied.',
  usage: 'kdtree quantize IN.kdtr -o OUT.kdtr --preset kimi-k2|seed [--rules FILE] [--scheme minmax|absmax7] [--group 32] [--scale-dtype bf16|f32] [--json]',
  help: [
    '-o, --output FILE     the quantized bundle',
    '--preset NAME         kimi-k2: routed experts only (the real K2 ignore list); seed: every MLP projection',
    '--rules FILE          compressed-tensors selection rules (config_groups/targets + ignore); replaces --preset',
    '--scheme NAME         minmax (absmax/7.5, codes -8..7, compressed-tensors) or absmax7 (absmax/7, -7..7); default minmax',
    '--group N             group size along K: 32 (default), 64 or 128',
    '--scale-dtype D       bf16 (default, as Kimi K2) or f32',
    '--shard-size SIZE     write a multi-file bundle (-o NAME.kdtr.json: the index) with shards of at most SIZE (at least 4096)',
    '--json                print the summary as JSON',
    '-q, --quiet           no progress bar',
  ],
  options: {
    output: { type: 'string', short: 'o' },
    preset: { type: 'string' },
    rules: { type: 'string' },
    scheme: { type: 'string' },
    group: { type: 'string' },
    'scale-dtype': { type: 'string' },
    'shard-size': { type: 'string' },
    json: { type: 'boolean' },
    quiet: { type: 'boolean', short: 'q' },
  },
  positionals: [1, 1],
};

export async function runQuantize(p: Parsed, io: CommandIO): Promise<number> {
  const output = p.values.output as string | undefined;
  if (!output) throw new CliUsageError('quantize: -o OUT.kdtr is required', 'quantize');
  const preset = parseChoice(p.values.preset as string | undefined, '--preset', PRESETS);
  const rulesFile = p.values.rules as string | undefined;
  if ((preset === undefined) === (rulesFile === undefined)) throw new CliUsageError('quantize: give exactly one of --preset kimi-k2|seed and --rules FILE', 'quantize');
  const scheme = parseChoice(p.values.scheme as string | undefined, '--scheme', SCALE_RULES) ?? 'minmax';
  const group = checkGroupSizeArg(parseIntArg(p.values.group as string | undefined, '--group') ?? 32);
  const scaleDtype = ({ bf16: 'BF16', f32: 'F32' } as const)[parseChoice(p.values['scale-dtype'] as string | undefined, '--scale-dtype', ['bf16', 'f32'] as const) ?? 'bf16'];
  const shardSize = p.values['shard-size'] === undefined ? undefined : parseByteSize(p.values['shard-size'] as string, '--shard-size', MIN_SHARD_BYTES);
  checkOutputName('quantize', '-o', output, shardSize === undefined ? 'kdtr' : 'kdtr-index');
  const rules: SelectionRules = preset !== undefined ? presetRules(preset, group) : parseRules(await readJsonObject(rulesFile!, 'rules file'), rulesFile!, group);
  const [input] = await openSources(p.positionals);
  try {
    await refuseOverwritingInputs('quantize', [{ flag: '-o', path: output, sharded: shardSize !== undefined }], [...storeFiles([input]), ...(rulesFile ? [rulesFile] : [])]);
    const metadata = { ...(input.metadata as Record<string, unknown>) };
    const writer = shardSize === undefined ? await KdtrWriter.create(output, { metadata }) : await ShardedKdtrWriter.create(output, { metadata, maxShardBytes: shardSize });
    const bar = io.progress('quantize', input.totalBytes, { enabled: !p.values.quiet && !p.values.json });
    const started = performance.now();
    let summary;
    try {
      summary = await quantizeStore(input, writer, { rules, rule: scheme, scaleDtype, preset, onProgress: (done, _total, name) => bar.update(done, name) });
      await writer.close();
    } catch (error) {
      await writer.abort();
      throw error;
    }
    bar.finish();
    const seconds = (performance.now() - started) / 1000;
    if (p.values.json) {
      io.out(jsonReport('kdtree.quantize/1', {
        output,
        rules: rules.source,
        scheme,
        group_size: group,
        scale_dtype: scaleDtype,
        quantized: summary.quantized,
        copied: summary.copied,
        bytes_before: summary.bytesBefore,
        bytes_after: summary.bytesAfter,
        classes: summary.classes.map((c) => ({ tensor_class: c.tensorClass, tensors: c.tensors, weights: c.weights, max_abs_error: c.maxAbsError, mean_abs_error: c.meanAbsError })),
        seconds: Number(seconds.toFixed(3)),
      }));
      return 0;
    }
    io.out(`quantized ${summary.quantized} weights (${rules.source}, ${scheme}, group ${group}, ${scaleDtype} scales), copied ${summary.copied} tensors, in ${formatDuration(seconds)}`);
    io.out(`tensor bytes ${formatBytes(summary.bytesBefore)} -> ${formatBytes(summary.bytesAfter)} (${((summary.bytesAfter / summary.bytesBefore) * 100).toFixed(1)}%), written to ${output}`);
    io.out('');
    io.out(renderTable(
      ['class', 'tensors', 'weights', 'max |w - deq|', 'mean |w - deq|'],
      summary.classes.map((c) => [c.tensorClass, String(c.tensors), String(c.weights), c.maxAbsError.toExponential(3), c.meanAbsError.toExponential(3)]),
      new Set([1, 2, 3, 4]),
    ));
    return 0;
  } finally {
    await input.close();
  }
}

function checkGroupSizeArg(n: number): GroupSize {
  try {
    return checkGroupSize(n, '--group');
  } catch (error) {
    throw new CliUsageError((error as Error).message, 'quantize');
  }
}
