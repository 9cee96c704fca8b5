// The Node-API binding: backends, device buffers and every op. Arguments from JavaScript are
// checked here (types, buffer liveness, ownership, offsets, scalar ranges) and by validate.cc
// (dtypes, shapes) before any kernel runs; every failure becomes a JS Error with a `code`, never a
// crash.
//
// Whatever JavaScript passes, a call runs in three phases:
//   1. read: every argument is read into plain C++ values (Tensor, ints, doubles, flags). This is
//      the only phase that runs JavaScript (getters, proxies), and every buffer it names is pinned
//      (free() refuses it) until the call returns, so a getter cannot free or reuse a buffer that
//      the call already holds.
//   2. validate: ranges, shapes, streams; no JavaScript runs, so nothing checked can change.
//   3. run (or, on a capturing stream, capture: the call's own list of buffers goes to the graph).
// Per-call state lives on the stack (CallArgs), never in the backend object, so a getter that
// makes other native calls, even on the same backend, cannot disturb the call that runs it.
// Methods and accessors check their receiver (`this`) by a Node-API type tag before touching it.
#include <napi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "../common/dispatch_policy.h"
#include "../common/validate.h"
#include "kdtree/backend.h"
#ifdef KDTREE_WITH_CUDA
#include "../cuda/nccl.h"
#endif

#ifndef KDTREE_VERSION
#define KDTREE_VERSION "0.0.0"
#endif
#ifndef KDTREE_VARIANT
#define KDTREE_VARIANT "cpu"
#endif
#ifndef KDTREE_CUDA_ARCHS
#define KDTREE_CUDA_ARCHS ""
#endif

namespace kdtree {
namespace {

const char* CodeName(Code c) {
  switch (c) {
    case Code::kOk: return "KDTREE_OK";
    case Code::kInvalidArgument: return "KDTREE_INVALID_ARGUMENT";
    case Code::kUnsupported: return "KDTREE_UNSUPPORTED";
    case Code::kDeviceError: return "KDTREE_DEVICE_ERROR";
    case Code::kOutOfMemory: return "KDTREE_OUT_OF_MEMORY";
  }
  return "KDTREE_ERROR";
}

Napi::Error CodedError(Napi::Env env, Code code, const std::string& message) {
  Napi::Error e = Napi::Error::New(env, message);
  e.Set("code", Napi::String::New(env, CodeName(code)));
  return e;
}

[[noreturn]] void Throw(Napi::Env env, Code code, const std::string& message) { throw CodedError(env, code, message); }

void Check(Napi::Env env, const Status& s) {
  if (!s.ok()) Throw(env, s.code, s.message);
}

// Type tags mark the objects this copy of the addon made and what they are. Each holds the address
// of a static of this copy: a process may load the cpu and the cuda variant side by side, and each
// must reject the other's objects without reading them as its own. Checking a tag is cheaper than
// instanceof, which walks the prototype chain for every tensor of every call.
const napi_type_tag* DeviceBufferTag() {
  static const napi_type_tag tag = {reinterpret_cast<uintptr_t>(&tag) ^ 0x6b64747262756621ull, 0x9e3779b97f4a7c15ull};
  return &tag;
}
const napi_type_tag* GraphTag() {
  static const napi_type_tag tag = {reinterpret_cast<uintptr_t>(&tag) ^ 0x6b64747267726170ull, 0x7f4a7c159e3779b9ull};
  return &tag;
}
const napi_type_tag* BackendTag() {
  static const napi_type_tag tag = {reinterpret_cast<uintptr_t>(&tag) ^ 0x6b647472626b6e64ull, 0x3c6ef372a54ff53aull};
  return &tag;
}

bool HasTag(napi_env env, napi_value v, const napi_type_tag* tag) {
  napi_valuetype type;
  bool tagged = false;
  if (napi_typeof(env, v, &type) != napi_ok || type != napi_object) return false;
  return napi_check_object_type_tag(env, v, tag, &tagged) == napi_ok && tagged;
}

// The constructors are reachable from JavaScript (Object.getPrototypeOf(x).constructor); only the
// addon's own factories hold this token, so `new` from JavaScript throws instead of making an
// object with nothing behind it.
struct ConstructToken {};
ConstructToken construct_token;
Napi::Value Token(Napi::Env env) { return Napi::External<ConstructToken>::New(env, &construct_token); }
void RequireToken(const Napi::CallbackInfo& info, const char* cls, const char* factory) {
  const bool ok = info.Length() == 1 && info[0].IsExternal() && info[0].As<Napi::External<ConstructToken>>().Data() == &construct_token;
  if (!ok) Throw(info.Env(), Code::kInvalidArgument, std::string(cls) + " cannot be constructed from JavaScript; use " + factory);
}

// A method or accessor callback that checks `this` before using it: T::kTag marks the objects T's
// factory made (after they were attached to their native state), so neither an object made with
// `new` nor one of another class can reach T's code. C++ exceptions become JS errors here.
template <typename T, Napi::Value (T::*Member)(const Napi::CallbackInfo&)>
napi_value Invoke(napi_env raw_env, napi_callback_info raw_info) {
  Napi::Env env(raw_env);
  try {
    Napi::CallbackInfo info(raw_env, raw_info);
    const char* name = static_cast<const char*>(info.Data());
    if (!HasTag(raw_env, info.This(), T::Tag())) {
      Throw(env, Code::kInvalidArgument, std::string(T::kClassName) + "." + name + ": `this` is not a " + T::kWhat + "; call it on the object itself");
    }
    T* self = T::Unwrap(info.This().As<Napi::Object>());
    return (self->*Member)(info);
  } catch (const Napi::Error& e) {
    e.ThrowAsJavaScriptException();
  } catch (const std::bad_alloc&) {
    CodedError(env, Code::kOutOfMemory, "out of host memory").ThrowAsJavaScriptException();
  } catch (const std::exception& e) {
    CodedError(env, Code::kDeviceError, std::string("native error: ") + e.what()).ThrowAsJavaScriptException();
  }
  return nullptr;
}
template <typename T, Napi::Value (T::*Member)(const Napi::CallbackInfo&)>
Napi::ClassPropertyDescriptor<T> Method(const char* name) {
  return napi_property_descriptor{name, nullptr, Invoke<T, Member>, nullptr, nullptr, nullptr, napi_default, const_cast<char*>(name)};
}
template <typename T, Napi::Value (T::*Member)(const Napi::CallbackInfo&)>
Napi::ClassPropertyDescriptor<T> Getter(const char* name) {
  return napi_property_descriptor{name, nullptr, nullptr, Invoke<T, Member>, nullptr, nullptr, napi_default, const_cast<char*>(name)};
}

struct BackendHandle;

// Pinned host memory from allocHost, behind an external ArrayBuffer: its finalizer's hint.
struct PinnedHost {
  std::shared_ptr<BackendHandle> owner;  // the backend outlives its pinned memory
  char* ptr;
  size_t bytes;
  bool freed = false;  // by freeHost: the ArrayBuffer's finalizer then has nothing to free
};

// A backend and what its buffers, graphs and pinned memory share: each holds it, so the backend
// outlives every object made from it. What the GC collects is not freed in its finalizer, which
// may run between two ops of a step with work still queued (on cuda cudaFree waits for the whole
// device, and graphs free their work space): it is queued here and freed at the next safe point,
// an explicit free, a synchronize or the next alloc (FreeCollected).
struct BackendHandle {
  std::unique_ptr<Backend> backend;
  int id = 0;
  int capturing = 0;  // streams capturing now: pinned memory is not freed meanwhile (FreeHost waits for the device)
  std::vector<void*> collected_buffers;
  std::vector<std::pair<void*, size_t>> collected_host;
  std::vector<int> collected_graphs;
  int64_t collected_bytes = 0;  // of collected_buffers and collected_host
  std::map<const char*, PinnedHost*> pinned;  // live allocHost memory by address
  std::string forced_gemm, forced_prefill;     // what setForcedForms (or the environment at creation) set

  BackendHandle(std::unique_ptr<Backend> b, int backend_id) : backend(std::move(b)), id(backend_id) {}
  ~BackendHandle() {
    capturing = 0;  // no JavaScript object of this backend is left to end a capture
    FreeCollected();
  }
  void CollectBuffer(void* ptr, size_t bytes) {
    collected_buffers.push_back(ptr);
    collected_bytes += static_cast<int64_t>(bytes);
  }
  void CollectHost(PinnedHost* p) {
    pinned.erase(p->ptr);
    collected_host.emplace_back(p->ptr, p->bytes);
    collected_bytes += static_cast<int64_t>(p->bytes);
  }
  // The safe point: what the GC collected is freed (errors are the device's, already reported by
  // the calls that queued the work).
  void FreeCollected() {
    if (collected_buffers.empty() && collected_graphs.empty() && collected_host.empty()) return;
    for (int g : collected_graphs) backend->DestroyGraph(g);
    collected_graphs.clear();
    for (void* p : collected_buffers) backend->Free(p);
    collected_buffers.clear();
    collected_bytes = 0;
    if (capturing == 0) {
      for (const auto& [p, bytes] : collected_host) backend->FreeHost(p);
      collected_host.clear();
    }
    for (const auto& [p, bytes] : collected_host) collected_bytes += static_cast<int64_t>(bytes);
  }
  // The pinned allocation holding [p, p + bytes), if any.
  const PinnedHost* FindPinned(const char* p, size_t bytes) const {
    auto it = pinned.upper_bound(p);
    if (it == pinned.begin()) return nullptr;
    --it;
    const PinnedHost* h = it->second;
    return p + bytes <= h->ptr + h->bytes ? h : nullptr;
  }
};

// Where w4a16Pack wrote a packed matrix into a buffer: what the GEMMs check their x, y and group
// against. A write to those bytes by upload, copy or fill forgets it.
struct PackedRecord {
  int64_t offset, bytes;
  PackedWeightInfo info;
};

class DeviceBuffer : public Napi::ObjectWrap<DeviceBuffer> {
 public:
  static constexpr const char* kClassName = "DeviceBuffer";
  static constexpr const char* kWhat = "buffer from alloc()";
  static const napi_type_tag* Tag() { return DeviceBufferTag(); }
  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, kClassName, {
      Getter<DeviceBuffer, &DeviceBuffer::Bytes>("bytes"),
      Getter<DeviceBuffer, &DeviceBuffer::Freed>("freed"),
      Getter<DeviceBuffer, &DeviceBuffer::Kind>("backend"),
    });
  }
  explicit DeviceBuffer(const Napi::CallbackInfo& info) : Napi::ObjectWrap<DeviceBuffer>(info) { RequireToken(info, kClassName, "backend.alloc()"); }
  // collected by the GC: freed at the backend's next safe point, not here
  ~DeviceBuffer() override {
    if (ptr_ != nullptr && owner_) owner_->CollectBuffer(ptr_, bytes_);
  }

