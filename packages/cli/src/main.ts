import { AddonLoadError } from '@kdtree/cuda';
import { EngineError } from '@kdtree/engine';
import { FormatError } from '@kdtree/format';
import { QuantError } from '@kdtree/quant';
import { GoldenReferenceError } from '@kdtree/reference';
import { TokenizerError } from '@kdtree/tokenizer';
import { didYouMean, helpText, parseCommand, terminalWidth, wrap, type CommandSpec, type Parsed } from './args.js';
import { CliError } from './cli-error.js';
import { ENGINE_COMMANDS, usageErrorOf } from './engine-args.js';
import { backendSpec, runBackend } from './commands/backend.js';
import { demoSpec, runDemo } from './commands/demo.js';
import { exportSpec, runExport } from './commands/export.js';
import { genModelSpec, runGenModel } from './commands/gen-model.js';
import { goldenSpec, runGolden } from './commands/golden.js';
import { importSpec, runImport } from './commands/import.js';
import { inspectSpec, runInspect } from './commands/inspect.js';
import { quantizeSpec, runQuantize } from './commands/quantize.js';
import { runRun, runSpec } from './commands/run.js';
import { chatSpec, runChat } from './commands/chat.js';
import { runServe, serveSpec } from './commands/serve.js';
import { runShard, shardSpec } from './commands/shard.js';
import { detokenizeSpec, runDetokenize, runTokenize, tokenizeSpec } from './commands/tokenize.js';
import { runVerify, verifySpec } from './commands/verify.js';
import { CLI_VERSION, processIO, type CommandIO } from './io.js';

interface Command {
  spec: CommandSpec;
  run(parsed: Parsed, io: CommandIO): Promise<number>;
}

export const COMMANDS: Command[] = [
  { spec: demoSpec, run: runDemo },
  { spec: importSpec, run: runImport },
  { spec: exportSpec, run: runExport },
  { spec: inspectSpec, run: runInspect },
  { spec: quantizeSpec, run: runQuantize },
  { spec: genModelSpec, run: runGenModel },
  { spec: shardSpec, run: runShard },
  { spec: runSpec, run: runRun },
  { spec: chatSpec, run: runChat },
  { spec: serveSpec, run: runServe },
  { spec: goldenSpec, run: runGolden },
  { spec: verifySpec, run: runVerify },
  { spec: backendSpec, run: runBackend },
  { spec: tokenizeSpec, run: runTokenize },
  { spec: detokenizeSpec, run: runDetokenize },
];

function topHelp(width = terminalWidth()): string {
  const column = Math.max(...COMMANDS.map((c) => c.spec.name.length));
  return [
    wrap(`kdtree ${CLI_VERSION}: KDTR bundles, INT4 quantization, golden references and an OpenAI-compatible server for Kimi K2.x`, width),
    '',
    'usage: kdtree <command> [options]',
    '',
    'Commands:',
    ...COMMANDS.map((c) => `  ${c.spec.name.padEnd(column)}  ${wrap(c.spec.summary.split('. ')[0].replace(/\.$/, ''), width, column + 4).slice(column + 4)}`),
    '',
    "Run 'kdtree <command> --help' for a command's options.",
  ].join('\n');
}

/** Runs the CLI; returns the exit code. Every expected failure is one line on stderr. */
export async function main(argv: string[], io: CommandIO = processIO({ quiet: argv.includes('--quiet') || argv.includes('-q') })): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === '--help' || name === '-h' || name === 'help') {
    io.out(topHelp());
    return name === undefined ? 2 : 0;
  }
  if (name === '--version' || name === '-v') {
    io.out(CLI_VERSION);
    return 0;
  }
  const command = COMMANDS.find((c) => c.spec.name === name);
  try {
    if (command === undefined) {
      const names = COMMANDS.map((c) => c.spec.name);
      const hint = didYouMean(name, names);
      throw new CliError(`unknown command '${name}'${hint || ` (commands: ${names.join(', ')})`}`, 2);
    }
    const parsed = parseCommand(command.spec, rest);
    if (parsed.values.help) {
      io.out(helpText(command.spec));
      return 0;
    }
    return await command.run(parsed, io);
  } catch (error) {
    return reportError(error, io, name);
  }
}

/** `command`: the command that failed, whose flags an engine error may be named by (ENGINE_COMMANDS). */
export function reportError(error: unknown, io: CommandIO, command?: string): number {
  if (error instanceof CliError) {
    io.err(`kdtree: error: ${error.message}`);
    return error.exitCode;
  }
  const usage = error instanceof EngineError && command !== undefined && ENGINE_COMMANDS.includes(command) ? usageErrorOf(error) : undefined;
  if (usage !== undefined) {
    io.err(`kdtree: error: ${usage.message}`);
    return usage.exitCode;
  }
  if (error instanceof FormatError || error instanceof QuantError || error instanceof GoldenReferenceError || error instanceof AddonLoadError || error instanceof EngineError || error instanceof TokenizerError) {
    io.err(`kdtree: error: ${error.message}`);
    return 1;
  }
  const errno = error as NodeJS.ErrnoException;
  if (typeof errno?.code === 'string' && typeof errno.path === 'string') {
    const what: Record<string, string> = { ENOENT: 'no such file or directory', EACCES: 'permission denied', EISDIR: 'is a directory', ENOSPC: 'no space left on device', ENOTDIR: 'not a directory', EEXIST: 'already exists' };
    io.err(`kdtree: error: ${errno.path}: ${what[errno.code] ?? errno.message}`);
    return 1;
  }
  io.err(`kdtree: internal error: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}`);
  return 70;
}
