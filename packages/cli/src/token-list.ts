import { CliUsageError } from './cli-error.js';

/** "1, 2,3" -> [1, 2, 3]; "" -> []. Every id a non-negative integer; an empty entry is an error. */
export function tokenList(text: string, flag: string): number[] {
  if (text.trim() === '') return [];
  return text.split(',').map((s) => {
    const n = Number(s.trim());
    if (s.trim() === '' || !Number.isSafeInteger(n) || n < 0) throw new CliUsageError(`${flag}: expected comma-separated non-negative token ids, got '${s.trim()}'`);
    return n;
  });
}