  void Attach(std::shared_ptr<BackendHandle> owner, void* ptr, size_t bytes) {
    owner_ = std::move(owner);
    ptr_ = ptr;
    bytes_ = bytes;
  }
  void Release() {
    if (ptr_ != nullptr && owner_) owner_->backend->Free(ptr_);
    ptr_ = nullptr;
    packed_.clear();
  }
  bool freed() const { return ptr_ == nullptr; }
  void* ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  const BackendHandle* owner() const { return owner_.get(); }
  // Packed weights w4a16Pack wrote at `offset` (replacing what was recorded there), and what is
  // recorded at `offset`; Forget drops the records a write to [offset, offset + bytes) overlaps.
  void RecordPacked(int64_t offset, int64_t bytes, const PackedWeightInfo& info) {
    Forget(offset, bytes);
    packed_.push_back({offset, bytes, info});
  }
  PackedWeightInfo PackedAt(int64_t offset) const {
    for (const PackedRecord& r : packed_) {
      if (r.offset == offset) return r.info;
    }
    return PackedWeightInfo{};
  }
  void Forget(int64_t offset, int64_t bytes) {
    if (packed_.empty()) return;
    std::vector<PackedRecord> kept;
    for (const PackedRecord& r : packed_) {
      if (r.offset + r.bytes <= offset || offset + bytes <= r.offset) kept.push_back(r);
    }
    packed_ = std::move(kept);
  }
  // Pinned: named by a call still reading its arguments, which holds its address.
  void Pin() { ++pins_; }
  void Unpin() { --pins_; }
  bool pinned() const { return pins_ > 0; }

 private:
  Napi::Value Bytes(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), static_cast<double>(bytes_)); }
  Napi::Value Freed(const Napi::CallbackInfo& info) { return Napi::Boolean::New(info.Env(), freed()); }
  Napi::Value Kind(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), owner_ ? owner_->backend->kind() : "none"); }
  std::shared_ptr<BackendHandle> owner_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int pins_ = 0;
  std::vector<PackedRecord> packed_;
};

// The buffers one call names, with their JS objects: pinned from the moment the call reads them
// until it returns (the destructor runs on every exit, a throw included), and handed to the graph
// when the call is captured. One per call, on the stack: a getter's own native calls have theirs.
class CallBuffers {
 public:
  CallBuffers() = default;
  CallBuffers(const CallBuffers&) = delete;
  CallBuffers& operator=(const CallBuffers&) = delete;
  ~CallBuffers() {
    for (const auto& entry : list_) entry.first->Unpin();
  }
  void Add(DeviceBuffer* b, napi_value object) {
    b->Pin();
    list_.emplace_back(b, object);
  }
  const std::vector<std::pair<DeviceBuffer*, napi_value>>& list() const { return list_; }

 private:
  std::vector<std::pair<DeviceBuffer*, napi_value>> list_;
};

// A captured graph (Backend::BeginCapture): its id in the backend, and references to every buffer
// its ops read or write, which keep them from being collected while it lives.
class Graph : public Napi::ObjectWrap<Graph> {
 public:
  static constexpr const char* kClassName = "Graph";
  static constexpr const char* kWhat = "graph from endCapture()";
  static const napi_type_tag* Tag() { return GraphTag(); }
  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, kClassName, {
      Getter<Graph, &Graph::Calls>("calls"),
      Getter<Graph, &Graph::Freed>("freed"),
      Getter<Graph, &Graph::Kind>("backend"),
    });
  }
  explicit Graph(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Graph>(info) { RequireToken(info, kClassName, "backend.endCapture()"); }
  // collected by the GC: destroyed at the backend's next safe point (it frees the graph's work space)
  ~Graph() override {
    if (id_ != 0 && owner_) owner_->collected_graphs.push_back(id_);
  }

  void Attach(std::shared_ptr<BackendHandle> owner, int id, int calls, std::vector<std::pair<const DeviceBuffer*, Napi::ObjectReference>> buffers) {
    owner_ = std::move(owner);
    id_ = id;
    calls_ = calls;
    buffers_ = std::move(buffers);
  }
  void Release() {
    if (id_ != 0 && owner_) owner_->backend->DestroyGraph(id_);
    id_ = 0;
    buffers_.clear();
  }
  bool freed() const { return id_ == 0; }
  int id() const { return id_; }
  const BackendHandle* owner() const { return owner_.get(); }
  const std::vector<std::pair<const DeviceBuffer*, Napi::ObjectReference>>& buffers() const { return buffers_; }

 private:
  Napi::Value Calls(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), calls_); }
  Napi::Value Freed(const Napi::CallbackInfo& info) { return Napi::Boolean::New(info.Env(), freed()); }
  Napi::Value Kind(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), owner_ ? owner_->backend->kind() : "none"); }
  std::shared_ptr<BackendHandle> owner_;
  int id_ = 0, calls_ = 0;
  std::vector<std::pair<const DeviceBuffer*, Napi::ObjectReference>> buffers_;
};

// What one Node environment (the main thread, or a worker) holds of the addon: every worker loads
// it again, into an environment of its own, so none of this may be a static shared between them.
struct AddonData {
  Napi::FunctionReference buffer, graph, backend;  // the classes' constructors
  int next_backend_id = 1;                         // for messages: "cpu #2"
};
AddonData& Data(Napi::Env env) { return *env.GetInstanceData<AddonData>(); }

// Argument names are C strings, or for parts of a tensor a callable that builds one: messages are
// only written for failures, while every op parses several tensors per call (building each name
// up front cost ~1 us per tensor of every call).
inline std::string NameOf(const char* name) { return name; }
inline std::string NameOf(const std::string& name) { return name; }
template <typename Build>
std::string NameOf(const Build& build) {
  return build();
}

// A number as JavaScript would print it (-16, 0.5, 1e+300, NaN), for messages about bad values:
// the shortest decimal form that reads back as the same double.
std::string FormatNumber(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  char s[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(s, sizeof(s), "%.*g", digits, d);
    if (std::strtod(s, nullptr) == d) break;
  }
  return s;
}

// What a value is, for messages about a wrong type, read without running any JavaScript (no
// toString): `a string ('x')`, `a number (5)`, `null`, `an object`.
std::string Describe(const Napi::Value& v) {
  switch (v.Type()) {
    case napi_undefined: return "undefined";
    case napi_null: return "null";
    case napi_boolean: return v.As<Napi::Boolean>().Value() ? "true" : "false";
    case napi_number: return "the number " + FormatNumber(v.As<Napi::Number>().DoubleValue());
    case napi_string: {
      std::string s = v.As<Napi::String>().Utf8Value();
      if (s.size() > 40) s = s.substr(0, 40) + "...";
      return "the string '" + s + "'";
    }
    case napi_symbol: return "a symbol";
    case napi_function: return "a function";
    case napi_bigint: return "a bigint";
    default: return "an object";
  }
}

