// The Node-API binding: backends, device buffers and every op. Arguments from JavaScript are
// checked here (types, buffer liveness, ownership, offsets) and by validate.cc (dtypes, shapes)
// before any kernel runs; every failure becomes a JS Error with a `code`, never a crash.
#include <napi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "../common/validate.h"
#include "kdtree/backend.h"

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

[[noreturn]] void Throw(Napi::Env env, Code code, const std::string& message) {
  Napi::Error e = Napi::Error::New(env, message);
  e.Set("code", Napi::String::New(env, CodeName(code)));
  throw e;
}

void Check(Napi::Env env, const Status& s) {
  if (!s.ok()) Throw(env, s.code, s.message);
}

struct BackendHandle {
  std::unique_ptr<Backend> backend;
  int id;
};

class DeviceBuffer : public Napi::ObjectWrap<DeviceBuffer> {
 public:
  static Napi::FunctionReference* constructor;
  static Napi::Function Init(Napi::Env env) {
    Napi::Function f = DefineClass(env, "DeviceBuffer", {
      InstanceAccessor<&DeviceBuffer::Bytes>("bytes"),
      InstanceAccessor<&DeviceBuffer::Freed>("freed"),
      InstanceAccessor<&DeviceBuffer::Kind>("backend"),
    });
    constructor = new Napi::FunctionReference(Napi::Persistent(f));
    return f;
  }
  explicit DeviceBuffer(const Napi::CallbackInfo& info) : Napi::ObjectWrap<DeviceBuffer>(info) {}
  ~DeviceBuffer() override { Release(); }

  void Attach(std::shared_ptr<BackendHandle> owner, void* ptr, size_t bytes) {
    owner_ = std::move(owner);
    ptr_ = ptr;
    bytes_ = bytes;
  }
  void Release() {
    if (ptr_ != nullptr && owner_) owner_->backend->Free(ptr_);
    ptr_ = nullptr;
  }
  bool freed() const { return ptr_ == nullptr; }
  void* ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  const BackendHandle* owner() const { return owner_.get(); }

 private:
  Napi::Value Bytes(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), static_cast<double>(bytes_)); }
  Napi::Value Freed(const Napi::CallbackInfo& info) { return Napi::Boolean::New(info.Env(), freed()); }
  Napi::Value Kind(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), owner_ ? owner_->backend->kind() : "none"); }
  std::shared_ptr<BackendHandle> owner_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};
Napi::FunctionReference* DeviceBuffer::constructor = nullptr;

// Marks the DeviceBuffer objects that this copy of the addon's alloc() made. Checking the tag is
// cheaper than instanceof, which walks the prototype chain for every tensor of every call. The tag
// holds the address of a static of this copy: a process may load the cpu and the cuda variant side
// by side, and each must reject the other's buffers without reading them as its own.
const napi_type_tag* DeviceBufferTag() {
  static const napi_type_tag tag = {reinterpret_cast<uintptr_t>(&tag) ^ 0x6b64747262756621ull, 0x9e3779b97f4a7c15ull};
  return &tag;
}

