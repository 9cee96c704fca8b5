export { AddonLoadError, isNativeError, NATIVE_ERROR_CODES, type LoadAttempt, type NativeError, type NativeErrorCode } from './errors.js';
export { BACKEND_KINDS, loadAddon, PLATFORM_KEY, resolveBackendKind, type BackendKind, type LoadedAddon, type LoadOptions } from './loader.js';
export { createBackend, DTYPE_BYTES, KdtreeBackend, ncclVersionString, numel, type DeviceBuffer, type DeviceTensor, type Dtype, type Graph, type PackedW4A16 } from './backend.js';
export type {
  BuildMeta,
  CudaProbe,
  DispatchQuery,
  ForcedForms,
  ForcedFormsSetting,
  GemmDispatch,
  GemmForm,
  KernelForm,
  MoeExperts,
  NativeBackend,
  NativeDeviceInfo,
  NativeGraph,
  NativeModule,
  TensorArg,
  W4A16Dispatch,
  W4A16Epilogue,
  W4A16Form,
  W4A16PrefillOverride,
} from './native-types.js';
export { packedW4A16Shapes, W4A16_LAYOUT_VERSION, type PackedW4A16Shapes } from './w4a16-layout.js';