DType ParseDType(Napi::Env env, const Napi::Value& v, const std::string& what) {
  if (!v.IsString()) Throw(env, Code::kInvalidArgument, what + ".dtype must be a string (f32, f16, bf16, i32, u8, f64), got " + Describe(v));
  char s[8];  // every dtype name fits; a longer string arrives cut and matches none
  size_t length = 0;
  if (napi_get_value_string_utf8(env, v, s, sizeof(s), &length) != napi_ok) Throw(env, Code::kInvalidArgument, what + ".dtype could not be read");
  const std::string_view name(s, length);
  if (name == "f32") return DType::kF32;
  if (name == "f16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  if (name == "i32") return DType::kI32;
  if (name == "u8") return DType::kU8;
  if (name == "f64") return DType::kF64;
  Throw(env, Code::kInvalidArgument, what + ".dtype '" + v.As<Napi::String>().Utf8Value() + "' is not one of f32, f16, bf16, i32, u8, f64");
}

// The largest integer a double holds exactly (Number.MAX_SAFE_INTEGER): byte counts and offsets.
constexpr int64_t kMaxSafeInteger = 9007199254740991;

// An integer argument in [min, max]. Values the native side keeps in an int (streams, events,
// group sizes, k, positions) take max = INT32_MAX, so that 2^32 + 1 is an error instead of
// wrapping to 1.
template <typename Name>
int64_t ParseInt(Napi::Env env, const Napi::Value& v, const Name& what, int64_t min = INT64_MIN, int64_t max = kMaxSafeInteger) {
  if (!v.IsNumber()) Throw(env, Code::kInvalidArgument, NameOf(what) + " must be a number, got " + Describe(v));
  const double d = v.As<Napi::Number>().DoubleValue();
  // the range test comes first: casting a double outside int64 is undefined
  const bool in_range = d >= static_cast<double>(min) && d <= static_cast<double>(max);
  if (!in_range || d != std::floor(d)) {
    const bool bounded = max != kMaxSafeInteger;
    const std::string range = min == INT64_MIN ? (bounded ? " <= " + std::to_string(max) : "")
                              : bounded       ? " in [" + std::to_string(min) + ", " + std::to_string(max) + "]"
                                              : " >= " + std::to_string(min) + (d > static_cast<double>(max) ? " and at most 2^53 - 1" : "");
    Throw(env, Code::kInvalidArgument, NameOf(what) + " must be an integer" + range + ", got " + FormatNumber(d));
  }
  return static_cast<int64_t>(d);
}
template <typename Name>
int ParseInt32(Napi::Env env, const Napi::Value& v, const Name& what, int min = INT32_MIN) {
  return static_cast<int>(ParseInt(env, v, what, min, INT32_MAX));
}

bool Given(const Napi::CallbackInfo& info, size_t i) { return info.Length() > i && !info[i].IsUndefined(); }

class NativeBackend : public Napi::ObjectWrap<NativeBackend> {
 public:
  static constexpr const char* kClassName = "NativeBackend";
  static constexpr const char* kWhat = "backend from createBackend()";
  static const napi_type_tag* Tag() { return BackendTag(); }
  static Napi::Function Init(Napi::Env env) {
    using B = NativeBackend;
    return DefineClass(env, kClassName, {
      Getter<B, &B::Kind>("kind"),
      Method<B, &B::Info>("info"),
      Method<B, &B::AllocJs>("alloc"),
      Method<B, &B::FreeJs>("free"),
      Method<B, &B::AllocHostJs>("allocHost"),
      Method<B, &B::FreeHostJs>("freeHost"),
      Method<B, &B::MemoryInfoJs>("memoryInfo"),
      Method<B, &B::Upload>("upload"),
      Method<B, &B::Download>("download"),
      Method<B, &B::CopyJs>("copy"),
      Method<B, &B::FillJs>("fill"),
      Method<B, &B::HoldJs>("hold"),
      Method<B, &B::CreateStreamJs>("createStream"),
      Method<B, &B::DestroyStreamJs>("destroyStream"),
      Method<B, &B::SynchronizeJs>("synchronize"),
      Method<B, &B::CreateEventJs>("createEvent"),
      Method<B, &B::DestroyEventJs>("destroyEvent"),
      Method<B, &B::RecordEventJs>("recordEvent"),
      Method<B, &B::ElapsedJs>("elapsedMs"),
      Method<B, &B::WaitEventJs>("waitEvent"),
      Method<B, &B::BeginCaptureJs>("beginCapture"),
      Method<B, &B::EndCaptureJs>("endCapture"),
      Method<B, &B::LaunchGraphJs>("launchGraph"),
      Method<B, &B::FreeGraphJs>("freeGraph"),
      Method<B, &B::SetForcedFormsJs>("setForcedForms"),
      Method<B, &B::LastFormJs>("lastForm"),
      Method<B, &B::W4A16PackJs>("w4a16Pack"),
      Method<B, &B::W4A16GemmJs>("w4a16Gemm"),
      Method<B, &B::GemmJs>("gemm"),
      Method<B, &B::MoeGemmJs>("moeGemm"),
      Method<B, &B::MlaAttentionJs>("mlaAttention"),
      Method<B, &B::EmbeddingJs>("embedding"),
      Method<B, &B::RmsNormJs>("rmsNorm"),
      Method<B, &B::RopeJs>("rope"),
      Method<B, &B::SiluMulJs>("siluMul"),
      Method<B, &B::GqaAttentionJs>("gqaAttention"),
      Method<B, &B::AddJs>("add"),
      Method<B, &B::RouterJs>("router"),
      Method<B, &B::ArgmaxJs>("argmax"),
      Method<B, &B::TopkJs>("topk"),
      Method<B, &B::KvWriteJs>("kvWrite"),
      Method<B, &B::MlaInputsJs>("mlaInputs"),
      Method<B, &B::MlaQueryJs>("mlaQuery"),
      Method<B, &B::DdtreeBuildJs>("ddtreeBuild"),
      Method<B, &B::DdtreeAcceptJs>("ddtreeAccept"),
      Method<B, &B::KvCommitJs>("kvCommit"),
      Method<B, &B::ArangeJs>("arange"),
      Method<B, &B::NcclInitJs>("ncclInit"),
      Method<B, &B::NcclAllReduceJs>("ncclAllReduce"),
      Method<B, &B::NcclAllGatherJs>("ncclAllGather"),
      Method<B, &B::NcclBroadcastJs>("ncclBroadcast"),
      Method<B, &B::NcclAsyncErrorJs>("ncclAsyncError"),
      Method<B, &B::NcclArmJs>("ncclArm"),
      Method<B, &B::NcclAbortJs>("ncclAbort"),
      Method<B, &B::NcclDestroyJs>("ncclDestroy"),
    });
  }
  explicit NativeBackend(const Napi::CallbackInfo& info) : Napi::ObjectWrap<NativeBackend>(info) { RequireToken(info, kClassName, "createBackend()"); }
  // communicators never destroyed: aborted (destroy would wait for ranks that may be gone)
  ~NativeBackend() override {
#ifdef KDTREE_WITH_CUDA
    for (auto& [id, comm] : comms_) {
      // the thread is stopped first: it may abort the communicator until it has
      comm.watchdog->Stop();
      if (!comm.watchdog->fired()) nccl::CommAbort(comm.ptr);
    }
#endif
  }
  void Attach(std::unique_ptr<Backend> b, int id, std::string forced_gemm, std::string forced_prefill) {
    handle_ = std::make_shared<BackendHandle>(std::move(b), id);
    handle_->forced_gemm = std::move(forced_gemm);
    handle_->forced_prefill = std::move(forced_prefill);
  }

 private:
  Backend& be() { return *handle_->backend; }

  // One op call's arguments while they are read: the argument object and the buffers named so far.
  struct Call {
    Napi::Env env;
    Napi::Object args;
    CallBuffers buffers;
  };
  // Every op taking an argument object starts here.
  static Napi::Object ArgsObject(const Napi::CallbackInfo& info) {
    if (info.Length() < 1 || !info[0].IsObject()) Throw(info.Env(), Code::kInvalidArgument, "expected one argument object, got " + (info.Length() < 1 ? std::string("nothing") : Describe(info[0])));
    return info[0].As<Napi::Object>();
  }

  // A DeviceBuffer of this backend, alive; not pinned (free() and the lookups of pinning calls).
  template <typename Name>
  DeviceBuffer* Lookup(Napi::Env env, const Napi::Value& v, const Name& what) {
    if (!HasTag(env, v, DeviceBufferTag())) Throw(env, Code::kInvalidArgument, NameOf(what) + " must be a DeviceBuffer from alloc(), got " + Describe(v));
    DeviceBuffer* b = DeviceBuffer::Unwrap(v.As<Napi::Object>());
    if (b->freed()) Throw(env, Code::kInvalidArgument, NameOf(what) + ": use of a freed buffer");
    if (b->owner() != handle_.get()) {
      Throw(env, Code::kInvalidArgument, NameOf(what) + ": buffer belongs to another backend (" + std::string(b->owner()->backend->kind()) + " #" + std::to_string(b->owner()->id) + "), not this " + be().kind() +
                                             " #" + std::to_string(handle_->id));
    }
    return b;
  }
  // A buffer the call uses: looked up, then pinned for the rest of the call.
  template <typename Name>
  DeviceBuffer* Buf(Napi::Env env, CallBuffers& buffers, const Napi::Value& v, const Name& what) {
    DeviceBuffer* b = Lookup(env, v, what);
    buffers.Add(b, v);
    return b;
  }

  // {buffer, dtype, shape, offset?} -> Tensor (buffer alive, ours and pinned; offset in range)
  template <typename Name>
  Tensor ParseTensor(Call& c, const Napi::Value& v, const Name& what, bool optional, DeviceBuffer** buffer = nullptr) {
    Napi::Env env = c.env;
    Tensor t;
    t.name = NameOf(what);  // an absent optional tensor is named in messages too
    if (v.IsUndefined() || v.IsNull()) {
      if (optional) return t;
      Throw(env, Code::kInvalidArgument, NameOf(what) + " is required");
    }
    if (!v.IsObject()) Throw(env, Code::kInvalidArgument, NameOf(what) + " must be a tensor {buffer, dtype, shape}, got " + Describe(v));
    Napi::Object o = v.As<Napi::Object>();
    DeviceBuffer* b = Buf(env, c.buffers, o.Get("buffer"), [&] { return NameOf(what) + ".buffer"; });
    t.dtype = ParseDType(env, o.Get("dtype"), NameOf(what));
    Napi::Value shape = o.Get("shape");
    if (!shape.IsArray()) Throw(env, Code::kInvalidArgument, NameOf(what) + ".shape must be an array, got " + Describe(shape));
    Napi::Array arr = shape.As<Napi::Array>();
    const uint32_t rank = arr.Length();
    if (rank > 8) Throw(env, Code::kInvalidArgument, NameOf(what) + ".shape has more than 8 dimensions");
    int64_t numel = 1;
    for (uint32_t i = 0; i < rank; ++i) {
      const int64_t d = ParseInt(env, arr.Get(i), [&] { return NameOf(what) + ".shape[" + std::to_string(i) + "]"; }, 0);
      t.shape.push_back(d);
      if (d > 0 && numel > (int64_t{1} << 50) / d) Throw(env, Code::kInvalidArgument, NameOf(what) + ".shape is too large");
      numel *= d;
    }
    const Napi::Value offset_v = o.Get("offset");
    const int64_t offset = offset_v.IsUndefined() ? 0 : ParseInt(env, offset_v, [&] { return NameOf(what) + ".offset"; }, 0);
    // the buffer is pinned: its size and address cannot have changed while the getters above ran
    if (offset > static_cast<int64_t>(b->bytes())) Throw(env, Code::kInvalidArgument, NameOf(what) + ".offset " + std::to_string(offset) + " is past the buffer's " + std::to_string(b->bytes()) + " bytes");
    t.data = static_cast<char*>(b->ptr()) + offset;
    t.bytes = static_cast<int64_t>(b->bytes()) - offset;
    if (buffer != nullptr) *buffer = b;
    return t;
  }
  Tensor TensorArg(Call& c, const char* key, bool optional = false) { return ParseTensor(c, c.args.Get(key), key, optional); }
  // Packed weights: the tensor, and what w4a16Pack recorded where it starts (if it packed it).
  Tensor PackedArg(Call& c, const char* key, PackedWeightInfo* info) {
    DeviceBuffer* b = nullptr;
    Tensor t = ParseTensor(c, c.args.Get(key), key, false, &b);
    *info = b->PackedAt(static_cast<char*>(t.data) - static_cast<char*>(b->ptr()));
    return t;
  }

  // Scalars: undefined takes the default; anything else must be of the right type and range.
  double Num(Call& c, const char* key, double fallback) {
    const Napi::Value v = c.args.Get(key);
    if (v.IsUndefined()) return fallback;
    const double d = v.IsNumber() ? v.As<Napi::Number>().DoubleValue() : NAN;
    if (!v.IsNumber() || !std::isfinite(d)) Throw(c.env, Code::kInvalidArgument, std::string(key) + " must be a finite number, got " + Describe(v));
    return d;
  }
  int64_t Int(Call& c, const char* key, int64_t fallback, int64_t min = INT64_MIN, int64_t max = kMaxSafeInteger) {
    const Napi::Value v = c.args.Get(key);
    return v.IsUndefined() ? fallback : ParseInt(c.env, v, key, min, max);
  }
  int Int32(Call& c, const char* key, int fallback, int min = INT32_MIN) {
    const Napi::Value v = c.args.Get(key);
    return v.IsUndefined() ? fallback : ParseInt32(c.env, v, key, min);
  }
  bool Bool(Call& c, const char* key, bool fallback) {
    const Napi::Value v = c.args.Get(key);
    if (v.IsUndefined()) return fallback;
    if (!v.IsBoolean()) Throw(c.env, Code::kInvalidArgument, std::string(key) + " must be a boolean (true or false), got " + Describe(v));
    return v.As<Napi::Boolean>().Value();
  }
  // A string option, one of `choices` (comma-separated in messages).
  std::string Choice(Call& c, const char* op, const char* key, const char* fallback, std::initializer_list<const char*> choices) {
    const Napi::Value v = c.args.Get(key);
    if (v.IsUndefined()) return fallback;
    std::string list;  // 'a' or 'b', or 'a', 'b' or 'c'
    size_t i = 0;
    for (const char* s : choices) {
      list += i == 0 ? "'" : i + 1 == choices.size() ? " or '" : ", '";
      list += std::string(s) + "'";
      ++i;
    }
    if (!v.IsString()) Throw(c.env, Code::kInvalidArgument, std::string(op) + ": " + key + " must be " + list + ", got " + Describe(v));
    const std::string s = v.As<Napi::String>().Utf8Value();
    for (const char* choice : choices) {
      if (s == choice) return s;
    }
    Throw(c.env, Code::kInvalidArgument, std::string(op) + ": " + key + " must be " + list + ", got '" + s + "'");
  }
  Epilogue ParseEpilogue(Call& c, const char* op) { return Choice(c, op, "epilogue", "none", {"none", "siluMul"}) == "siluMul" ? Epilogue::kSiluMul : Epilogue::kNone; }
  // The call's stream: read with the other arguments, checked with them (after every getter ran).
  int StreamArg(Call& c) {
    const Napi::Value v = c.args.Get("stream");
    return v.IsUndefined() ? 0 : ParseInt32(c.env, v, "stream", 0);
  }

  Napi::Value Kind(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), be().kind()); }
  // setForcedForms({gemm?, w4a16Prefill?}) -> the previous setting; an absent (or null) key is the rule.
  Napi::Value SetForcedFormsJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1 || !info[0].IsObject()) Throw(env, Code::kInvalidArgument, "setForcedForms: expected {gemm?, w4a16Prefill?}, got " + (info.Length() < 1 ? std::string("nothing") : Describe(info[0])));
    Napi::Object o = info[0].As<Napi::Object>();
    const auto read = [&](const char* key) {
      const Napi::Value v = o.Get(key);
      if (v.IsUndefined() || v.IsNull()) return std::string();
      if (!v.IsString()) Throw(env, Code::kInvalidArgument, std::string("setForcedForms: ") + key + " must be a string, got " + Describe(v));
      return v.As<Napi::String>().Utf8Value();
    };
    const std::string gemm = read("gemm"), prefill = read("w4a16Prefill");
    Check(env, be().SetForcedForms(gemm.c_str(), prefill.c_str()));
    Napi::Object previous = ForcedFormsObject(env, handle_->forced_gemm, handle_->forced_prefill);
    handle_->forced_gemm = gemm;
    handle_->forced_prefill = prefill;
    return previous;
  }
  static Napi::Object ForcedFormsObject(Napi::Env env, const std::string& gemm, const std::string& prefill) {
    Napi::Object o = Napi::Object::New(env);
    o.Set("gemm", gemm.empty() ? env.Null() : Napi::String::New(env, gemm));
    o.Set("w4a16Prefill", prefill.empty() ? env.Null() : Napi::String::New(env, prefill));
    return o;
  }
  Napi::Value LastFormJs(const Napi::CallbackInfo& info) {
    const char* form = be().LastForm();
    return form == nullptr ? info.Env().Null() : Napi::String::New(info.Env(), form);
  }
  Napi::Value Info(const Napi::CallbackInfo& info) {
    DeviceInfo d = be().info();
    Napi::Object o = Napi::Object::New(info.Env());
    o.Set("kind", be().kind());
    o.Set("name", d.name);
    o.Set("computeCapability", std::to_string(d.compute_major) + "." + std::to_string(d.compute_minor));
    o.Set("multiprocessors", d.multiprocessors);
    o.Set("totalMemory", static_cast<double>(d.total_memory));
    o.Set("driverVersion", d.driver_version);
    o.Set("runtimeVersion", d.runtime_version);
    return o;
  }

  Napi::Value AllocJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int64_t bytes = Given(info, 0) ? ParseInt(env, info[0], "bytes", 0) : -1;
    if (bytes < 0) Throw(env, Code::kInvalidArgument, "alloc(bytes): bytes must be a non-negative integer");
    Napi::Object obj = Data(env).buffer.New({Token(env)});
    handle_->FreeCollected();  // a safe point: memory the GC collected can serve this allocation
    void* ptr = nullptr;
    Check(env, be().Alloc(static_cast<size_t>(std::max<int64_t>(bytes, 1)), &ptr));
    DeviceBuffer::Unwrap(obj)->Attach(handle_, ptr, static_cast<size_t>(bytes));
    if (napi_type_tag_object(env, obj, DeviceBufferTag()) != napi_ok) Throw(env, Code::kDeviceError, "alloc: could not tag the new buffer");
    return obj;
  }
  Napi::Value FreeJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1) Throw(env, Code::kInvalidArgument, "free(buffer): missing buffer");
    DeviceBuffer* b = Lookup(env, info[0], "free: buffer");
    if (b->pinned()) {
      Throw(env, Code::kInvalidArgument, "free: the buffer is in use by a call that is still reading its arguments (a getter may not free a buffer that call already named); free it after the call returns");
    }
    b->Release();
    handle_->FreeCollected();  // a safe point
    return env.Undefined();
  }

  // allocHost(bytes) -> ArrayBuffer over pinned host memory (cpu: aligned host memory), which
  // upload() copies from asynchronously. It stays valid until freeHost(); one the GC collects
  // without freeHost is freed at the next safe point, after the device finished with it.
  Napi::Value AllocHostJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int64_t bytes = Given(info, 0) ? ParseInt(env, info[0], "bytes", 0) : -1;
    if (bytes < 0) Throw(env, Code::kInvalidArgument, "allocHost(bytes): bytes must be a non-negative integer");
    handle_->FreeCollected();
    void* ptr = nullptr;
    Check(env, be().AllocHost(static_cast<size_t>(std::max<int64_t>(bytes, 1)), &ptr));
    auto* pin = new PinnedHost{handle_, static_cast<char*>(ptr), static_cast<size_t>(bytes)};
    napi_value array;
    const napi_status st = napi_create_external_arraybuffer(env, ptr, static_cast<size_t>(bytes), FinalizePinned, pin, &array);
    if (st != napi_ok) {
      delete pin;
      be().FreeHost(ptr);
      Throw(env, Code::kUnsupported, "allocHost: this Node.js cannot wrap native memory in an ArrayBuffer (napi_create_external_arraybuffer failed: external buffers are not allowed)");
    }
    handle_->pinned[pin->ptr] = pin;
    return Napi::Value(env, array);
  }
  static void FinalizePinned(napi_env, void*, void* hint) {
    auto* pin = static_cast<PinnedHost*>(hint);
    if (!pin->freed) pin->owner->CollectHost(pin);
    delete pin;
  }
  // freeHost(array): frees allocHost memory now (after the device finished the copies reading
  // it) and detaches the ArrayBuffer, so that its views read as empty instead of freed memory.
  Napi::Value FreeHostJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Value v = info.Length() > 0 ? info[0] : env.Undefined();
    Napi::ArrayBuffer array;
    if (v.IsArrayBuffer()) array = v.As<Napi::ArrayBuffer>();
    else if (v.IsTypedArray()) array = v.As<Napi::TypedArray>().ArrayBuffer();
    else Throw(env, Code::kInvalidArgument, "freeHost(array): array must be the ArrayBuffer from allocHost() (or a view of it), got " + Describe(v));
    const char* data = static_cast<const char*>(array.Data());
    auto it = data == nullptr ? handle_->pinned.end() : handle_->pinned.find(data);
    if (it == handle_->pinned.end() || it->second->bytes != array.ByteLength()) {
      Throw(env, Code::kInvalidArgument, "freeHost: not an ArrayBuffer from allocHost() of this backend, or one already freed (" + std::to_string(array.ByteLength()) + " bytes)");
    }
    NotCapturing(env, "freeHost", -1);  // it waits for the whole device
    // before the detach, which may run the ArrayBuffer's finalizer (and delete `pin`) at once:
    // marked freed, that finalizer frees nothing
    PinnedHost* pin = it->second;
    char* ptr = pin->ptr;
    pin->freed = true;
    handle_->pinned.erase(it);
    if (napi_detach_arraybuffer(env, array) != napi_ok) {
      pin->freed = false;  // still alive: the finalizer has not run
      handle_->pinned[ptr] = pin;
      Throw(env, Code::kDeviceError, "freeHost: the ArrayBuffer could not be detached; it is left allocated");
    }
    Check(env, be().FreeHost(ptr));
    handle_->FreeCollected();
    return env.Undefined();
  }

  // upload(buffer, data: TypedArray|Buffer, offset = 0, stream = 0): host -> device. From
  // allocHost memory it is queued on the stream and returns at once (keep the data unchanged until
  // the stream passes it: synchronize, or an event); from any other memory it is complete on return.
  Napi::Value Upload(const Napi::CallbackInfo& info) { return HostCopy(info, true); }
  // download(buffer, into: TypedArray|Buffer, offset = 0, stream = 0): device -> host after the
  // work queued on the stream, complete on return
  Napi::Value Download(const Napi::CallbackInfo& info) { return HostCopy(info, false); }
  Napi::Value HostCopy(const Napi::CallbackInfo& info, bool up) {
    Napi::Env env = info.Env();
    const char* op = up ? "upload" : "download";
    CallBuffers buffers;
    DeviceBuffer* b = Buf(env, buffers, info[0], [op] { return std::string(op) + ": buffer"; });
    if (info.Length() < 2 || !info[1].IsTypedArray()) Throw(env, Code::kInvalidArgument, std::string(op) + "(buffer, typedArray, offset?, stream?): the second argument must be a TypedArray or Buffer");
    Napi::TypedArray ta = info[1].As<Napi::TypedArray>();
    const int64_t offset = Given(info, 2) ? ParseInt(env, info[2], "offset", 0) : 0;
    const int stream = Given(info, 3) ? ParseInt32(env, info[3], "stream", 0) : 0;
    const size_t bytes = ta.ByteLength();
    if (offset + static_cast<int64_t>(bytes) > static_cast<int64_t>(b->bytes())) {
      Throw(env, Code::kInvalidArgument, std::string(op) + ": " + std::to_string(bytes) + " bytes at offset " + std::to_string(offset) + " do not fit the buffer's " + std::to_string(b->bytes()) + " bytes");
    }
    NotCapturing(env, op, stream);
    Check(env, be().CheckStream(stream));
    // napi_get_typedarray_info's data pointer, not ta.ArrayBuffer().Data(): the latter refuses a
    // view of a SharedArrayBuffer (it is no ArrayBuffer), whose bytes copy just the same
    void* view_data = nullptr;
    if (napi_get_typedarray_info(env, ta, nullptr, nullptr, &view_data, nullptr, nullptr) != napi_ok) {
      Throw(env, Code::kInvalidArgument, std::string(op) + ": the second argument's memory could not be read (" + Describe(info[1]) + ")");
    }
    char* host = static_cast<char*>(view_data);
    char* dev = static_cast<char*>(b->ptr()) + offset;
    if (!up) {
      Check(env, be().CopyToHost(host, dev, bytes, stream));
      return env.Undefined();
    }
    b->Forget(offset, static_cast<int64_t>(bytes));
    const bool pinned = bytes > 0 && handle_->FindPinned(host, bytes) != nullptr;
    Check(env, pinned ? be().CopyToDeviceAsync(dev, host, bytes, stream) : be().CopyToDevice(dev, host, bytes, stream));
    return env.Undefined();
  }
  // memoryInfo() -> {free, total, collected}: device memory (cpu: the host's available memory);
  // `collected`: bytes the GC collected that the next safe point frees (not yet in `free`).
  Napi::Value MemoryInfoJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    int64_t free = 0, total = 0;
    Check(env, be().MemoryInfo(&free, &total));
    Napi::Object o = Napi::Object::New(env);
    o.Set("free", static_cast<double>(free));
    o.Set("total", static_cast<double>(total));
    o.Set("collected", static_cast<double>(handle_->collected_bytes));
    return o;
  }
  // copy({dst, src, bytes, dstOffset, srcOffset, stream}): device -> device, asynchronous
  Napi::Value CopyJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    Napi::Env env = c.env;
    DeviceBuffer* dst = Buf(env, c.buffers, c.args.Get("dst"), "dst");
    DeviceBuffer* src = Buf(env, c.buffers, c.args.Get("src"), "src");
    const int64_t dOff = Int(c, "dstOffset", 0, 0), sOff = Int(c, "srcOffset", 0, 0);
    const int64_t given_bytes = Int(c, "bytes", -1, 0);
    const int stream = StreamArg(c);
    const int64_t dst_bytes = static_cast<int64_t>(dst->bytes()), src_bytes = static_cast<int64_t>(src->bytes());
    // checked before `bytes` defaults to the rest of src, which past its end would be negative
    if (sOff > src_bytes) Throw(env, Code::kInvalidArgument, "copy: srcOffset " + std::to_string(sOff) + " is past src's " + std::to_string(src_bytes) + " bytes");
    const int64_t bytes = given_bytes >= 0 ? given_bytes : src_bytes - sOff;
    if (dOff + bytes > dst_bytes || sOff + bytes > src_bytes) {
      Throw(env, Code::kInvalidArgument, "copy: " + std::to_string(bytes) + " bytes from srcOffset " + std::to_string(sOff) + " to dstOffset " + std::to_string(dOff) + " do not fit src's " +
                                             std::to_string(src_bytes) + " and dst's " + std::to_string(dst_bytes) + " bytes");
    }
    // cudaMemcpy leaves overlapping ranges undefined; the cpu twin would memmove them: neither is
    // accepted, so both variants behave the same
    if (dst == src && dOff != sOff && dOff < sOff + bytes && sOff < dOff + bytes) {
      Throw(env, Code::kInvalidArgument, "copy: bytes [" + std::to_string(sOff) + ", " + std::to_string(sOff + bytes) + ") and [" + std::to_string(dOff) + ", " + std::to_string(dOff + bytes) +
                                             ") of one buffer overlap; copy through a second buffer");
    }
    Check(env, be().CheckStream(stream));
    dst->Forget(dOff, bytes);
    void* d = static_cast<char*>(dst->ptr()) + dOff;
    const void* from = static_cast<char*>(src->ptr()) + sOff;
    const size_t n = static_cast<size_t>(bytes);
    Backend* backend = &be();
    Queue(env, c.buffers, stream, [backend, d, from, n](int s) { return backend->CopyDeviceToDevice(d, from, n, s); });
    return env.Undefined();
  }
  Napi::Value FillJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    CallBuffers buffers;
    DeviceBuffer* b = Buf(env, buffers, info[0], "fill: buffer");
    const int64_t value = Given(info, 1) ? ParseInt(env, info[1], "value", 0) : 0;
    if (value > 255) Throw(env, Code::kInvalidArgument, "fill: value must be a byte (0..255)");
    const int stream = Given(info, 2) ? ParseInt32(env, info[2], "stream", 0) : 0;
    Check(env, be().CheckStream(stream));
    b->Forget(0, static_cast<int64_t>(b->bytes()));
    void* d = b->ptr();
    const size_t n = b->bytes();
    Backend* backend = &be();
    Queue(env, buffers, stream, [backend, d, n, value](int s) { return backend->Fill(d, static_cast<uint8_t>(value), n, s); });
    return env.Undefined();
  }
  Napi::Value HoldJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int64_t us = ParseInt(env, info[0], "microseconds", 0);
    if (us > 10'000'000) Throw(env, Code::kInvalidArgument, "hold: microseconds must be at most 10000000 (10 s)");
    const int stream = Given(info, 1) ? ParseInt32(env, info[1], "stream", 0) : 0;
    Check(env, be().CheckStream(stream));
    CallBuffers none;
    Backend* backend = &be();
    Queue(env, none, stream, [backend, us](int s) { return backend->Hold(us, s); });
    return env.Undefined();
  }
  Napi::Value CreateStreamJs(const Napi::CallbackInfo& info) {
    int s = 0;
    Check(info.Env(), be().CreateStream(&s));
    return Napi::Number::New(info.Env(), s);
  }
  Napi::Value DestroyStreamJs(const Napi::CallbackInfo& info) {
    const int stream = ParseInt32(info.Env(), info[0], "stream", 1);
    NotCapturing(info.Env(), "destroyStream", stream);
    Check(info.Env(), be().DestroyStream(stream));
    return info.Env().Undefined();
  }
  Napi::Value SynchronizeJs(const Napi::CallbackInfo& info) {
    const int stream = Given(info, 0) ? ParseInt32(info.Env(), info[0], "stream", -1) : -1;
    NotCapturing(info.Env(), "synchronize", stream);
    Check(info.Env(), be().Synchronize(stream));
    handle_->FreeCollected();  // a safe point
    return info.Env().Undefined();
  }
  Napi::Value CreateEventJs(const Napi::CallbackInfo& info) {
    int e = 0;
    Check(info.Env(), be().CreateEvent(&e));
    return Napi::Number::New(info.Env(), e);
  }
  Napi::Value DestroyEventJs(const Napi::CallbackInfo& info) {
    Check(info.Env(), be().DestroyEvent(ParseInt32(info.Env(), info[0], "event", 0)));
    return info.Env().Undefined();
  }
  Napi::Value RecordEventJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int event = ParseInt32(env, info[0], "event", 0);
    const int stream = Given(info, 1) ? ParseInt32(env, info[1], "stream", 0) : 0;
    NotCapturing(env, "recordEvent", stream);
    Check(env, be().CheckStream(stream));
    Check(env, be().RecordEvent(event, stream));
    return env.Undefined();
  }
  // waitEvent(event, stream = 0): work queued on `stream` from now on waits for the work queued
  // before the event's last record (on the device; the host does not wait)
  Napi::Value WaitEventJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int event = ParseInt32(env, info[0], "event", 0);
    const int stream = Given(info, 1) ? ParseInt32(env, info[1], "stream", 0) : 0;
    NotCapturing(env, "waitEvent", stream);
    Check(env, be().CheckStream(stream));
    Check(env, be().WaitEvent(event, stream));
    return env.Undefined();
  }
  Napi::Value ElapsedJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int start = ParseInt32(env, info[0], "start", 0), end = ParseInt32(env, info[1], "end", 0);
    float ms = 0;
    Check(env, be().ElapsedMs(start, end, &ms));
    return Napi::Number::New(env, ms);
  }

  // Graphs (Backend::BeginCapture). The binding keeps the capture's state for both variants: which
  // streams capture, the buffers each captured call used (the graph holds them), its call count.
  struct Capture {
    std::vector<std::pair<const DeviceBuffer*, Napi::ObjectReference>> buffers;
    std::set<const DeviceBuffer*> seen;
    int calls = 0;
  };

  // Calls that wait for a stream, or time it, have no place inside a capture.
  void NotCapturing(Napi::Env env, const char* op, int stream) {
    if (captures_.empty()) return;
    if (stream >= 0 && !captures_.count(stream)) return;
    const int capturing = stream >= 0 ? stream : captures_.begin()->first;
    Throw(env, Code::kInvalidArgument, std::string(op) + ": stream " + std::to_string(capturing) + " is capturing a graph; call endCapture(" + std::to_string(capturing) + ") first");
  }

  // Queues one op on `stream` (checked). On a capturing stream the call's buffers go to the
  // capture, and the cpu twin records the call (`op` copied, with what it captured by value)
  // instead of running it.
  template <typename Op>
  void Queue(Napi::Env env, const CallBuffers& buffers, int stream, const Op& op) {
    auto it = captures_.empty() ? captures_.end() : captures_.find(stream);
    if (it == captures_.end()) {
      Check(env, op(stream));
      return;
    }
    Check(env, be().RecordsCalls() ? be().RecordCall(stream, [op] { return op(0); }) : op(stream));
    Capture& c = it->second;
    ++c.calls;
    for (const auto& [buffer, value] : buffers.list()) {
      if (c.seen.insert(buffer).second) c.buffers.emplace_back(buffer, Napi::Persistent(Napi::Object(env, value)));
    }
  }

  // beginCapture(stream): the ops queued on `stream` from now on are captured, not run.
  Napi::Value BeginCaptureJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int stream = ParseInt32(env, info[0], "stream", 0);
    Check(env, be().CheckStream(stream));
    if (stream == 0) Throw(env, Code::kInvalidArgument, "beginCapture: stream 0 (the default stream) cannot be captured; capture a stream from createStream()");
    if (captures_.count(stream)) Throw(env, Code::kInvalidArgument, "beginCapture: stream " + std::to_string(stream) + " is already capturing");
    Check(env, be().BeginCapture(stream));
    captures_[stream];
    handle_->capturing = static_cast<int>(captures_.size());
    return env.Undefined();
  }
  // endCapture(stream) -> Graph
  Napi::Value EndCaptureJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int stream = ParseInt32(env, info[0], "stream", 0);
    auto it = captures_.find(stream);
    if (it == captures_.end()) Throw(env, Code::kInvalidArgument, "endCapture: stream " + std::to_string(stream) + " is not capturing (beginCapture first)");
    Napi::Object obj = Data(env).graph.New({Token(env)});
    Capture c = std::move(it->second);
    captures_.erase(it);
    handle_->capturing = static_cast<int>(captures_.size());
    int id = 0;
    Check(env, be().EndCapture(stream, &id));
    Graph::Unwrap(obj)->Attach(handle_, id, c.calls, std::move(c.buffers));
    if (napi_type_tag_object(env, obj, GraphTag()) != napi_ok) Throw(env, Code::kDeviceError, "endCapture: could not tag the graph");
    return obj;
  }
  Graph* GraphArg(Napi::Env env, const Napi::Value& v, const char* op) {
    if (!HasTag(env, v, GraphTag())) Throw(env, Code::kInvalidArgument, std::string(op) + ": graph must be a Graph from endCapture(), got " + Describe(v));
    Graph* g = Graph::Unwrap(v.As<Napi::Object>());
    if (g->freed()) Throw(env, Code::kInvalidArgument, std::string(op) + ": use of a freed graph");
    if (g->owner() != handle_.get()) Throw(env, Code::kInvalidArgument, std::string(op) + ": graph belongs to another backend (#" + std::to_string(g->owner()->id) + "), not this " + be().kind() + " #" + std::to_string(handle_->id));
    return g;
  }
  // launchGraph(graph, stream = 0): replays the graph's ops on `stream`, after the work queued there.
  Napi::Value LaunchGraphJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Graph* g = GraphArg(env, info[0], "launchGraph");
    const int stream = Given(info, 1) ? ParseInt32(env, info[1], "stream", 0) : 0;
    const auto& buffers = g->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) {
      const DeviceBuffer* b = buffers[i].first;
      if (b->freed()) Throw(env, Code::kInvalidArgument, "launchGraph: buffer " + std::to_string(i) + " of the graph (" + std::to_string(b->bytes()) + " bytes) was freed after the capture; the graph's ops use it");
    }
    Check(env, be().CheckStream(stream));
    if (captures_.count(stream)) Throw(env, Code::kInvalidArgument, "launchGraph: stream " + std::to_string(stream) + " is capturing; a graph is not launched into a capture");
    Check(env, be().LaunchGraph(g->id(), stream));
    return env.Undefined();
  }
  Napi::Value FreeGraphJs(const Napi::CallbackInfo& info) {
    GraphArg(info.Env(), info[0], "freeGraph")->Release();
    return info.Env().Undefined();
  }

  // The end of every op: the stream is the last argument read; then, with no JavaScript left to
  // run, the arguments are validated and the op queued on the stream.
  template <typename Args>
  Napi::Value Run(Call& c, const Args& a, Status (*validate)(const Args&), Status (Backend::*op)(const Args&, int)) {
    Napi::Env env = c.env;
    const int stream = StreamArg(c);
    Check(env, validate(a));
    Check(env, be().CheckStream(stream));
    if (captures_.empty()) {  // the common case: no copy of the arguments
      Check(env, (be().*op)(a, stream));
      return env.Undefined();
    }
    Backend* backend = &be();
    Queue(env, c.buffers, stream, [backend, a, op](int s) { return (backend->*op)(a, s); });
    return env.Undefined();
  }

  // Records on the packed outputs what they hold, for the GEMMs to check (PackedWeightInfo).
  Napi::Value W4A16PackJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    DeviceBuffer *qw_out = nullptr, *sc_out = nullptr;
    W4A16PackArgs a;
    a.qw = TensorArg(c, "qw");
    a.sc = TensorArg(c, "sc");
    a.qw_packed = ParseTensor(c, c.args.Get("qwPacked"), "qwPacked", false, &qw_out);
    a.sc_packed = ParseTensor(c, c.args.Get("scPacked"), "scPacked", false, &sc_out);
    a.group = Int32(c, "group", 32);
    a.gate_up = Bool(c, "interleaveGateUp", false);
    Run(c, a, ValidateW4A16Pack, &Backend::W4A16Pack);
    PackedWeightInfo packed = PackedWeightInfoOf(a);
    for (auto [buffer, t] : {std::pair<DeviceBuffer*, const Tensor*>{qw_out, &a.qw_packed}, {sc_out, &a.sc_packed}}) {
      buffer->RecordPacked(static_cast<char*>(t->data) - static_cast<char*>(buffer->ptr()), t->numel() * DTypeSize(t->dtype), packed);
      packed.scales = true;  // the second one
    }
    return c.env.Undefined();
  }
  Napi::Value W4A16GemmJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    W4A16GemmArgs a;
    a.x = TensorArg(c, "x");
    a.qw = PackedArg(c, "qw", &a.qw_info);
    a.sc = PackedArg(c, "sc", &a.sc_info);
    a.y = TensorArg(c, "y");
    a.group = Int32(c, "group", 32);
    a.epilogue = ParseEpilogue(c, "w4a16_gemm");
    return Run(c, a, ValidateW4A16Gemm, &Backend::W4A16Gemm);
  }
  Napi::Value GemmJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    GemmArgs a{TensorArg(c, "x"), TensorArg(c, "w"), TensorArg(c, "y")};
    return Run(c, a, ValidateGemm, &Backend::Gemm);
  }
  static Status ValidateMoe(const MoeGemmArgs& a) {
    int64_t e = 0, k = 0;
    return ValidateMoeGemm(a, &e, &k);
  }
  Napi::Value MoeGemmJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    MoeGemmArgs a;
    a.x = TensorArg(c, "x");
    a.w = TensorArg(c, "w", true);  // bf16 experts as stored, instead of packed qw and sc
    if (a.w.present()) {
      a.qw = TensorArg(c, "qw", true);  // read to be refused: w replaces them
      a.sc = TensorArg(c, "sc", true);
    } else {
      a.qw = PackedArg(c, "qw", &a.qw_info);
      a.sc = PackedArg(c, "sc", &a.sc_info);
    }
    a.ids = TensorArg(c, "ids");
    a.weights = TensorArg(c, "weights", true);
    a.y = TensorArg(c, "y");
    a.group = Int32(c, "group", 32);
    a.mode = Choice(c, "moe_gemm", "mode", "gather", {"gather", "sum"}) == "sum" ? MoeMode::kSum : MoeMode::kGather;
    a.min_warp_steps = Int(c, "minWarpSteps", 0, 0);
    a.epilogue = ParseEpilogue(c, "moe_gemm");
    return Run(c, a, ValidateMoe, &Backend::MoeGemm);
  }
  Napi::Value MlaAttentionJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    MlaAttentionArgs a;
    a.q_nope = TensorArg(c, "qNope");
    a.q_pe = TensorArg(c, "qPe");
    a.kv_b = TensorArg(c, "kvB");
    a.cache_c = TensorArg(c, "cacheC");
    a.cache_kpe = TensorArg(c, "cacheKpe");
    a.mask = TensorArg(c, "mask", true);
    a.out = TensorArg(c, "out");
    a.base = Int(c, "base", 0, 0, INT32_MAX);
    a.scale = Num(c, "scale", 0);
    a.base_on_device = TensorArg(c, "baseOnDevice", true);
    return Run(c, a, ValidateMlaAttention, &Backend::MlaAttention);
  }
  Napi::Value EmbeddingJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    EmbeddingArgs a{TensorArg(c, "table"), TensorArg(c, "ids"), TensorArg(c, "out")};
    return Run(c, a, ValidateEmbedding, &Backend::Embedding);
  }
  Napi::Value RmsNormJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    RmsNormArgs a{TensorArg(c, "x"), TensorArg(c, "weight"), TensorArg(c, "out"), Num(c, "eps", 0), TensorArg(c, "residual", true), TensorArg(c, "sum", true), TensorArg(c, "outBf16", true)};
    return Run(c, a, ValidateRmsNorm, &Backend::RmsNorm);
  }
  Napi::Value RopeJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    RopeArgs a;
    a.x = TensorArg(c, "x");
    a.positions = TensorArg(c, "positions");
    a.inv_freq = TensorArg(c, "invFreq");
    a.offset = Int(c, "offset", 0, 0, INT32_MAX);
    a.attention_factor = Num(c, "attentionFactor", 1.0);
    a.interleave = Bool(c, "interleave", true);
    return Run(c, a, ValidateRope, &Backend::Rope);
  }
  Napi::Value GqaAttentionJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    GqaAttentionArgs a;
    a.q = TensorArg(c, "q");
    a.k_cache = TensorArg(c, "kCache");
    a.v_cache = TensorArg(c, "vCache");
    a.k = TensorArg(c, "k");
    a.v = TensorArg(c, "v");
    a.out = TensorArg(c, "out");
    a.context_length_on_device = TensorArg(c, "contextLengthOnDevice", true);
    a.context_length = Int(c, "contextLength", 0, 0, INT32_MAX);
    a.scale = Num(c, "scale", 0);
    return Run(c, a, ValidateGqaAttention, &Backend::GqaAttention);
  }
  Napi::Value SiluMulJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    SiluMulArgs a{TensorArg(c, "x"), TensorArg(c, "out")};
    return Run(c, a, ValidateSiluMul, &Backend::SiluMul);
  }
  Napi::Value AddJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    AddArgs a{TensorArg(c, "a"), TensorArg(c, "b"), TensorArg(c, "out")};
    return Run(c, a, ValidateAdd, &Backend::Add);
  }
  Napi::Value RouterJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    RouterArgs a;
    a.logits = TensorArg(c, "logits");
    a.bias = TensorArg(c, "bias");
    a.ids = TensorArg(c, "ids");
    a.weights = TensorArg(c, "weights");
    a.topk = Int32(c, "topk", 8, 1);
    a.n_group = Int32(c, "nGroup", 1, 1);
    a.topk_group = Int32(c, "topkGroup", 1, 1);
    a.norm_topk_prob = Bool(c, "normTopkProb", true);
    a.scaling = Num(c, "scaling", 1.0);
    return Run(c, a, ValidateRouter, &Backend::Router);
  }
  Napi::Value ArgmaxJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    ArgmaxArgs a{TensorArg(c, "x"), TensorArg(c, "out")};
    return Run(c, a, ValidateArgmax, &Backend::Argmax);
  }
  Napi::Value TopkJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    TopkArgs a{TensorArg(c, "x"), TensorArg(c, "values"), TensorArg(c, "ids"), Int32(c, "k", 1, 1)};
    return Run(c, a, ValidateTopk, &Backend::Topk);
  }
  Napi::Value KvWriteJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    KvWriteArgs a{TensorArg(c, "c"), TensorArg(c, "kpe"), TensorArg(c, "cacheC"), TensorArg(c, "cacheKpe"), TensorArg(c, "slots")};
    return Run(c, a, ValidateKvWrite, &Backend::KvWrite);
  }
  Napi::Value MlaInputsJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    MlaInputsArgs a;
    a.x = TensorArg(c, "x");
    a.q_a_norm = TensorArg(c, "qANorm", true);
    a.q_a_out = TensorArg(c, "qAOut", true);
    a.kv_a_norm = TensorArg(c, "kvANorm");
    a.cache_c = TensorArg(c, "cacheC");
    a.cache_kpe = TensorArg(c, "cacheKpe");
    a.slots = TensorArg(c, "slots");
    a.positions = TensorArg(c, "positions");
    a.inv_freq = TensorArg(c, "invFreq");
    a.eps = Num(c, "eps", 0);
    a.attention_factor = Num(c, "attentionFactor", 1.0);
    a.interleave = Bool(c, "interleave", true);
    return Run(c, a, ValidateMlaInputs, &Backend::MlaInputs);
  }
  Napi::Value MlaQueryJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    MlaQueryArgs a;
    a.x = TensorArg(c, "x");
    a.q_nope = TensorArg(c, "qNope");
    a.q_pe = TensorArg(c, "qPe");
    a.positions = TensorArg(c, "positions");
    a.inv_freq = TensorArg(c, "invFreq");
    a.attention_factor = Num(c, "attentionFactor", 1.0);
    a.interleave = Bool(c, "interleave", true);
    return Run(c, a, ValidateMlaQuery, &Backend::MlaQuery);
  }
  Napi::Value DdtreeBuildJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    DdtreeBuildArgs a;
    a.draft_logits = TensorArg(c, "draftLogits");
    a.root = Int32(c, "root", 0, 0);
    a.budget = Int32(c, "budget", 0, 0);
    a.start = Int(c, "start", 0, 0, INT32_MAX);  // the kernels write i32 positions start + depth
    a.tokens = TensorArg(c, "tokens");
    a.parents = TensorArg(c, "parents");
    a.depths = TensorArg(c, "depths");
    a.positions = TensorArg(c, "positions");
    a.mask = TensorArg(c, "mask");
    a.size = TensorArg(c, "size");
    a.root_on_device = TensorArg(c, "rootOnDevice", true);
    a.start_on_device = TensorArg(c, "startOnDevice", true);
    a.log_probs = TensorArg(c, "logProbs", true);
    return Run(c, a, ValidateDdtreeBuild, &Backend::DdtreeBuild);
  }
  Napi::Value DdtreeAcceptJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    DdtreeAcceptArgs a{TensorArg(c, "tokens"), TensorArg(c, "parents"), TensorArg(c, "size"), TensorArg(c, "targetArgmax"), TensorArg(c, "path"), TensorArg(c, "pathLen"), TensorArg(c, "bonus")};
    return Run(c, a, ValidateDdtreeAccept, &Backend::DdtreeAccept);
  }
  Napi::Value KvCommitJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    Napi::Env env = c.env;
    KvCommitArgs a;
    Napi::Value caches = c.args.Get("caches");
    if (!caches.IsArray()) Throw(env, Code::kInvalidArgument, "kv_commit: caches must be an array of tensors, got " + Describe(caches));
    Napi::Array arr = caches.As<Napi::Array>();
    const uint32_t count = arr.Length();
    for (uint32_t i = 0; i < count; ++i) a.caches.push_back(ParseTensor(c, arr.Get(i), [i] { return "caches[" + std::to_string(i) + "]"; }, false));
    a.path = TensorArg(c, "path");
    a.path_len = TensorArg(c, "pathLen");
    a.start = Int(c, "start", 0, 0, INT32_MAX);  // next_start is written as an i32
    a.start_on_device = TensorArg(c, "startOnDevice", true);
    a.next_start = TensorArg(c, "nextStart", true);
    return Run(c, a, ValidateKvCommit, &Backend::KvCommit);
  }
  Napi::Value ArangeJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    ArangeArgs a{TensorArg(c, "startOnDevice", true), TensorArg(c, "out"), Int(c, "start", 0, INT32_MIN, INT32_MAX)};
    return Run(c, a, ValidateArange, &Backend::Arange);
  }

  // NCCL communicators (cuda only). Arguments are read and checked first, on every backend, so a
  // bad call fails the same way everywhere; then a backend without NCCL says so.
  struct NcclComm {
    void* ptr = nullptr;
    int world = 0, rank = 0;
#ifdef KDTREE_WITH_CUDA
    std::shared_ptr<nccl::Watchdog> watchdog;
#endif
  };
  void NcclAvailable(Napi::Env env, const char* op) {
#ifdef KDTREE_WITH_CUDA
    if (std::string_view(be().kind()) == "cuda") return;
    Throw(env, Code::kUnsupported, std::string(op) + ": NCCL needs the cuda backend; this is the " + be().kind() + " backend (cpu ranks use the shared-memory transport)");
#else
    Throw(env, Code::kUnsupported, std::string(op) + ": this is the cpu variant of the kdtree addon; NCCL needs the cuda variant (kdtree_cuda.node) and libnccl.so.2");
#endif
  }
  int CommId(Call& c, const char* op) {
    const Napi::Value v = c.args.Get("comm");
    if (v.IsUndefined()) Throw(c.env, Code::kInvalidArgument, std::string(op) + ": comm is required (a communicator from ncclInit())");
    return ParseInt32(c.env, v, "comm", 1);
  }
  // A live communicator; one its watchdog aborted throws the watchdog's reason (it names the rank).
  NcclComm& CommOf(Napi::Env env, int id, const char* op, bool aborted_ok = false) {
    auto it = comms_.find(id);
    if (it == comms_.end()) Throw(env, Code::kInvalidArgument, std::string(op) + ": comm " + std::to_string(id) + " is not a live communicator of this backend (ncclInit() makes one; ncclAbort/ncclDestroy end it)");
#ifdef KDTREE_WITH_CUDA
    if (!aborted_ok && it->second.watchdog->fired()) Throw(env, Code::kDeviceError, std::string(op) + ": " + it->second.watchdog->reason());
#endif
    return it->second;
  }
  // The NCCL data type of a tensor (every kdtree dtype has one).
  static int NcclType(const Tensor& t) {
    int type = -1;
#ifdef KDTREE_WITH_CUDA
    nccl::DataType(t.dtype, &type);
#endif
    return type;
  }
  void CheckFits(Napi::Env env, const char* op, const Tensor& t) {
    const int64_t need = t.numel() * DTypeSize(t.dtype);
    if (need > t.bytes) Throw(env, Code::kInvalidArgument, std::string(op) + ": " + t.Describe() + " needs " + std::to_string(need) + " bytes; its buffer holds " + std::to_string(t.bytes) + " from its offset");
  }
  // ncclInit({world, rank, id}) -> comm: ncclCommInitRank on this backend's device. `id` is the
  // 128 bytes of ncclUniqueId() from rank 0; the call blocks until all `world` ranks have joined.
  Napi::Value NcclInitJs(const Napi::CallbackInfo& info) {
    Call c{info.Env(), ArgsObject(info), {}};
    Napi::Env env = c.env;
    const int world = Int32(c, "world", 0, 1);
    if (world < 1) Throw(env, Code::kInvalidArgument, "ncclInit: world is required (an integer >= 1)");
    const Napi::Value rank_v = c.args.Get("rank");
    if (rank_v.IsUndefined()) Throw(env, Code::kInvalidArgument, "ncclInit: rank is required (an integer in [0, world))");
    const int rank = ParseInt32(env, rank_v, "rank", 0);
    if (rank >= world) Throw(env, Code::kInvalidArgument, "ncclInit: rank " + std::to_string(rank) + " is not in [0, " + std::to_string(world) + ")");
    const Napi::Value id_v = c.args.Get("id");
    if (!id_v.IsTypedArray() || id_v.As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array) Throw(env, Code::kInvalidArgument, "ncclInit: id must be a Uint8Array of 128 bytes (ncclUniqueId() on rank 0), got " + Describe(id_v));
    Napi::Uint8Array id_bytes = id_v.As<Napi::Uint8Array>();
    if (id_bytes.ElementLength() != 128) Throw(env, Code::kInvalidArgument, "ncclInit: id must be 128 bytes (an ncclUniqueId), got " + std::to_string(id_bytes.ElementLength()));
    [[maybe_unused]] const int interval_ms = Int32(c, "watchdogMs", 50, 1);
    NcclAvailable(env, "ncclInit");
#ifdef KDTREE_WITH_CUDA
    nccl::UniqueId id;
    std::memcpy(id.internal, id_bytes.Data(), sizeof(id.internal));
    void* unused = nullptr;
    Check(env, be().NativeStream(0, &unused));  // the backend's device is current for the init
    NcclComm comm{nullptr, world, rank, nullptr};
    Check(env, nccl::CommInitRank(&comm.ptr, world, id, rank));
    comm.watchdog = std::make_shared<nccl::Watchdog>(comm.ptr, rank, world, interval_ms);
    const int handle = next_comm_++;
    comms_[handle] = comm;
    return Napi::Number::New(env, handle);
#else
    return env.Undefined();
#endif
  }
  // ncclAllReduce({comm, send, recv, stream}): recv = the sum over ranks of send (same dtype and
  // size; send === recv is in place), queued on the stream (and captured with it).
  Napi::Value NcclAllReduceJs(const Napi::CallbackInfo& info) { return NcclCollectiveJs(info, "ncclAllReduce"); }
  // ncclAllGather({comm, send, recv, stream}): recv = every rank's send, rank r's at r * size(send).
  Napi::Value NcclAllGatherJs(const Napi::CallbackInfo& info) { return NcclCollectiveJs(info, "ncclAllGather"); }
  // ncclBroadcast({comm, send, recv, root, stream}): recv on every rank = send on rank `root`.
  Napi::Value NcclBroadcastJs(const Napi::CallbackInfo& info) { return NcclCollectiveJs(info, "ncclBroadcast"); }
  Napi::Value NcclCollectiveJs(const Napi::CallbackInfo& info, const char* op) {
    Call c{info.Env(), ArgsObject(info), {}};
    Napi::Env env = c.env;
    const std::string_view name(op);
    const int id = CommId(c, op);
    const Tensor send = TensorArg(c, "send");
    const Tensor recv = TensorArg(c, "recv");
    const int root = name == "ncclBroadcast" ? Int32(c, "root", -1, 0) : 0;
    if (root < 0) Throw(env, Code::kInvalidArgument, "ncclBroadcast: root is required (the rank whose send every rank receives)");
    const int stream = StreamArg(c);
    if (send.dtype != recv.dtype) Throw(env, Code::kInvalidArgument, std::string(op) + ": send and recv must have one dtype, got " + send.Describe() + " and " + recv.Describe());
    CheckFits(env, op, send);
    CheckFits(env, op, recv);
    if (name != "ncclAllGather" && send.numel() != recv.numel()) Throw(env, Code::kInvalidArgument, std::string(op) + ": send and recv must hold as many values, got " + send.Describe() + " and " + recv.Describe());
    if (name == "ncclAllReduce" && send.dtype != DType::kF32 && send.dtype != DType::kBF16 && send.dtype != DType::kF16 && send.dtype != DType::kF64) Throw(env, Code::kInvalidArgument, "ncclAllReduce: a sum needs a float tensor (f32, bf16, f16, f64), got " + send.Describe());
    Check(env, be().CheckStream(stream));
    NcclAvailable(env, op);
    const NcclComm& comm = CommOf(env, id, op);
    if (name == "ncclAllGather" && recv.numel() != send.numel() * comm.world) Throw(env, Code::kInvalidArgument, "ncclAllGather: recv must hold world (" + std::to_string(comm.world) + ") x send's values, got " + send.Describe() + " and " + recv.Describe());
    if (root >= comm.world) Throw(env, Code::kInvalidArgument, "ncclBroadcast: root " + std::to_string(root) + " is not a rank of the communicator's " + std::to_string(comm.world));
#ifdef KDTREE_WITH_CUDA
    Backend* backend = &be();
    const size_t count = static_cast<size_t>(send.numel());
    const int type = NcclType(send);
    const void* from = send.data;
    void* to = recv.data;
    void* ptr = comm.ptr;
    Queue(env, c.buffers, stream, [=](int s) {
      void* native = nullptr;
      KDTREE_RETURN_IF_ERROR(backend->NativeStream(s, &native));
      if (name == "ncclAllReduce") return nccl::AllReduceSum(from, to, count, type, ptr, native);
      if (name == "ncclAllGather") return nccl::AllGather(from, to, count, type, ptr, native);
      return nccl::Broadcast(from, to, count, type, root, ptr, native);
    });
#endif
    return env.Undefined();
  }
  // ncclAsyncError(comm) -> {result, message}: 0 ok, 7 in progress, else failed (message says how).
  Napi::Value NcclAsyncErrorJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int id = ParseInt32(env, info.Length() > 0 ? info[0] : env.Undefined(), "comm", 1);
    NcclAvailable(env, "ncclAsyncError");
    [[maybe_unused]] const NcclComm& comm = CommOf(env, id, "ncclAsyncError", true);
    Napi::Object o = Napi::Object::New(env);
