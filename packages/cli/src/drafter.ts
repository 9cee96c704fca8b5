/**
 * A DFlash drafter as a bundle records it: `metadata.drafter`, written by `kdtree import` beside
 * the drafter's config.json (`metadata.config`), read back by inspect (and, later, by the engine).
 */
import { checkDflashPairing, parseModelConfig, type DflashConfig } from '@kdtree/reference';

export const DRAFTER_METADATA_KEY = 'drafter';

export interface DrafterMetadata {
  kind: 'dflash';
  block_size: number;
  /** Depths one forward drafts: block_size - 1. */
  depths: number;
  target_layer_ids: number[];
  num_target_layers: number | null;
  mask_token_id: number;
  hidden_size: number;
  vocab_size: number;
  layers: number;
}

export function drafterMetadata(config: DflashConfig): DrafterMetadata {
  return {
    kind: 'dflash',
    block_size: config.blockSize,
    depths: config.blockSize - 1,
    target_layer_ids: config.targetLayerIds,
    num_target_layers: config.numTargetLayers,
    mask_token_id: config.maskTokenId,
    hidden_size: config.hiddenSize,
    vocab_size: config.vocabSize,
    layers: config.numLayers,
  };
}

/** One line for inspect: what the drafter taps and drafts. */
export function drafterSummary(d: DrafterMetadata): string {
  const of = d.num_target_layers === null ? '' : ` of ${d.num_target_layers}`;
  return `dflash, block_size ${d.block_size} (depths 1..${d.depths}), target layers [${d.target_layer_ids.join(', ')}]${of}, mask token ${d.mask_token_id}, ${d.layers} layer${d.layers === 1 ? '' : 's'}, hidden ${d.hidden_size}, vocab ${d.vocab_size}`;
}

/** Checks the drafter against a target's config.json (--target); a PairingError names both. */
export function checkDrafterTarget(drafter: DflashConfig, targetJson: unknown, targetSource: string, drafterSource: string): void {
  checkDflashPairing(drafter, parseModelConfig(targetJson, targetSource), { drafter: drafterSource, target: targetSource });
}
