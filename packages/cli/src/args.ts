import { parseArgs, type ParseArgsConfig } from 'node:util';
import { CliUsageError } from './cli-error.js';

export type OptionSpec = NonNullable<ParseArgsConfig['options']>;

export interface CommandSpec {
  name: string;
  summary: string;
  usage: string;
  /** Lines under "Options:"; each documents one flag. */
  help: string[];
  options: OptionSpec;
  /** How many positionals are allowed: [min, max]. */
  positionals: [number, number];
}

export interface Parsed {
  values: Record<string, string | boolean | string[] | undefined>;
  positionals: string[];
}

/** Parses argv strictly: unknown flags and wrong positional counts are usage errors naming the command. */
export function parseCommand(spec: CommandSpec, argv: string[]): Parsed {
  let parsed;
  try {
    parsed = parseArgs({ args: argv, options: { ...spec.options, help: { type: 'boolean', short: 'h' } }, allowPositionals: true, strict: true });
  } catch (error) {
    throw new CliUsageError(`${spec.name}: ${(error as Error).message.replace(/\. To specify a positional.*$/s, '')}\nusage: ${spec.usage}`, spec.name);
  }
  if (parsed.values.help) return parsed as Parsed;
  const [min, max] = spec.positionals;
  const n = parsed.positionals.length;
  if (n < min || n > max) {
    const want = min === max ? `${min}` : max === Infinity ? `at least ${min}` : `${min} to ${max}`;
    throw new CliUsageError(`${spec.name}: expected ${want} argument(s), got ${n}\nusage: ${spec.usage}`, spec.name);
  }
  return parsed as Parsed;
}

export function helpText(spec: CommandSpec): string {
  return [`usage: ${spec.usage}`, '', spec.summary, '', 'Options:', ...spec.help.map((l) => `  ${l}`), '  -h, --help            show this help'].join('\n');
}

/** Parses "5GB", "512MiB", "1e9" into bytes. */
export function parseByteSize(text: string, flag: string): number {
  const m = /^(\d+(?:\.\d+)?(?:e\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?$/i.exec(text.trim());
  if (!m) throw new CliUsageError(`${flag}: expected a size like 5GB or 512MiB, got '${text}'`);
  const units: Record<string, number> = { b: 1, kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, tib: 2 ** 40 };
  return Math.round(Number(m[1]) * units[(m[2] ?? 'b').toLowerCase()]);
}

export function parseIntArg(text: string | undefined, flag: string, options: { min?: number; max?: number } = {}): number | undefined {
  if (text === undefined) return undefined;
  const n = Number(text);
  if (!Number.isSafeInteger(n) || (options.min !== undefined && n < options.min) || (options.max !== undefined && n > options.max)) {
    const range = options.min !== undefined || options.max !== undefined ? ` in [${options.min ?? '-inf'}, ${options.max ?? 'inf'}]` : '';
    throw new CliUsageError(`${flag}: expected an integer${range}, got '${text}'`);
  }
  return n;
}

export function parseChoice<T extends string>(text: string | undefined, flag: string, choices: readonly T[]): T | undefined {
  if (text === undefined) return undefined;
  if (!(choices as readonly string[]).includes(text)) throw new CliUsageError(`${flag}: expected one of ${choices.join(', ')}, got '${text}'`);
  return text as T;
}