#ifdef KDTREE_WITH_CUDA
    int result = 0;
    std::string message;
    const bool aborted = comm.watchdog->fired();
    if (aborted) message = comm.watchdog->reason();
    else Check(env, nccl::AsyncError(comm.ptr, &result, &message));
    o.Set("result", result);
    o.Set("message", message);
    o.Set("aborted", aborted);
#endif
    return o;
  }
  // ncclArm(comm, ms): the watchdog aborts the communicator unless disarmed (ms = 0) within `ms`.
  Napi::Value NcclArmJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int id = ParseInt32(env, info.Length() > 0 ? info[0] : env.Undefined(), "comm", 1);
    [[maybe_unused]] const int64_t ms = ParseInt(env, info.Length() > 1 ? info[1] : env.Undefined(), "ms", 0, INT32_MAX);
    NcclAvailable(env, "ncclArm");
    [[maybe_unused]] const NcclComm& comm = CommOf(env, id, "ncclArm", true);
#ifdef KDTREE_WITH_CUDA
    if (ms == 0) comm.watchdog->Disarm();
    else comm.watchdog->Arm(ms);
#endif
    return env.Undefined();
  }
  // ncclAbort(comm): ends the communicator at once, unblocking its queued collectives.
  Napi::Value NcclAbortJs(const Napi::CallbackInfo& info) { return NcclEndJs(info, "ncclAbort"); }
  // ncclDestroy(comm): ends it after its queued collectives (every rank must reach them).
  Napi::Value NcclDestroyJs(const Napi::CallbackInfo& info) { return NcclEndJs(info, "ncclDestroy"); }
  Napi::Value NcclEndJs(const Napi::CallbackInfo& info, const char* op) {
    Napi::Env env = info.Env();
    const int id = ParseInt32(env, info.Length() > 0 ? info[0] : env.Undefined(), "comm", 1);
    NcclAvailable(env, op);
    NcclComm comm = CommOf(env, id, op, true);
    comms_.erase(id);
#ifdef KDTREE_WITH_CUDA
    comm.watchdog->Stop();  // first: until its thread has stopped it may abort the communicator
    if (comm.watchdog->fired()) return env.Undefined();  // it did: nothing is left to end
    Check(env, std::string_view(op) == "ncclAbort" ? nccl::CommAbort(comm.ptr) : nccl::CommDestroy(comm.ptr));
#else
    (void)comm;
#endif
    return env.Undefined();
  }

  std::shared_ptr<BackendHandle> handle_;
  std::map<int, Capture> captures_;  // capturing stream -> its capture
  std::map<int, NcclComm> comms_;     // ncclInit's communicators by handle
  int next_comm_ = 1;
};

