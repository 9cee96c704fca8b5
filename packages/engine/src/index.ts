export { createEngine, Engine, SPECS, type DrafterSpec, type EngineOptions, type GenerateOptions, type GenerationChunk, type GenerationResult, type GenerationStats, type Spec, type StepTrace } from './engine.js';
export { ModelDrafter, NgramDrafter, type Drafter, type DraftRequest } from './drafters.js';
export { DflashDrafter, type DflashLoadOptions, type DrafterWeights } from './dflash-drafter.js';
export { BudgetPolicy, BUDGET_BUCKETS, type CostCurve } from './budget.js';
export { EngineError, type EngineErrorCode } from './errors.js';
export { KvCache, type CacheDtype } from './kv-cache.js';
export { DeviceModel, shardPlan, weightBytes, type LoadProgress, type LogitRows } from './model.js';
export { ModelSource, type HostBf16, type HostInt4, type WeightReader } from './model-source.js';
export { SeededSource, type SeededSourceOptions } from './seeded-source.js';
export { estimateDflashMemory, estimateMemory, type MemoryEstimate } from './memory.js';
export type { ActivationDtype } from './workspace.js';
export { Runner, type TreeBuffers } from './runner.js';
export type { Pass } from './layers.js';
export { view } from './linear.js';
export { HostCollective, StepGraph, type Collective, type HostTransport } from './collective.js';
export { RankFailure } from './shared-memory-transport.js';
export { rankDevice, TP_TIMEOUT_MS, type TpMaster } from './tp.js';
export { joinAsRank, startNodeRanks, type NodeRanks } from './tp-launch.js';
export { NcclCollective, type NcclCollectiveOptions } from './nccl-collective.js';
// launchPlans: what `kdtree run` launches from. serveUniqueId / fetchUniqueId (with UNIQUE_ID_BYTES
// and DEFAULT_MASTER_PORT): a standalone NCCL-id rendezvous for custom launchers, which the
// engine's own launch does not need (its ranks get the id with the run's setup; docs/tp.md)
export { DEFAULT_MASTER_PORT, fetchUniqueId, launchPlans, serveUniqueId, UNIQUE_ID_BYTES, type LaunchFlags, type LaunchPlan } from './rendezvous.js';
export type { Block, Shard, Split, TensorCut } from './shard.js';
export { openModel, readShardIndex, rankFileName, shardIndexPath, ShardSource, SHARD_INDEX_NAME, SHARD_INDEX_SCHEMA, type ShardIndex, type ShardIndexTensor } from './shard-source.js';
export { writeShards, type ShardProgress, type ShardResult } from './shard-writer.js';
export type { RankCommand, StepKey } from './runner.js';
