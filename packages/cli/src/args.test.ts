import { describe, expect, it } from 'vitest';
import { editDistance, helpText, parseByteSize, parseCommand, parseIntArg, suggest, wrap, type CommandSpec } from './args.js';
import { CliUsageError } from './cli-error.js';
import { COMMANDS } from './main.js';
import { tokenList } from './token-list.js';

const spec: CommandSpec = {
  name: 'test',
  summary: 'A command for tests.',
  usage: 'kdtree test',
  help: ['-o, --output FILE  where', '--max-new N  how many', '--json  JSON'],
  options: { output: { type: 'string', short: 'o' }, 'max-new': { type: 'string' }, json: { type: 'boolean' } },
  positionals: [0, 1],
};

describe('argument parsing', () => {
  it('takes a negative number as the value of an option, so the range check can name it', () => {
    expect(parseCommand(spec, ['--max-new', '-1']).values['max-new']).toBe('-1');
    expect(parseCommand(spec, ['-o', '-5']).values.output).toBe('-5');
    expect(() => parseIntArg('-1', '--max-new', { min: 1 })).toThrow("--max-new: must be >= 1, got '-1'");
    // A flag after a value-taking option is still a flag.
    expect(() => parseCommand(spec, ['--max-new', '--json'])).toThrow(CliUsageError);
  });

  it('integers are decimal integers: not 1e9, 0x10, 1.0, an empty string or spaces', () => {
    expect(parseIntArg('12', '--n')).toBe(12);
    expect(parseIntArg(' 7 ', '--n')).toBe(7);
    for (const bad of ['1e9', '0x10', '1.0', '', ' ', '1_000', 'Infinity', '9007199254740993']) {
      expect(() => parseIntArg(bad, '--n'), bad).toThrow(`--n: expected an integer, got '${bad}'`);
    }
    expect(() => parseIntArg('1000000000', '--n', { min: 0, max: 1024 })).toThrow("--n: must be in [0, 1024], got '1000000000'");
    expect(() => parseIntArg('5', '--n', { max: 4 })).toThrow("--n: must be <= 4, got '5'");
  });

  it('token lists refuse empty items instead of reading them as 0', () => {
    expect(tokenList('1, 2,3', '--prompt')).toEqual([1, 2, 3]);
    expect(tokenList('', '--eos')).toEqual([]);
    expect(() => tokenList('1,,2', '--prompt')).toThrow("--prompt: expected comma-separated non-negative token ids, got an empty item at position 2 in '1,,2'");
    expect(() => tokenList('1,', '--prompt')).toThrow(/empty item at position 2/);
    for (const bad of ['1,-2', '1,2.5', '1,0x3', '1,a']) expect(() => tokenList(bad, '--prompt'), bad).toThrow(CliUsageError);
  });

  it('byte sizes have a floor', () => {
    expect(parseByteSize('5GB', '--shard-size')).toBe(5e9);
    expect(parseByteSize('4KiB', '--shard-size', 4096)).toBe(4096);
    expect(() => parseByteSize('0', '--shard-size')).toThrow("--shard-size: must be at least 1 bytes, got '0'");
    expect(() => parseByteSize('4KB', '--shard-size', 4096)).toThrow('must be at least 4096 bytes');
    expect(() => parseByteSize('1e300', '--shard-size')).toThrow('too large');
  });

  it('suggests the option or command that was meant', () => {
    expect(editDistance('outptu', 'output')).toBe(2);
    expect(suggest('outptu', ['output', 'json', 'max-new'])).toEqual(['output']);
    expect(suggest('max', ['output', 'json', 'max-new'])).toEqual(['max-new']);
    expect(suggest('zzz', ['output', 'json'])).toEqual([]);
    expect(() => parseCommand(spec, ['--outptu', 'x'])).toThrow("test: unknown option '--outptu' (did you mean --output?)");
    expect(() => parseCommand(spec, ['--max', '3'])).toThrow("unknown option '--max' (did you mean --max-new?)");
    expect(() => parseCommand(spec, ['-x'])).toThrow("unknown option '-x'");
    expect(() => parseCommand(spec, ['--output'])).toThrow("test: option '--output' needs a value");
    expect(() => parseCommand(spec, ['--json=1'])).toThrow("test: option '--json' takes no value");
  });

  it('help wraps to the width and keeps the flag column', () => {
    const text = wrap('one two three four five six seven eight nine ten', 20, 4, 0);
    expect(text.split('\n').every((l) => l.length <= 20)).toBe(true);
    expect(text.split('\n').slice(1).every((l) => l.startsWith('    '))).toBe(true);
    for (const width of [40, 60, 80, 120]) {
      for (const c of COMMANDS) {
        const lines = helpText(c.spec, width).split('\n');
        const long = lines.filter((l) => l.length > width && !/^\s*\S+$/.test(l.trim()));
        expect(long, `${c.spec.name} at ${width}`).toEqual([]);
      }
    }
  });

  it("every command's help lists every option it accepts", () => {
    for (const c of COMMANDS) {
      const help = helpText(c.spec, 200);
      for (const [name, option] of Object.entries(c.spec.options)) {
        expect(help, `${c.spec.name} --${name}`).toMatch(new RegExp(`(^|[\\s,])--${name}\\b`, 'm'));
        if (option.short) expect(help, `${c.spec.name} -${option.short}`).toMatch(new RegExp(`(^|\\s)-${option.short}, --${name}\\b`, 'm'));
      }
    }
  });
});