// createBackend(kind: 'cpu' | 'cuda', device = 0)
Napi::Value CreateBackend(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const std::string kind = info.Length() > 0 && info[0].IsString() ? info[0].As<Napi::String>().Utf8Value() : "";
  std::unique_ptr<Backend> backend;
  if (kind == "cpu") {
    backend = MakeCpuBackend();
  } else if (kind == "cuda") {
#ifdef KDTREE_WITH_CUDA
    const int device = info.Length() > 1 && !info[1].IsUndefined() ? ParseInt32(env, info[1], "device", 0) : 0;
    Check(env, MakeCudaBackend(device, &backend));
#else
    Throw(env, Code::kUnsupported, "this is the cpu variant of the kdtree addon; it has no cuda backend");
#endif
  } else {
    Throw(env, Code::kInvalidArgument, "createBackend(kind): kind must be 'cpu' or 'cuda'");
  }
  // The forced kernel forms are read from the environment here, once: no op reads it.
  const char* gemm_env = std::getenv("KDTREE_GEMM_FORM");
  const char* prefill_env = std::getenv("KDTREE_W4A16_PREFILL");
  const std::string gemm = gemm_env ? gemm_env : "", prefill = prefill_env ? prefill_env : "";
  Status forced = backend->SetForcedForms(gemm.c_str(), prefill.c_str());
  if (!forced.ok()) Throw(env, forced.code, "createBackend('" + kind + "'): " + forced.message + " (from the environment)");
  AddonData& data = Data(env);
  Napi::Object obj = data.backend.New({Token(env)});
  NativeBackend::Unwrap(obj)->Attach(std::move(backend), data.next_backend_id++, gemm, prefill);
  if (napi_type_tag_object(env, obj, BackendTag()) != napi_ok) Throw(env, Code::kDeviceError, "createBackend: could not tag the new backend");
  return obj;
}

