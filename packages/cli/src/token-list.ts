import { CliUsageError } from './cli-error.js';

/**
 * "1, 2,3" -> [1, 2, 3]; "" -> []. Each id a decimal non-negative integer (not 1e3, 0x10 or
 * -1); an empty item ("1,,2") is an error naming its position, never a 0.
 */
export function tokenList(text: string, flag: string): number[] {
  if (text.trim() === '') return [];
  return text.split(',').map((s, i) => {
    const item = s.trim();
    if (!/^\d+$/.test(item) || !Number.isSafeInteger(Number(item))) {
      throw new CliUsageError(`${flag}: expected comma-separated non-negative token ids, got ${item === '' ? `an empty item at position ${i + 1}` : `'${item}'`} in '${text}'`);
    }
    return Number(item);
  });
}
