/**
 * Which tensors get quantized: compressed-tensors' selection syntax (targets and ignore lists of
 * module names, "re:" regular expressions matched from the start of the name, and the class name
 * "Linear"), with two presets:
 *
 *   kimi-k2  routed experts only, with the real Kimi K2.x ignore list (attention, shared experts,
 *            dense MLPs and lm_head stay bf16)
 *   seed     every MLP projection: dense, shared and routed experts
 *
 * Rules apply to module names: a weight `model.layers.3.mlp.experts.7.down_proj.weight` belongs
 * to the module `model.layers.3.mlp.experts.7.down_proj`.
 */
import { QuantConfigError, RuleMatchError } from './errors.js';
import { GROUP_SIZES, type GroupSize } from './int4.js';

export type PresetName = 'kimi-k2' | 'seed';
export const PRESETS: readonly PresetName[] = ['kimi-k2', 'seed'];

/** The ignore list of the published Kimi K2.x quantization_config. */
export const KIMI_K2_IGNORE = ['lm_head', 're:.*self_attn.*', 're:.*shared_experts.*', 're:.*mlp\\.(gate|up|gate_up|down)_proj.*'];

export const ROUTED_EXPERTS = 're:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$';

export interface SelectionGroup {
  /** Targets: exact module names, "re:" patterns, or "Linear" (every linear layer). */
  targets: string[];
  groupSize: GroupSize;
}

export interface SelectionRules {
  /** Where the rules came from, for messages: "preset kimi-k2" or a file path. */
  source: string;
  groups: SelectionGroup[];
  ignore: string[];
  /** Check that every target and ignore entry matches some tensor (user rules: yes). */
  strict: boolean;
}

export function presetRules(preset: PresetName, groupSize: GroupSize = 32): SelectionRules {
  switch (preset) {
    case 'kimi-k2':
      // Routed experts by name (not "Linear"), so vision towers and prefixed lm_heads of K2.5-style
      // checkpoints are never selected; the ignore list is the published one.
      return { source: 'preset kimi-k2', groups: [{ targets: [ROUTED_EXPERTS], groupSize }], ignore: [...KIMI_K2_IGNORE], strict: false };
    case 'seed':
      return {
        source: 'preset seed',
        groups: [{ targets: ['re:.*mlp\\.(experts\\.\\d+\\.|shared_experts\\.)?(gate|up|down)_proj$'], groupSize }],
        ignore: ['lm_head', 're:.*self_attn.*'],
        strict: false,
      };
  }
}

const LINEAR_MODULE = /(^|\.)(\w+_proj(_with_mqa)?|lm_head)$/;

/** The module a weight belongs to: "a.b.c_proj.weight" -> "a.b.c_proj"; undefined if not a 2-D .weight. */
export function moduleOf(tensorName: string, shape: readonly number[]): string | undefined {
  if (shape.length !== 2 || !tensorName.endsWith('.weight')) return undefined;
  return tensorName.slice(0, -'.weight'.length);
}

/** Whether a module is a linear layer (what compressed-tensors' "Linear" target means here). */
export function isLinearModule(module: string): boolean {
  return LINEAR_MODULE.test(module);
}

const regexCache = new Map<string, RegExp>();

/**
 * compressed-tensors writes `re:` patterns for Python's `re`; kdtree evaluates them with ECMAScript
 * RegExp (no flags). The two agree on the common syntax (classes, groups, alternation, quantifiers,
 * lookahead/lookbehind, \d \w \s \b, anchors ^ and $ on names without newlines). Where they differ
 * a pattern is refused rather than matched differently: Python-only syntax that JS would read as
 * something else or refuse with a vaguer message (\A, \Z, (?P<name>, inline flags, comments,
 * atomic groups), and JS-only syntax Python would refuse ((?<name>, \k<name>).
 */
export function dialectProblem(pattern: string): string | undefined {
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i];
    if (c === '\\') {
      const next = pattern[i + 1];
      if (next === 'A' || next === 'Z' || next === 'z') return `\\${next} is Python-only (a JavaScript RegExp reads it as the letter ${next}); use ^ or $`;
      if (next === 'k' && pattern[i + 2] === '<') return '\\k<name> is JavaScript-only (Python writes (?P=name))';
      i++;
      continue;
    }
    if (c === '(' && pattern[i + 1] === '?') {
      const ext = pattern.slice(i + 2, i + 4);
      if (ext.startsWith('P')) return '(?P...) named groups are Python-only; use a plain group (...)';
      if (ext.startsWith('#')) return '(?#...) comments are Python-only';
      if (ext.startsWith('>')) return '(?>...) atomic groups are Python-only';
      if (/^[aiLmsux-]/.test(ext)) return 'inline flags (?i), (?s), ... are Python-only';
      if (ext[0] === '<' && ext[1] !== '=' && ext[1] !== '!') return '(?<name>...) named groups are JavaScript-only (Python writes (?P<name>...)); use a plain group (...)';
    }
  }
  return undefined;
}