// dispatchPolicy({op, m, n, k, sms, sm90a, ...}) -> the plan the cuda backend's GEMMs follow for
// that call on that device (dispatch_policy.h), on every variant: the rules are plain C++, so the
// cpu build's tests pin them. Throws what the call would throw where a forced form cannot run it.
Napi::Value DispatchPolicyJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsObject()) Throw(env, Code::kInvalidArgument, "dispatchPolicy: expected one query object, got " + (info.Length() < 1 ? std::string("nothing") : Describe(info[0])));
  Napi::Object q = info[0].As<Napi::Object>();
  const auto int_of = [&](const char* key, int fallback, int min) {
    const Napi::Value v = q.Get(key);
    return v.IsUndefined() ? fallback : ParseInt32(env, v, std::string("dispatchPolicy: ") + key, min);
  };
  const auto string_of = [&](const char* key, const char* fallback) {
    const Napi::Value v = q.Get(key);
    if (v.IsUndefined() || v.IsNull()) return std::string(fallback);
    if (!v.IsString()) Throw(env, Code::kInvalidArgument, std::string("dispatchPolicy: ") + key + " must be a string, got " + Describe(v));
    return v.As<Napi::String>().Utf8Value();
  };
  const std::string op = string_of("op", "");
  policy::Device device{int_of("sms", 0, 1), q.Get("sm90a").ToBoolean().Value()};
  const Napi::Value dtype = q.Get("xDtype");
  const DType x = dtype.IsUndefined() ? DType::kBF16 : ParseDType(env, dtype, "dispatchPolicy: x");
  if (x != DType::kBF16 && x != DType::kF16 && x != DType::kF32) Throw(env, Code::kInvalidArgument, "dispatchPolicy: xDtype must be bf16, f16 or f32");
  const int m = int_of("m", 0, 1), n = int_of("n", 0, 1), k = int_of("k", 0, 1);
  Napi::Object plan = Napi::Object::New(env);
  if (op == "gemm") {
    policy::GemmForm forced;
    Check(env, policy::ParseGemmForm(string_of("gemmForm", "").c_str(), &forced));
    policy::GemmCall c;
    c.m = m;
    c.n = n;
    c.k = k;
    c.x = x;
    c.warps_per_sm = int_of("warpsPerSm", c.warps_per_sm, 1);
    policy::GemmPlan p;
    Check(env, policy::PlanGemm(c, device, forced, &p));
    plan.Set("form", policy::GemmFormName(p.form));
    plan.Set("nt", p.nt);
    plan.Set("ranges", p.ranges);
    plan.Set("rangeChunks", p.range_chunks);
    plan.Set("loadAhead", p.load_ahead);
    return plan;
  }
  if (op == "ddtreeBuild") {  // m: depth, n: vocabulary, k: budget
    plan.Set("form", policy::DdtreeBuildFormName(policy::PlanDdtreeBuild(k, m, n)));
    return plan;
  }
  if (op != "w4a16Gemm" && op != "moeGemm") Throw(env, Code::kInvalidArgument, "dispatchPolicy: op must be 'gemm', 'w4a16Gemm', 'moeGemm' or 'ddtreeBuild', got '" + op + "'");
  policy::PrefillOverride prefill;
  Check(env, policy::ParsePrefillOverride(string_of("w4a16Prefill", "").c_str(), &prefill));
  policy::W4A16Call c;
  c.tokens = m;
  c.n = n;
  c.k = k;
  c.group = int_of("group", 32, 1);
  c.x = x;
  const std::string scales = string_of("scales", "bf16");
  if (scales != "bf16" && scales != "f32") Throw(env, Code::kInvalidArgument, "dispatchPolicy: scales must be bf16 or f32, got '" + scales + "'");
  c.sc_f32 = scales == "f32";
  c.moe = op == "moeGemm";
  c.experts = int_of("experts", 1, 1);
  c.topk = int_of("topk", 1, 1);
  c.min_warp_steps = int_of("minWarpSteps", 0, 0);
  policy::W4A16Plan p;
  Check(env, policy::PlanW4A16(c, device, prefill, &p));
  plan.Set("form", policy::W4A16FormName(p));
  plan.Set("nt", p.nt);
  plan.Set("tileTokens", p.tile_tokens);
  plan.Set("rows", p.rows);
  plan.Set("routed", p.route);
  plan.Set("stagesX", p.stages_x);
  plan.Set("blocks", p.ranges.blocks);
  plan.Set("stepsPerWarp", p.ranges.steps_per_warp);
  return plan;
}
// ncclVersion() -> e.g. 22703 (NCCL 2.27.3); ncclUniqueId() -> Uint8Array(128) for ncclInit's id.
// Both load libnccl.so.2 on first use; the cpu variant has no NCCL.
#ifdef KDTREE_WITH_CUDA
Napi::Value NcclVersion(const Napi::CallbackInfo& info) {
  int version = 0;
  Check(info.Env(), nccl::Version(&version));
  return Napi::Number::New(info.Env(), version);
}
Napi::Value NcclUniqueId(const Napi::CallbackInfo& info) {
  nccl::UniqueId id;
  Check(info.Env(), nccl::GetUniqueId(&id));
  Napi::Uint8Array out = Napi::Uint8Array::New(info.Env(), sizeof(id.internal));
  std::memcpy(out.Data(), id.internal, sizeof(id.internal));
  return out;
}
#else
Napi::Value NcclVersion(const Napi::CallbackInfo& info) { Throw(info.Env(), Code::kUnsupported, "ncclVersion: this is the cpu variant of the kdtree addon; NCCL needs the cuda variant (kdtree_cuda.node) and libnccl.so.2"); }
Napi::Value NcclUniqueId(const Napi::CallbackInfo& info) { Throw(info.Env(), Code::kUnsupported, "ncclUniqueId: this is the cpu variant of the kdtree addon; NCCL needs the cuda variant (kdtree_cuda.node) and libnccl.so.2"); }
#endif