// A captured graph (Backend::BeginCapture): its id in the backend, and references to every buffer
// its ops read or write, which keep them from being collected while it lives.
class Graph : public Napi::ObjectWrap<Graph> {
 public:
  static Napi::FunctionReference* constructor;
  static Napi::Function Init(Napi::Env env) {
    Napi::Function f = DefineClass(env, "Graph", {
      InstanceAccessor<&Graph::Calls>("calls"),
      InstanceAccessor<&Graph::Freed>("freed"),
      InstanceAccessor<&Graph::Kind>("backend"),
    });
    constructor = new Napi::FunctionReference(Napi::Persistent(f));
    return f;
  }
  explicit Graph(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Graph>(info) {}
  ~Graph() override { Release(); }

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
Napi::FunctionReference* Graph::constructor = nullptr;

const napi_type_tag* GraphTag() {
  static const napi_type_tag tag = {reinterpret_cast<uintptr_t>(&tag) ^ 0x6b64747267726170ull, 0x7f4a7c159e3779b9ull};
  return &tag;
}

int next_backend_id = 1;

// Argument names are C strings, or for parts of a tensor a callable that builds one: messages are
// only written for failures, while every op parses several tensors per call (building each name
// up front cost ~1 us per tensor of every call).
inline std::string NameOf(const char* name) { return name; }
template <typename Build>
std::string NameOf(const Build& build) {
  return build();
}

DType ParseDType(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsString()) Throw(env, Code::kInvalidArgument, std::string(what) + ".dtype must be a string (f32, f16, bf16, i32, u8, f64)");
  char s[8];  // every dtype name fits; a longer string arrives cut and matches none
  size_t length = 0;
  if (napi_get_value_string_utf8(env, v, s, sizeof(s), &length) != napi_ok) Throw(env, Code::kInvalidArgument, std::string(what) + ".dtype could not be read");
  const std::string_view name(s, length);
  if (name == "f32") return DType::kF32;
  if (name == "f16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  if (name == "i32") return DType::kI32;
  if (name == "u8") return DType::kU8;
  if (name == "f64") return DType::kF64;
  Throw(env, Code::kInvalidArgument, std::string(what) + ".dtype '" + v.As<Napi::String>().Utf8Value() + "' is not one of f32, f16, bf16, i32, u8, f64");
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

// The largest integer a double holds exactly (Number.MAX_SAFE_INTEGER): byte counts and offsets.
constexpr int64_t kMaxSafeInteger = 9007199254740991;

// An integer argument in [min, max]. Values the native side keeps in an int (streams, events,
// group sizes, k) take max = INT32_MAX, so that 2^32 + 1 is an error instead of wrapping to 1.
template <typename Name>
int64_t ParseInt(Napi::Env env, const Napi::Value& v, const Name& what, int64_t min = INT64_MIN, int64_t max = kMaxSafeInteger) {
  if (!v.IsNumber()) Throw(env, Code::kInvalidArgument, NameOf(what) + " must be a number");
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

class NativeBackend : public Napi::ObjectWrap<NativeBackend> {
 public:
  static Napi::FunctionReference* constructor;
  static Napi::Function Init(Napi::Env env) {
    Napi::Function f = DefineClass(env, "NativeBackend", {
      InstanceAccessor<&NativeBackend::Kind>("kind"),
      InstanceMethod<&NativeBackend::Info>("info"),
      InstanceMethod<&NativeBackend::AllocJs>("alloc"),
      InstanceMethod<&NativeBackend::FreeJs>("free"),
      InstanceMethod<&NativeBackend::Upload>("upload"),
      InstanceMethod<&NativeBackend::Download>("download"),
      InstanceMethod<&NativeBackend::CopyJs>("copy"),
      InstanceMethod<&NativeBackend::FillJs>("fill"),
      InstanceMethod<&NativeBackend::HoldJs>("hold"),
      InstanceMethod<&NativeBackend::CreateStreamJs>("createStream"),
      InstanceMethod<&NativeBackend::DestroyStreamJs>("destroyStream"),
      InstanceMethod<&NativeBackend::SynchronizeJs>("synchronize"),
      InstanceMethod<&NativeBackend::CreateEventJs>("createEvent"),
      InstanceMethod<&NativeBackend::DestroyEventJs>("destroyEvent"),
      InstanceMethod<&NativeBackend::RecordEventJs>("recordEvent"),
      InstanceMethod<&NativeBackend::ElapsedJs>("elapsedMs"),
      InstanceMethod<&NativeBackend::BeginCaptureJs>("beginCapture"),
      InstanceMethod<&NativeBackend::EndCaptureJs>("endCapture"),
      InstanceMethod<&NativeBackend::LaunchGraphJs>("launchGraph"),
      InstanceMethod<&NativeBackend::FreeGraphJs>("freeGraph"),
      InstanceMethod<&NativeBackend::W4A16PackJs>("w4a16Pack"),
      InstanceMethod<&NativeBackend::W4A16GemmJs>("w4a16Gemm"),
      InstanceMethod<&NativeBackend::GemmJs>("gemm"),
      InstanceMethod<&NativeBackend::MoeGemmJs>("moeGemm"),
      InstanceMethod<&NativeBackend::MlaAttentionJs>("mlaAttention"),
      InstanceMethod<&NativeBackend::EmbeddingJs>("embedding"),
      InstanceMethod<&NativeBackend::RmsNormJs>("rmsNorm"),
      InstanceMethod<&NativeBackend::RopeJs>("rope"),
      InstanceMethod<&NativeBackend::SiluMulJs>("siluMul"),
      InstanceMethod<&NativeBackend::AddJs>("add"),
      InstanceMethod<&NativeBackend::RouterJs>("router"),
      InstanceMethod<&NativeBackend::ArgmaxJs>("argmax"),
      InstanceMethod<&NativeBackend::TopkJs>("topk"),
      InstanceMethod<&NativeBackend::KvWriteJs>("kvWrite"),
      InstanceMethod<&NativeBackend::DdtreeBuildJs>("ddtreeBuild"),
      InstanceMethod<&NativeBackend::DdtreeAcceptJs>("ddtreeAccept"),
      InstanceMethod<&NativeBackend::KvCommitJs>("kvCommit"),
      InstanceMethod<&NativeBackend::ArangeJs>("arange"),
    });
    constructor = new Napi::FunctionReference(Napi::Persistent(f));
    return f;
  }
  explicit NativeBackend(const Napi::CallbackInfo& info) : Napi::ObjectWrap<NativeBackend>(info) {}
  void Attach(std::unique_ptr<Backend> b) { handle_ = std::make_shared<BackendHandle>(BackendHandle{std::move(b), next_backend_id++}); }

 private:
  Backend& be() { return *handle_->backend; }

  template <typename Name>
  DeviceBuffer* Buf(Napi::Env env, const Napi::Value& v, const Name& what) {
    bool tagged = false;
    if (v.IsObject() && napi_check_object_type_tag(env, v, DeviceBufferTag(), &tagged) != napi_ok) tagged = false;
    if (!tagged) Throw(env, Code::kInvalidArgument, NameOf(what) + " must be a DeviceBuffer from alloc()");
    DeviceBuffer* b = DeviceBuffer::Unwrap(v.As<Napi::Object>());
    if (b->freed()) Throw(env, Code::kInvalidArgument, NameOf(what) + ": use of a freed buffer");
    if (b->owner() != handle_.get()) {
      Throw(env, Code::kInvalidArgument, NameOf(what) + ": buffer belongs to another backend (" + std::string(b->owner()->backend->kind()) + " #" + std::to_string(b->owner()->id) + "), not this " + be().kind() +
                                             " #" + std::to_string(handle_->id));
    }
    if (!captures_.empty()) call_buffers_.emplace_back(b, v);  // the graph keeps them if this call is captured
    return b;
  }

  // {buffer, dtype, shape, offset?} -> Tensor (buffer checked alive and ours; offset in range)
  Tensor ParseTensor(Napi::Env env, const Napi::Object& args, const char* key, bool optional = false) {
    Tensor t;
    t.name = key;
    Napi::Value v = args.Get(key);
    if (v.IsUndefined() || v.IsNull()) {
      if (optional) return t;
      Throw(env, Code::kInvalidArgument, std::string(key) + " is required");
    }
    if (!v.IsObject()) Throw(env, Code::kInvalidArgument, std::string(key) + " must be a tensor {buffer, dtype, shape}");
    Napi::Object o = v.As<Napi::Object>();
    DeviceBuffer* b = Buf(env, o.Get("buffer"), [key] { return std::string(key) + ".buffer"; });
    t.dtype = ParseDType(env, o.Get("dtype"), key);
    Napi::Value shape = o.Get("shape");
    if (!shape.IsArray()) Throw(env, Code::kInvalidArgument, std::string(key) + ".shape must be an array");
    Napi::Array arr = shape.As<Napi::Array>();
    const uint32_t rank = arr.Length();
    if (rank > 8) Throw(env, Code::kInvalidArgument, std::string(key) + ".shape has more than 8 dimensions");
    int64_t numel = 1;
    for (uint32_t i = 0; i < rank; ++i) {
      const int64_t d = ParseInt(env, arr.Get(i), [key, i] { return std::string(key) + ".shape[" + std::to_string(i) + "]"; }, 0);
      t.shape.push_back(d);
      if (d > 0 && numel > (int64_t{1} << 50) / d) Throw(env, Code::kInvalidArgument, std::string(key) + ".shape is too large");
      numel *= d;
    }
    const Napi::Value offset_v = o.Get("offset");
    const int64_t offset = offset_v.IsUndefined() ? 0 : ParseInt(env, offset_v, [key] { return std::string(key) + ".offset"; }, 0);
    if (offset > static_cast<int64_t>(b->bytes())) Throw(env, Code::kInvalidArgument, std::string(key) + ".offset " + std::to_string(offset) + " is past the buffer's " + std::to_string(b->bytes()) + " bytes");
    t.data = static_cast<char*>(b->ptr()) + offset;
    t.bytes = static_cast<int64_t>(b->bytes()) - offset;
    return t;
  }

  // Every op starts here (or in NewCall): the buffers of an earlier call that threw are not this one's.
  Napi::Object Args(const Napi::CallbackInfo& info) {
    NewCall();
    if (info.Length() < 1 || !info[0].IsObject()) Throw(info.Env(), Code::kInvalidArgument, "expected one argument object");
    return info[0].As<Napi::Object>();
  }
  void NewCall() { call_buffers_.clear(); }
  int Stream(Napi::Env env, const Napi::Object& o) {
    const Napi::Value v = o.Get("stream");
    const int s = v.IsUndefined() ? 0 : ParseInt32(env, v, "stream", 0);
    Check(env, be().CheckStream(s));
    return s;
  }
  static bool Given(const Napi::CallbackInfo& info, size_t i) { return info.Length() > i && !info[i].IsUndefined(); }
  double Num(Napi::Env env, const Napi::Object& o, const char* key, double fallback) {
    const Napi::Value v = o.Get(key);
    if (v.IsUndefined()) return fallback;
    if (!v.IsNumber()) Throw(env, Code::kInvalidArgument, std::string(key) + " must be a number");
    return v.As<Napi::Number>().DoubleValue();
  }
  int64_t Int(Napi::Env env, const Napi::Object& o, const char* key, int64_t fallback, int64_t min = INT64_MIN) {
    const Napi::Value v = o.Get(key);
    return v.IsUndefined() ? fallback : ParseInt(env, v, key, min);
  }
  int Int32(Napi::Env env, const Napi::Object& o, const char* key, int fallback, int min = INT32_MIN) {
    const Napi::Value v = o.Get(key);
    return v.IsUndefined() ? fallback : ParseInt32(env, v, key, min);
  }
  bool Bool(const Napi::Object& o, const char* key, bool fallback) {
    const Napi::Value v = o.Get(key);
    return v.IsUndefined() ? fallback : v.ToBoolean();
  }

  static Epilogue ParseEpilogue(Napi::Env env, const Napi::Object& o, const char* op) {
    const Napi::Value given = o.Get("epilogue");
    const std::string v = given.IsUndefined() ? "none" : given.ToString().Utf8Value();
    if (v != "none" && v != "siluMul") Throw(env, Code::kInvalidArgument, std::string(op) + ": epilogue must be 'none' or 'siluMul', got '" + v + "'");
    return v == "siluMul" ? Epilogue::kSiluMul : Epilogue::kNone;
  }

  Napi::Value Kind(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), be().kind()); }
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
    void* ptr = nullptr;
    Check(env, be().Alloc(static_cast<size_t>(std::max<int64_t>(bytes, 1)), &ptr));
    Napi::Object obj = DeviceBuffer::constructor->New({});
    DeviceBuffer::Unwrap(obj)->Attach(handle_, ptr, static_cast<size_t>(bytes));
    if (napi_type_tag_object(env, obj, DeviceBufferTag()) != napi_ok) Throw(env, Code::kDeviceError, "alloc: could not tag the new buffer");
    return obj;
  }
  Napi::Value FreeJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1) Throw(env, Code::kInvalidArgument, "free(buffer): missing buffer");
    Buf(env, info[0], "buffer")->Release();
    return env.Undefined();
  }

  // upload(buffer, data: TypedArray|Buffer, offset = 0): host -> device, complete on return
  Napi::Value Upload(const Napi::CallbackInfo& info) { return HostCopy(info, true); }
  // download(buffer, into: TypedArray|Buffer, offset = 0): device -> host, complete on return
  Napi::Value Download(const Napi::CallbackInfo& info) { return HostCopy(info, false); }
  Napi::Value HostCopy(const Napi::CallbackInfo& info, bool up) {
    Napi::Env env = info.Env();
    const char* op = up ? "upload" : "download";
    if (info.Length() < 2 || !info[1].IsTypedArray()) Throw(env, Code::kInvalidArgument, std::string(op) + "(buffer, typedArray, offset?): the second argument must be a TypedArray or Buffer");
    DeviceBuffer* b = Buf(env, info[0], "buffer");
    Napi::TypedArray ta = info[1].As<Napi::TypedArray>();
    const int64_t offset = Given(info, 2) ? ParseInt(env, info[2], "offset", 0) : 0;
    const size_t bytes = ta.ByteLength();
    if (offset + static_cast<int64_t>(bytes) > static_cast<int64_t>(b->bytes())) {
      Throw(env, Code::kInvalidArgument, std::string(op) + ": " + std::to_string(bytes) + " bytes at offset " + std::to_string(offset) + " do not fit the buffer's " + std::to_string(b->bytes()) + " bytes");
    }
    char* host = static_cast<char*>(ta.ArrayBuffer().Data()) + ta.ByteOffset();
    char* dev = static_cast<char*>(b->ptr()) + offset;
    Check(env, up ? be().CopyToDevice(dev, host, bytes, 0) : be().CopyToHost(host, dev, bytes, 0));
    return env.Undefined();
  }
  // copy({dst, src, bytes, dstOffset, srcOffset, stream}): device -> device, asynchronous
  Napi::Value CopyJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    DeviceBuffer* dst = Buf(env, o.Get("dst"), "dst");
    DeviceBuffer* src = Buf(env, o.Get("src"), "src");
    const int64_t dOff = Int(env, o, "dstOffset", 0, 0), sOff = Int(env, o, "srcOffset", 0, 0);
    const int64_t dst_bytes = static_cast<int64_t>(dst->bytes()), src_bytes = static_cast<int64_t>(src->bytes());
    // checked before `bytes` defaults to the rest of src, which past its end would be negative
    if (sOff > src_bytes) Throw(env, Code::kInvalidArgument, "copy: srcOffset " + std::to_string(sOff) + " is past src's " + std::to_string(src_bytes) + " bytes");
    const int64_t bytes = Int(env, o, "bytes", src_bytes - sOff, 0);
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
    void* d = static_cast<char*>(dst->ptr()) + dOff;
    const void* from = static_cast<char*>(src->ptr()) + sOff;
    const size_t n = static_cast<size_t>(bytes);
    Backend* backend = &be();
    Queue(env, Stream(env, o), [backend, d, from, n](int stream) { return backend->CopyDeviceToDevice(d, from, n, stream); });
    return env.Undefined();
  }
  Napi::Value FillJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    NewCall();
    DeviceBuffer* b = Buf(env, info[0], "buffer");
    const int64_t value = Given(info, 1) ? ParseInt(env, info[1], "value", 0) : 0;
    if (value > 255) Throw(env, Code::kInvalidArgument, "fill: value must be a byte (0..255)");
    void* d = b->ptr();
    const size_t n = b->bytes();
    const int stream = Given(info, 2) ? ParseInt32(env, info[2], "stream", 0) : 0;
    Check(env, be().CheckStream(stream));
    Backend* backend = &be();
    Queue(env, stream, [backend, d, n, value](int s) { return backend->Fill(d, static_cast<uint8_t>(value), n, s); });
    return env.Undefined();
  }
  Napi::Value HoldJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int64_t us = ParseInt(env, info[0], "microseconds", 0);
    if (us > 10'000'000) Throw(env, Code::kInvalidArgument, "hold: microseconds must be at most 10000000 (10 s)");
    NewCall();
    Backend* backend = &be();
    Queue(env, Given(info, 1) ? ParseInt32(env, info[1], "stream", 0) : 0, [backend, us](int s) { return backend->Hold(us, s); });
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
    Check(env, be().RecordEvent(event, stream));
    return env.Undefined();
  }
  Napi::Value ElapsedJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    float ms = 0;
    Check(env, be().ElapsedMs(ParseInt32(env, info[0], "start", 0), ParseInt32(env, info[1], "end", 0), &ms));
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

  // Queues one op on `stream`. On a capturing stream the call's buffers go to the capture, and the
  // cpu twin records the call (`op` copied, with what it captured by value) instead of running it.
  template <typename Op>
  void Queue(Napi::Env env, int stream, const Op& op) {
    auto it = captures_.empty() ? captures_.end() : captures_.find(stream);
    if (it == captures_.end()) {
      Check(env, op(stream));
      return;
    }
    Check(env, be().RecordsCalls() ? be().RecordCall(stream, [op] { return op(0); }) : op(stream));
    Capture& c = it->second;
    ++c.calls;
    for (const auto& [buffer, value] : call_buffers_) {
      if (c.seen.insert(buffer).second) c.buffers.emplace_back(buffer, Napi::Persistent(Napi::Object(env, value)));
    }
    call_buffers_.clear();
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
    return env.Undefined();
  }
  // endCapture(stream) -> Graph
  Napi::Value EndCaptureJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int stream = ParseInt32(env, info[0], "stream", 0);
    auto it = captures_.find(stream);
    if (it == captures_.end()) Throw(env, Code::kInvalidArgument, "endCapture: stream " + std::to_string(stream) + " is not capturing (beginCapture first)");
    Capture c = std::move(it->second);
    captures_.erase(it);
    int id = 0;
    Check(env, be().EndCapture(stream, &id));
    Napi::Object obj = Graph::constructor->New({});
    Graph::Unwrap(obj)->Attach(handle_, id, c.calls, std::move(c.buffers));
    if (napi_type_tag_object(env, obj, GraphTag()) != napi_ok) Throw(env, Code::kDeviceError, "endCapture: could not tag the graph");
    return obj;
  }
  Graph* GraphArg(Napi::Env env, const Napi::Value& v, const char* op) {
    bool tagged = false;
    if (v.IsObject() && napi_check_object_type_tag(env, v, GraphTag(), &tagged) != napi_ok) tagged = false;
    if (!tagged) Throw(env, Code::kInvalidArgument, std::string(op) + ": graph must be a Graph from endCapture()");
    Graph* g = Graph::Unwrap(v.As<Napi::Object>());
    if (g->freed()) Throw(env, Code::kInvalidArgument, std::string(op) + ": use of a freed graph");
    if (g->owner() != handle_.get()) Throw(env, Code::kInvalidArgument, std::string(op) + ": graph belongs to another backend (#" + std::to_string(g->owner()->id) + "), not this " + be().kind() + " #" + std::to_string(handle_->id));
    return g;
  }
  // launchGraph(graph, stream = 0): replays the graph's ops on `stream`, after the work queued there.
  Napi::Value LaunchGraphJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Graph* g = GraphArg(env, info[0], "launchGraph");
    const auto& buffers = g->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) {
      const DeviceBuffer* b = buffers[i].first;
      if (b->freed()) Throw(env, Code::kInvalidArgument, "launchGraph: buffer " + std::to_string(i) + " of the graph (" + std::to_string(b->bytes()) + " bytes) was freed after the capture; the graph's ops use it");
    }
    const int stream = Given(info, 1) ? ParseInt32(env, info[1], "stream", 0) : 0;
    Check(env, be().CheckStream(stream));
    if (captures_.count(stream)) Throw(env, Code::kInvalidArgument, "launchGraph: stream " + std::to_string(stream) + " is capturing; a graph is not launched into a capture");
    Check(env, be().LaunchGraph(g->id(), stream));
    return env.Undefined();
  }
  Napi::Value FreeGraphJs(const Napi::CallbackInfo& info) {
    GraphArg(info.Env(), info[0], "freeGraph")->Release();
    return info.Env().Undefined();
  }

  // Validates the parsed arguments, then queues the op on the call's stream.
  template <typename Args>
  Napi::Value Run(Napi::Env env, const Napi::Object& o, const Args& a, Status (*validate)(const Args&), Status (Backend::*op)(const Args&, int)) {
    Check(env, validate(a));
    const int stream = Stream(env, o);
    if (captures_.empty()) {  // the common case: no copy of the arguments
      Check(env, (be().*op)(a, stream));
      return env.Undefined();
    }
    Backend* backend = &be();
    Queue(env, stream, [backend, a, op](int s) { return (backend->*op)(a, s); });
    return env.Undefined();
  }

  Napi::Value W4A16PackJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    W4A16PackArgs a{ParseTensor(env, o, "qw"), ParseTensor(env, o, "sc"), ParseTensor(env, o, "qwPacked"), ParseTensor(env, o, "scPacked"), Int32(env, o, "group", 32),
                    Bool(o, "interleaveGateUp", false)};
    return Run(env, o, a, ValidateW4A16Pack, &Backend::W4A16Pack);
  }
  Napi::Value W4A16GemmJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    W4A16GemmArgs a{ParseTensor(env, o, "x"), ParseTensor(env, o, "qw"), ParseTensor(env, o, "sc"), ParseTensor(env, o, "y"), Int32(env, o, "group", 32),
                    ParseEpilogue(env, o, "w4a16_gemm")};
    return Run(env, o, a, ValidateW4A16Gemm, &Backend::W4A16Gemm);
  }
  Napi::Value GemmJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    GemmArgs a{ParseTensor(env, o, "x"), ParseTensor(env, o, "w"), ParseTensor(env, o, "y")};
    return Run(env, o, a, ValidateGemm, &Backend::Gemm);
  }
  Napi::Value MoeGemmJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    MoeGemmArgs a;
    a.x = ParseTensor(env, o, "x");
    a.qw = ParseTensor(env, o, "qw");
    a.sc = ParseTensor(env, o, "sc");
    a.ids = ParseTensor(env, o, "ids");
    a.weights = ParseTensor(env, o, "weights", true);
    a.y = ParseTensor(env, o, "y");
    a.group = Int32(env, o, "group", 32);
    const std::string mode = o.Has("mode") ? o.Get("mode").ToString().Utf8Value() : "gather";
    if (mode != "gather" && mode != "sum") Throw(env, Code::kInvalidArgument, "moe_gemm: mode must be 'gather' or 'sum', got '" + mode + "'");
    a.mode = mode == "sum" ? MoeMode::kSum : MoeMode::kGather;
    a.min_warp_steps = Int(env, o, "minWarpSteps", 0, 0);
    a.epilogue = ParseEpilogue(env, o, "moe_gemm");
    int64_t e = 0, k = 0;
    Check(env, ValidateMoeGemm(a, &e, &k));
    return Run(env, o, a, +[](const MoeGemmArgs&) { return Status::Ok(); }, &Backend::MoeGemm);  // validated above
  }
  Napi::Value MlaAttentionJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    MlaAttentionArgs a;
    a.q_nope = ParseTensor(env, o, "qNope");
    a.q_pe = ParseTensor(env, o, "qPe");
    a.kv_b = ParseTensor(env, o, "kvB");
    a.cache_c = ParseTensor(env, o, "cacheC");
    a.cache_kpe = ParseTensor(env, o, "cacheKpe");
    a.mask = ParseTensor(env, o, "mask", true);
    a.out = ParseTensor(env, o, "out");
    a.base = Int(env, o, "base", 0, 0);
    a.scale = Num(env, o, "scale", 0);
    a.base_on_device = ParseTensor(env, o, "baseOnDevice", true);
    return Run(env, o, a, ValidateMlaAttention, &Backend::MlaAttention);
  }
  Napi::Value EmbeddingJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    EmbeddingArgs a{ParseTensor(env, o, "table"), ParseTensor(env, o, "ids"), ParseTensor(env, o, "out")};
    return Run(env, o, a, ValidateEmbedding, &Backend::Embedding);
  }
  Napi::Value RmsNormJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    RmsNormArgs a{ParseTensor(env, o, "x"), ParseTensor(env, o, "weight"), ParseTensor(env, o, "out"), Num(env, o, "eps", 0), ParseTensor(env, o, "residual", true),
                  ParseTensor(env, o, "sum", true)};
    return Run(env, o, a, ValidateRmsNorm, &Backend::RmsNorm);
  }
  Napi::Value RopeJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    RopeArgs a;
    a.x = ParseTensor(env, o, "x");
    a.positions = ParseTensor(env, o, "positions");
    a.inv_freq = ParseTensor(env, o, "invFreq");
    a.offset = Int(env, o, "offset", 0, 0);
    a.attention_factor = Num(env, o, "attentionFactor", 1.0);
    a.interleave = Bool(o, "interleave", true);
    return Run(env, o, a, ValidateRope, &Backend::Rope);
  }
  Napi::Value SiluMulJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    SiluMulArgs a{ParseTensor(env, o, "x"), ParseTensor(env, o, "out")};
    return Run(env, o, a, ValidateSiluMul, &Backend::SiluMul);
  }
  Napi::Value AddJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    AddArgs a{ParseTensor(env, o, "a"), ParseTensor(env, o, "b"), ParseTensor(env, o, "out")};
    return Run(env, o, a, ValidateAdd, &Backend::Add);
  }
  Napi::Value RouterJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    RouterArgs a;
    a.logits = ParseTensor(env, o, "logits");
    a.bias = ParseTensor(env, o, "bias");
    a.ids = ParseTensor(env, o, "ids");
    a.weights = ParseTensor(env, o, "weights");
    a.topk = Int32(env, o, "topk", 8, 1);
    a.n_group = Int32(env, o, "nGroup", 1, 1);
    a.topk_group = Int32(env, o, "topkGroup", 1, 1);
    a.norm_topk_prob = Bool(o, "normTopkProb", true);
    a.scaling = Num(env, o, "scaling", 1.0);
    return Run(env, o, a, ValidateRouter, &Backend::Router);
  }
  Napi::Value ArgmaxJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    ArgmaxArgs a{ParseTensor(env, o, "x"), ParseTensor(env, o, "out")};
    return Run(env, o, a, ValidateArgmax, &Backend::Argmax);
  }
  Napi::Value TopkJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    TopkArgs a{ParseTensor(env, o, "x"), ParseTensor(env, o, "values"), ParseTensor(env, o, "ids"), Int32(env, o, "k", 1, 1)};
    return Run(env, o, a, ValidateTopk, &Backend::Topk);
  }
  Napi::Value KvWriteJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    KvWriteArgs a{ParseTensor(env, o, "c"), ParseTensor(env, o, "kpe"), ParseTensor(env, o, "cacheC"), ParseTensor(env, o, "cacheKpe"), ParseTensor(env, o, "slots")};
    return Run(env, o, a, ValidateKvWrite, &Backend::KvWrite);
  }
  Napi::Value DdtreeBuildJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    DdtreeBuildArgs a;
    a.draft_logits = ParseTensor(env, o, "draftLogits");
    a.root = Int32(env, o, "root", 0, 0);
    a.budget = Int32(env, o, "budget", 0, 0);
    a.start = Int(env, o, "start", 0, 0);
    a.tokens = ParseTensor(env, o, "tokens");
    a.parents = ParseTensor(env, o, "parents");
    a.depths = ParseTensor(env, o, "depths");
    a.positions = ParseTensor(env, o, "positions");
    a.mask = ParseTensor(env, o, "mask");
    a.size = ParseTensor(env, o, "size");
    a.root_on_device = ParseTensor(env, o, "rootOnDevice", true);
    a.start_on_device = ParseTensor(env, o, "startOnDevice", true);
    a.log_probs = ParseTensor(env, o, "logProbs", true);
    return Run(env, o, a, ValidateDdtreeBuild, &Backend::DdtreeBuild);
  }
  Napi::Value DdtreeAcceptJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    DdtreeAcceptArgs a{ParseTensor(env, o, "tokens"), ParseTensor(env, o, "parents"), ParseTensor(env, o, "size"), ParseTensor(env, o, "targetArgmax"), ParseTensor(env, o, "path"), ParseTensor(env, o, "pathLen"), ParseTensor(env, o, "bonus")};
    return Run(env, o, a, ValidateDdtreeAccept, &Backend::DdtreeAccept);
  }
  Napi::Value KvCommitJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    KvCommitArgs a;
    Napi::Value caches = o.Get("caches");
    if (!caches.IsArray()) Throw(env, Code::kInvalidArgument, "kv_commit: caches must be an array of tensors");
    Napi::Array arr = caches.As<Napi::Array>();
    for (uint32_t i = 0; i < arr.Length(); ++i) {
      Napi::Object holder = Napi::Object::New(env);
      holder.Set("cache", arr.Get(i));
      Tensor t = ParseTensor(env, holder, "cache");
      t.name = "caches[" + std::to_string(i) + "]";
      a.caches.push_back(t);
    }
    a.path = ParseTensor(env, o, "path");
    a.path_len = ParseTensor(env, o, "pathLen");
    a.start = Int(env, o, "start", 0, 0);
    a.start_on_device = ParseTensor(env, o, "startOnDevice", true);
    a.next_start = ParseTensor(env, o, "nextStart", true);
    return Run(env, o, a, ValidateKvCommit, &Backend::KvCommit);
  }
  Napi::Value ArangeJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Args(info);
    ArangeArgs a{ParseTensor(env, o, "startOnDevice", true), ParseTensor(env, o, "out"), Int(env, o, "start", 0)};
    return Run(env, o, a, ValidateArange, &Backend::Arange);
  }

  std::shared_ptr<BackendHandle> handle_;
  std::map<int, Capture> captures_;                               // capturing stream -> its capture
  std::vector<std::pair<DeviceBuffer*, napi_value>> call_buffers_;  // this call's buffers, during captures
};
Napi::FunctionReference* NativeBackend::constructor = nullptr;

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
  Napi::Object obj = NativeBackend::constructor->New({});
  NativeBackend::Unwrap(obj)->Attach(std::move(backend));
  return obj;
}

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
  DeviceBuffer::Init(env);
  Graph::Init(env);
  NativeBackend::Init(env);
  exports.Set("createBackend", Napi::Function::New(env, CreateBackend));
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
