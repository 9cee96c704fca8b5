import { parseArgs, type ParseArgsConfig } from 'node:util';
import { CliUsageError } from './cli-error.js';

export type OptionSpec = NonNullable<ParseArgsConfig['options']>;

export interface CommandSpec {
  name: string;
  summary: string;
  usage: string;
  /**
   * Lines under "Options:", each `FLAGS  DESCRIPTION` (two or more spaces between); every option
   * of `options` must be documented here (a test checks it for every command).
   */
  help: string[];
  options: OptionSpec;
  /** How many positionals are allowed: [min, max]. */
  positionals: [number, number];
}

export interface Parsed {
  values: Record<string, string | boolean | string[] | undefined>;
  positionals: string[];
}

/**
 * `--max-new -1` would make node's parser read "-1" as an option ("argument is ambiguous"): a
 * value that looks like a negative number after an option that takes a value is that option's
 * value, so the range check can say what is wrong with it.
 */
function attachNegativeValues(options: OptionSpec, argv: string[]): string[] {
  const out: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '--') {
      out.push(...argv.slice(i));
      break;
    }
    const long = arg.startsWith('--') ? arg.slice(2) : undefined;
    const short = !long && /^-[^-]$/.test(arg) ? Object.entries(options).find(([, o]) => o.short === arg[1])?.[0] : undefined;
    const name = long ?? short;
    const next = argv[i + 1];
    if (name !== undefined && options[name]?.type === 'string' && next !== undefined && /^-\.?\d/.test(next)) {
      out.push(`--${name}=${next}`);
      i++;
      continue;
    }
    out.push(arg);
  }
  return out;
}

/** Levenshtein distance, for "did you mean". */
export function editDistance(a: string, b: string): number {
  const row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    let diagonal = row[0];
    row[0] = i;
    for (let j = 1; j <= b.length; j++) {
      const above = row[j];
      row[j] = Math.min(row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] === b[j - 1] ? 0 : 1));
      diagonal = above;
    }
  }
  return row[b.length];
}

/**
 * The candidates closest to what was typed: an unambiguous prefix (`--max` for `--max-new`), else
 * those within an edit distance of about a third of the word (typos, swapped letters).
 */
export function suggest(typed: string, candidates: readonly string[]): string[] {
  const prefixed = candidates.filter((c) => c.startsWith(typed));
  if (typed.length >= 2 && prefixed.length === 1) return prefixed;
  const limit = Math.max(1, Math.floor(typed.length / 3));
  const scored = candidates.map((c) => ({ c, d: editDistance(typed, c) })).filter((s) => s.d <= limit);
  const best = Math.min(...scored.map((s) => s.d));
  return scored.filter((s) => s.d === best).map((s) => s.c);
}

export function didYouMean(typed: string, candidates: readonly string[], prefix = ''): string {
  const found = suggest(typed, candidates);
  return found.length === 0 ? '' : ` (did you mean ${found.map((c) => `${prefix}${c}`).join(' or ')}?)`;
}

/** Parses argv strictly: unknown flags and wrong positional counts are usage errors naming the command. */
export function parseCommand(spec: CommandSpec, argv: string[]): Parsed {
  const options: OptionSpec = { ...spec.options, help: { type: 'boolean', short: 'h' } };
  let parsed;
  try {
    parsed = parseArgs({ args: attachNegativeValues(options, argv), options, allowPositionals: true, strict: true });
  } catch (error) {
    throw new CliUsageError(`${spec.name}: ${describeParseError(error as NodeJS.ErrnoException, options)}\nusage: ${spec.usage}`, spec.name);
  }
  if (parsed.values.help) return parsed as Parsed;
  const [min, max] = spec.positionals;
  const n = parsed.positionals.length;
  if (n < min || n > max) {
    const want = min === max ? `${min}` : max === Infinity ? `at least ${min}` : `${min} to ${max}`;
    const stray = n > max ? parsed.positionals.find((p) => p.startsWith('-')) : undefined;
    throw new CliUsageError(`${spec.name}: expected ${want} argument(s), got ${n}${stray ? ` ('${stray}' after '--' is an argument, not an option)` : ''}\nusage: ${spec.usage}`, spec.name);
  }
  return parsed as Parsed;
}

function describeParseError(error: NodeJS.ErrnoException, options: OptionSpec): string {
  const message = error.message;
  if (error.code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION') {
    const flag = /'([^']+)'/.exec(message)?.[1] ?? '';
    const long = flag.startsWith('--');
    const names = long ? Object.keys(options) : Object.values(options).flatMap((o) => (o.short ? [o.short] : []));
    const typed = flag.replace(/^--?/, '').replace(/=.*$/, '');
    const hint = didYouMean(typed, names, long ? '--' : '-') || (long ? '' : didYouMean(typed, Object.keys(options), '--'));
    return `unknown option '${flag}'${hint}`;
  }
  if (error.code === 'ERR_PARSE_ARGS_INVALID_OPTION_VALUE') {
    // "Option '-o, --output <value>' argument missing": name the long form.
    const flag = /--[\w-]+/.exec(message)?.[0] ?? /'(-[^' ,]+)/.exec(message)?.[1];
    if (/argument missing/.test(message)) return `option '${flag}' needs a value`;
    if (/does not take an argument/.test(message)) return `option '${flag}' takes no value`;
  }
  return message.replace(/\. To specify a positional.*$/s, '');
}