#ifdef KDTREE_WITH_CUDA
// cudaProbe(): {ok, error, driverVersion, runtimeVersion, deviceCount, devices: [{name, computeCapability, ...}]}
Napi::Value CudaProbe(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CudaProbeResult r = ProbeCuda();
  Napi::Object o = Napi::Object::New(env);
  o.Set("ok", r.ok);
  o.Set("error", r.error);
  o.Set("driverVersion", r.driver_version);
  o.Set("runtimeVersion", r.runtime_version);
  o.Set("deviceCount", r.device_count);
  Napi::Array devices = Napi::Array::New(env, r.devices.size());
  for (size_t i = 0; i < r.devices.size(); ++i) {
    Napi::Object d = Napi::Object::New(env);
    d.Set("name", r.devices[i].name);
    d.Set("computeCapability", std::to_string(r.devices[i].compute_major) + "." + std::to_string(r.devices[i].compute_minor));
    d.Set("multiprocessors", r.devices[i].multiprocessors);
    d.Set("totalMemory", static_cast<double>(r.devices[i].total_memory));
    devices.Set(static_cast<uint32_t>(i), d);
  }
  o.Set("devices", devices);
  return o;
}
#endif

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  auto* data = new AddonData;
  env.SetInstanceData(data);  // deleted when the environment is torn down (a worker's exit)
  data->buffer = Napi::Persistent(DeviceBuffer::Init(env));
  data->graph = Napi::Persistent(Graph::Init(env));
  data->backend = Napi::Persistent(NativeBackend::Init(env));
  exports.Set("createBackend", Napi::Function::New(env, CreateBackend));
  exports.Set("dispatchPolicy", Napi::Function::New(env, DispatchPolicyJs));
  exports.Set("ncclVersion", Napi::Function::New(env, NcclVersion));
  exports.Set("ncclUniqueId", Napi::Function::New(env, NcclUniqueId));
  Napi::Object build = Napi::Object::New(env);
  build.Set("version", KDTREE_VERSION);
  build.Set("variant", KDTREE_VARIANT);
  build.Set("cudaArchitectures", KDTREE_CUDA_ARCHS);
  build.Set("napiVersion", NAPI_VERSION);
  exports.Set("build", build);
#ifdef KDTREE_WITH_CUDA
  exports.Set("cudaProbe", Napi::Function::New(env, CudaProbe));
#endif
  return exports;
}

}  // namespace
}  // namespace kdtree

static Napi::Object InitKdtreeAddon(Napi::Env env, Napi::Object exports) { return kdtree::Init(env, exports); }
NODE_API_MODULE(kdtree, InitKdtreeAddon)
