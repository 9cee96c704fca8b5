export * from './errors.js';
export { isMoeLayer, MLA_NORM_EPS, parseModelConfig, qkHeadDim, type ModelConfig, type RopeConfig } from './config.js';
export { applyRope, ropeTables, ropeTablesFor, softmaxScale, type RopeTables } from './rope.js';
export { argmax, matmulT, rmsNorm, sigmoid, silu, top2Margin } from './tensor-ops.js';
export { route, type Routing } from './router.js';
export { LatentKvCache, type LatentLayerCache } from './kv-cache.js';
export { loadWeights, storeWeightSource, weightSpecs, type Linear, type MlpWeights, type ModelWeights, type WeightSource, type WeightSpec } from './weights.js';
export { latentAttention, mlp, ReferenceModel, type ForwardOptions, type LatentAttentionArgs } from './model.js';
export { greedyDecode, teacherForcedLogits, type GreedyOptions, type GreedyResult } from './generate.js';
export { configFor, loadDflashModel, loadModel, type LoadedDflash, type LoadedModel } from './load.js';
export {
  checkDflashPairing,
  defaultTargetLayerIds,
  DFLASH_ARCHITECTURE,
  isDflashConfig,
  parseDflashConfig,
  type DflashConfig,
  type DflashLayerType,
  type DflashTarget,
} from './dflash-config.js';
export {
  checkDflashTensors,
  DflashCache,
  DflashModel,
  dflashAttention,
  dflashStoreSource,
  type DflashAttentionArgs,
  dflashWeightPrefix,
  dflashWeightSpecs,
  loadDflashWeights,
  type DflashLayerWeights,
  type DflashTargetWeights,
  type DflashWeights,
  type DraftBlock,
} from './dflash.js';
export { dflashDecode, targetTaps, type DflashDecodeOptions, type DflashDecodeResult } from './dflash-decode.js';
export { dflashConfigJson, dflashFromWeights, randomDflashWeights, writeDflashDirectory, type DflashShape } from './dflash-synthetic.js';
export { walkDflashConfig, walkDflashConfigJson, walkDflashWeights, walkStructure, walkWeights, WALK_STEPS, WALK_TENSORS, type WalkStructure } from './walk.js';
export {
  acceptTree,
  buildDraftTree,
  expandDraftTree,
  commitPath,
  ddtreeDecode,
  modelDrafter,
  topKLogProbs,
  treeMask,
  treePositions,
  verifyTree,
  type Acceptance,
  type DdtreeOptions,
  type DdtreeResult,
  type DraftTree,
  type Drafter,
} from './ddtree.js';
export {
  checkQuantizable,
  GOLDEN_MAX_NEW,
  GOLDEN_PROMPT,
  lcgTokens,
  MODEL_PRESET_NAMES,
  MODEL_PRESETS,
  modelFromWeights,
  perturbWeights,
  presetConfigJson,
  randomWeights,
  SeededRandom,
  writeSyntheticModel,
  type GoldenRecord,
  type ModelPreset,
  type SyntheticModelOptions,
} from './synthetic.js';