function compile(pattern: string, source: string): RegExp {
  let re = regexCache.get(pattern);
  if (re === undefined) {
    const problem = dialectProblem(pattern);
    if (problem !== undefined) throw new QuantConfigError(`${source}: regular expression 're:${pattern}' is outside the syntax Python's re and JavaScript agree on: ${problem}`);
    try {
      // Python's re.match: anchored at the start, not at the end.
      re = new RegExp(`^(?:${pattern})`);
    } catch (error) {
      throw new QuantConfigError(`${source}: bad regular expression 're:${pattern}': ${(error as Error).message}`);
    }
    regexCache.set(pattern, re);
  }
  return re;
}

export function matchesEntry(entry: string, module: string, source: string): boolean {
  if (entry.startsWith('re:')) return compile(entry.slice(3), source).test(module);
  if (entry === 'Linear') return isLinearModule(module);
  return entry === module;
}

export interface Selection {
  /** weight tensor name -> group size, for the tensors to quantize */
  selected: Map<string, GroupSize>;
}

/**
 * Applies rules to a tensor list. A tensor is selected when its module matches a target of some
 * group and no ignore entry. With strict rules, an entry that matches nothing is an error.
 */
export function selectTensors(tensors: readonly { name: string; shape: readonly number[] }[], rules: SelectionRules): Selection {
  const used = new Set<string>();
  const selected = new Map<string, GroupSize>();
  for (const t of tensors) {
    const module = moduleOf(t.name, t.shape);
    if (module === undefined) continue;
    const ignoredBy = rules.ignore.find((e) => matchesEntry(e, module, rules.source));
    const group = rules.groups.find((g) => g.targets.some((e) => matchesEntry(e, module, rules.source) && (used.add(`t:${e}`), true)));
    if (ignoredBy !== undefined) {
      used.add(`i:${ignoredBy}`);
      continue;
    }
    if (group !== undefined) selected.set(t.name, group.groupSize);
  }
  if (rules.strict) {
    for (const g of rules.groups) {
      for (const e of g.targets) if (!used.has(`t:${e}`)) throw new RuleMatchError(`${rules.source}: target '${e}' matches no tensor`);
    }
    for (const e of rules.ignore) if (!used.has(`i:${e}`)) throw new RuleMatchError(`${rules.source}: ignore entry '${e}' matches no tensor`);
  }
  if (selected.size === 0) throw new RuleMatchError(`${rules.source}: selects no tensor to quantize`);
  return { selected };
}

function stringList(value: unknown, where: string): string[] {
  if (!Array.isArray(value) || !value.every((v) => typeof v === 'string')) {
    throw new QuantConfigError(`${where} must be a list of strings`);
  }
  return value;
}

/**
 * Parses user rules: either a compressed-tensors quantization_config (config_groups + ignore) or
 * the short form {"targets": [...], "ignore": [...], "group_size": 32}.
 */
export function parseRules(json: unknown, source: string, defaultGroupSize: GroupSize = 32): SelectionRules {
  if (typeof json !== 'object' || json === null || Array.isArray(json)) throw new QuantConfigError(`${source}: rules must be a JSON object`);
  const obj = json as Record<string, unknown>;
  const ignore = obj.ignore === undefined ? [] : stringList(obj.ignore, `${source}: ignore`);
  const groups: SelectionGroup[] = [];
  if (obj.config_groups !== undefined) {
    if (typeof obj.config_groups !== 'object' || obj.config_groups === null) throw new QuantConfigError(`${source}: config_groups must be an object`);
    for (const [name, g] of Object.entries(obj.config_groups as Record<string, unknown>)) {
      const group = g as Record<string, unknown>;
      const weights = (group?.weights ?? {}) as Record<string, unknown>;
      const where = `${source}: config_groups.${name}`;
      checkWeightsArgs(weights, where);
      groups.push({ targets: stringList(group.targets, `${where}.targets`), groupSize: checkGroupSize(weights.group_size ?? defaultGroupSize, `${where}.weights.group_size`) });
    }
  } else {
    groups.push({ targets: stringList(obj.targets, `${source}: targets`), groupSize: checkGroupSize(obj.group_size ?? defaultGroupSize, `${source}: group_size`) });
  }
  if (groups.length === 0) throw new QuantConfigError(`${source}: no config group`);
  return { source, groups, ignore, strict: true };
}

export function checkGroupSize(value: unknown, where: string): GroupSize {
  if (!(GROUP_SIZES as readonly unknown[]).includes(value)) throw new QuantConfigError(`${where}: group size ${JSON.stringify(value)} is not one of ${GROUP_SIZES.join(', ')}`);
  return value as GroupSize;
}

/** The weight arguments of a config group must describe symmetric 4-bit integer group quantization. */
export function checkWeightsArgs(weights: Record<string, unknown>, where: string): void {
  const want: [string, unknown][] = [['num_bits', 4], ['type', 'int'], ['symmetric', true], ['strategy', 'group']];
  for (const [key, value] of want) {
    if (weights[key] !== undefined && weights[key] !== value) {
      throw new QuantConfigError(`${where}.weights.${key} is ${JSON.stringify(weights[key])}; kdtree supports ${key} = ${JSON.stringify(value)} (symmetric INT4 groups)`);
    }
  }
  if (weights.actorder !== undefined && weights.actorder !== null && weights.actorder !== false) {
    throw new QuantConfigError(`${where}.weights.actorder is ${JSON.stringify(weights.actorder)}; activation reordering (g_idx) is not supported`);
  }
}