/** Where help wraps: the terminal's width, else $COLUMNS, else 80 (never below 40). */
export function terminalWidth(stream: { columns?: number; isTTY?: boolean } = process.stdout): number {
  const fromEnv = Number(process.env.COLUMNS);
  const width = stream.isTTY && stream.columns ? stream.columns : Number.isInteger(fromEnv) && fromEnv > 0 ? fromEnv : 80;
  return Math.max(40, width);
}

/** Wraps text to `width` columns, continuation lines indented by `indent` spaces. */
export function wrap(text: string, width: number, indent = 0, firstIndent = indent): string {
  const lines: string[] = [];
  let line = ' '.repeat(firstIndent);
  let empty = true;
  for (const word of text.split(/\s+/).filter(Boolean)) {
    if (!empty && line.length + 1 + word.length > width) {
      lines.push(line);
      line = ' '.repeat(indent);
      empty = true;
    }
    line += empty ? word : ` ${word}`;
    empty = false;
  }
  lines.push(line);
  return lines.join('\n');
}

/** A help line `FLAGS  DESCRIPTION` laid out as a flag column and a wrapped description. */
function optionLines(lines: readonly string[], width: number): string[] {
  const rows = lines.map((l) => {
    const m = /^(\S.*?)\s{2,}(\S.*)$/.exec(l);
    return m ? { flags: m[1], text: m[2] } : { flags: l.trim(), text: '' };
  });
  const column = Math.min(24, Math.max(...rows.map((r) => r.flags.length)));
  const indent = column + 4;
  return rows.map(({ flags, text }) => {
    if (text === '') return `  ${flags}`;
    // A flag column too wide for the others puts its description on the next line.
    if (flags.length > column) return `  ${flags}\n${wrap(text, width, indent)}`;
    return `  ${flags.padEnd(column)}  ${wrap(text, width, indent).slice(indent)}`;
  });
}

export function helpText(spec: CommandSpec, width = terminalWidth()): string {
  return [
    wrap(`usage: ${spec.usage}`, width, 7, 0),
    '',
    wrap(spec.summary, width),
    '',
    'Options:',
    ...optionLines([...spec.help, '-h, --help  show this help'], width),
  ].join('\n');
}

/** Parses "5GB", "512MiB", "1e9" into bytes; at least `min` (default 1). */
export function parseByteSize(text: string, flag: string, min = 1): number {
  const m = /^(\d+(?:\.\d+)?(?:e\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?$/i.exec(text.trim());
  if (!m) throw new CliUsageError(`${flag}: expected a size like 5GB or 512MiB, got '${text}'`);
  const units: Record<string, number> = { b: 1, kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, tib: 2 ** 40 };
  const bytes = Math.round(Number(m[1]) * units[(m[2] ?? 'b').toLowerCase()]);
  if (!Number.isSafeInteger(bytes)) throw new CliUsageError(`${flag}: ${text} is too large`);
  if (bytes < min) throw new CliUsageError(`${flag}: must be at least ${min} bytes, got '${text}'`);
  return bytes;
}

/**
 * A decimal integer argument (`12`, `-3`; not `1e9`, `0x10`, `1.0` or ``), range-checked: the
 * message says which bound it broke (`--max-new: must be >= 0, got '-1'`).
 */
export function parseIntArg(text: string | undefined, flag: string, options: { min?: number; max?: number } = {}): number | undefined {
  if (text === undefined) return undefined;
  const n = /^[-+]?\d+$/.test(text.trim()) ? Number(text.trim()) : Number.NaN;
  if (!Number.isSafeInteger(n)) throw new CliUsageError(`${flag}: expected an integer, got '${text}'`);
  const { min, max } = options;
  if ((min !== undefined && n < min) || (max !== undefined && n > max)) {
    const rule = min !== undefined && max !== undefined ? `be in [${min}, ${max}]` : min !== undefined ? `be >= ${min}` : `be <= ${max}`;
    throw new CliUsageError(`${flag}: must ${rule}, got '${text}'`);
  }
  return n;
}

export function parseChoice<T extends string>(text: string | undefined, flag: string, choices: readonly T[]): T | undefined {
  if (text === undefined) return undefined;
  if (!(choices as readonly string[]).includes(text)) throw new CliUsageError(`${flag}: expected one of ${choices.join(', ')}, got '${text}'${didYouMean(text, choices)}`);
  return text as T;
}
