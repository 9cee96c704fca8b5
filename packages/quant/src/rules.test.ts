import { describe, expect, it } from 'vitest';
import { QuantConfigError, RuleMatchError } from './errors.js';
import { dialectProblem, isLinearModule, KIMI_K2_IGNORE, parseRules, presetRules, ROUTED_EXPERTS, selectTensors } from './rules.js';
import { k2LikeTensors } from './test-support/model-tensors.js';

const names = (s: ReturnType<typeof selectTensors>) => [...s.selected.keys()];

describe('selection rules', () => {
  it('kimi-k2 selects routed experts only', () => {
    const sel = selectTensors(k2LikeTensors(), presetRules('kimi-k2'));
    expect(names(sel)).toHaveLength(12);
    expect(names(sel).every((n) => /mlp\.experts\.\d\.(gate|up|down)_proj\.weight$/.test(n))).toBe(true);
  });

  it('kimi-k2 also works with the K2.5 language_model. prefix', () => {
    const sel = selectTensors(k2LikeTensors('language_model.model.'), presetRules('kimi-k2'));
    expect(names(sel)).toHaveLength(12);
  });

  it('seed selects every MLP projection (dense, shared, routed) and nothing else', () => {
    const sel = selectTensors(k2LikeTensors(), presetRules('seed', 64));
    expect(names(sel)).toHaveLength(3 + 12 + 3);
    expect(names(sel).some((n) => n.includes('self_attn') || n.includes('lm_head') || n.endsWith('mlp.gate.weight'))).toBe(false);
    expect(new Set(sel.selected.values())).toEqual(new Set([64]));
  });

  it('knows which modules are linear', () => {
    expect(isLinearModule('model.layers.0.self_attn.kv_a_proj_with_mqa')).toBe(true);
    expect(isLinearModule('lm_head')).toBe(true);
    expect(isLinearModule('model.layers.1.mlp.gate')).toBe(false);
    expect(isLinearModule('model.embed_tokens')).toBe(false);
  });

  it('parses compressed-tensors config_groups with re: targets (anchored at the start) and ignores', () => {
    const rules = parseRules(
      { config_groups: { group_0: { targets: ['Linear'], weights: { num_bits: 4, type: 'int', symmetric: true, strategy: 'group', group_size: 128 } } }, ignore: ['lm_head', 're:.*self_attn.*', 're:.*mlp\\.(gate|up|down)_proj.*'] },
      'rules.json',
    );
    const sel = selectTensors(k2LikeTensors(), rules);
    expect(names(sel)).toHaveLength(15); // routed + shared experts
    expect(new Set(sel.selected.values())).toEqual(new Set([128]));
    // "re:" matches from the start like Python's re.match: "layers" alone does not match "model.layers..."
    expect(() => selectTensors(k2LikeTensors(), parseRules({ targets: ['re:layers\\..*'] }, 'r.json'))).toThrow(RuleMatchError);
  });

  it('refuses rules that match nothing, name the entry', () => {
    expect(() => selectTensors(k2LikeTensors(), parseRules({ targets: ['re:.*experts.*'], ignore: ['re:.*vision.*'] }, 'r.json'))).toThrow(/ignore entry 're:\.\*vision\.\*' matches no tensor/);
    expect(() => selectTensors(k2LikeTensors(), parseRules({ targets: ['model.layers.9.mlp.down_proj'] }, 'r.json'))).toThrow(/target 'model\.layers\.9\.mlp\.down_proj' matches no tensor/);
  });

  it('refuses unsupported quantization arguments and bad group sizes', () => {
    expect(() => parseRules({ config_groups: { g: { targets: ['Linear'], weights: { num_bits: 8 } } } }, 'r.json')).toThrow(QuantConfigError);
    expect(() => parseRules({ config_groups: { g: { targets: ['Linear'], weights: { symmetric: false } } } }, 'r.json')).toThrow(/symmetric/);
    expect(() => parseRules({ targets: ['Linear'], group_size: 48 }, 'r.json')).toThrow(/group size 48/);
    expect(() => parseRules({ targets: ['re:(unclosed'] }, 'r.json')).not.toThrow();
    expect(() => selectTensors(k2LikeTensors(), parseRules({ targets: ['re:(unclosed'] }, 'r.json'))).toThrow(/bad regular expression/);
  });

  it('refuses regular expressions outside what Python re and JavaScript RegExp agree on', () => {
    const patterns = {
      '.*mlp\\.experts\\.\\d+\\.down_proj\\Z': /\\Z is Python-only/,
      '\\Amodel\\..*': /\\A is Python-only/,
      '(?P<layer>\\d+)\\.mlp': /\(\?P\.\.\.\) named groups are Python-only/,
      '(?i)MODEL.*': /inline flags/,
      '(?#routed).*experts.*': /comments are Python-only/,
      '(?>a+)b': /atomic groups/,
      '(?<layer>\\d+)\\.mlp': /JavaScript-only/,
      '(a)\\k<a>': /JavaScript-only/,
    };
    for (const [pattern, message] of Object.entries(patterns)) {
      const rules = parseRules({ targets: [`re:${pattern}`] }, 'r.json');
      expect(() => selectTensors(k2LikeTensors(), rules), pattern).toThrow(QuantConfigError);
      expect(() => selectTensors(k2LikeTensors(), rules), pattern).toThrow(message);
    }
    // The common syntax, the published ignore list and the presets pass.
    for (const ok of [...KIMI_K2_IGNORE, ROUTED_EXPERTS, 're:(?:a|b)(?=c)(?!d)(?<=e)(?<!f)[\\w.]+\\b$', 're:\\\\A literal backslash then A']) {
      expect(dialectProblem(ok.replace(/^re:/, '')), ok).toBeUndefined();
    }
  });
});

