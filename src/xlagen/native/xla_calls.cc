// The XLA custom-call wrappers of the kernels (kernels.h), their registration with XLA, and the settings and
// constants Python reads through ctypes.
//
// Each wrapper has XLA's status-returning custom-call signature: it parses the call's backend config (the
// opaque string xlagen/native/ops.py writes), calls the kernel's plain entry point, and reports a config it
// cannot parse, or sizes the kernel refuses, as a failed status, which XLA raises as an error of the program.
// XLA calls each through `Registered` (see ResultBuffer), which finds the result buffer first.

#include <dlfcn.h>
#include <pthread.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "kernels.h"
#include "pool.h"
#include "simd.h"

// XLA's custom-call status (xla/service/custom_call_status_internal.h): a message present means failure.
// TensorFlow does not export XlaCustomCallStatusSetFailure, so the wrappers write the message through this
// same definition; xlagen_register checks it once against XLA's exported reader
// (xla::CustomCallStatusGetMessage). Where the two disagree, a failure aborts the process with the message,
// as a custom call without a status would have to.
struct XlaCustomCallStatus_ {
  std::optional<std::string> message;
};

namespace {

bool g_status_checked = false;  // whether the struct above matches XLA's (set by xlagen_register)

void Fail(XlaCustomCallStatus_* status, const char* target, const std::string& what) {
  const std::string message = std::string(target) + ": " + what;
  if (!g_status_checked || status == nullptr) {
    std::fprintf(stderr, "xlagen native kernels: %s\n", message.c_str());
    std::abort();
  }
  status->message = message;
}

// The comma-separated fields of a backend config, read in order; every field must be read and nothing may
// follow the last one.
class Fields {
 public:
  Fields(const char* opaque, size_t length) : text_(opaque, length) {}

  bool Int(int* out) {
    const std::string field = Next();
    if (field.empty()) return false;
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(field.c_str(), &end, 10);
    if (errno != 0 || *end != '\0' || value < -2147483647L || value > 2147483647L) return ok_ = false;
    *out = static_cast<int>(value);
    return ok_;
  }

  bool Float(float* out) {
    const std::string field = Next();
    if (field.empty()) return false;
    char* end = nullptr;
    errno = 0;
    *out = std::strtof(field.c_str(), &end);
    if (errno != 0 || *end != '\0') return ok_ = false;
    return ok_;
  }

  bool Done() const { return ok_ && position_ > text_.size(); }

 private:
  std::string Next() {
    if (!ok_ || position_ > text_.size()) {
      ok_ = false;
      return std::string();
    }
    size_t comma = text_.find(',', position_);
    if (comma == std::string::npos) comma = text_.size();
    std::string field = text_.substr(position_, comma - position_);
    position_ = comma + 1;
    if (field.empty()) ok_ = false;
    return field;
  }

  std::string text_;
  size_t position_ = 0;
  bool ok_ = true;
};

std::string Quoted(const char* opaque, size_t length) { return "'" + std::string(opaque, length) + "'"; }

// Reports the entry point's refusal, if any.
void Check(XlaCustomCallStatus_* status, const char* target, const char* error) {
  if (error != nullptr) Fail(status, target, error);
}

// Whether `address` lies in the stack of the calling thread (its bounds read once per thread).
bool OnThisStack(const void* address) {
  thread_local uintptr_t low = 0, high = 0;  // [low, high); both 1 where the bounds cannot be read
  if (high == 0) {
    low = high = 1;
    pthread_attr_t attributes;
    if (pthread_getattr_np(pthread_self(), &attributes) == 0) {
      void* stack = nullptr;
      size_t size = 0;
      if (pthread_attr_getstack(&attributes, &stack, &size) == 0 && stack != nullptr) {
        low = reinterpret_cast<uintptr_t>(stack);
        high = low + size;
      }
      pthread_attr_destroy(&attributes);
    }
  }
  const uintptr_t at = reinterpret_cast<uintptr_t>(address);
  return at >= low && at < high;
}

// The buffer a custom call writes its result to, given XLA's `out`. XLA passes the buffer itself for a result
// that is one array (every xlagen target's), and the address of its array of result pointers for a tuple. But
// TensorFlow 2.21's XLA:CPU does not save which of the two a custom call has in its persistent compilation
// cache (`--tf_xla_persistent_cache_directory`, xlagen's `--compile-cache`: CustomCallThunkProto has no
// is_tuple_result) and leaves the flag uninitialized when it loads a program from there. Where the leftover
// byte reads as true, CustomCallThunk::CallUntypedAPI passes the address of that array, which is on its own
// stack; a kernel writing its result there would overwrite XLA's frame, the call's status among it, and the
// process would die with SIGSEGV in XLA's error path. XLA never places a result buffer on the calling
// thread's stack, so an `out` there is that array, and its first element is the buffer.
void* ResultBuffer(void* out) { return OnThisStack(out) ? *static_cast<void**>(out) : out; }

using Target = void (*)(void* out, const void** in, const char* opaque, size_t opaque_len,
                        XlaCustomCallStatus_* status);

// `target` as XLA calls it: on the result buffer `ResultBuffer` finds.
template <Target target>
void Registered(void* out, const void** in, const char* opaque, size_t opaque_len, XlaCustomCallStatus_* status) {
  target(ResultBuffer(out), in, opaque, opaque_len, status);
}

// A product's custom call: the backend config is "M,K,N", x is the first operand and the weights (stored as
// W) the second.
template <typename W>
void ProductCall(const char* target, const char* (*entry)(const float*, const W*, float*, int, int, int), void* out,
                 const void** in, const char* opaque, size_t opaque_len, XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int m, k, n;
  if (!(f.Int(&m) && f.Int(&k) && f.Int(&n) && f.Done())) {
    return Fail(status, target, "backend config " + Quoted(opaque, opaque_len) + " is not M,K,N");
  }
  Check(status, target, entry(static_cast<const float*>(in[0]), static_cast<const W*>(in[1]),
                              static_cast<float*>(out), m, k, n));
}

// A product with an epilogue: the backend config is "M,K,N,bias,activation,residual": bias 1 when an operand
// after the weights, float32 [N], is added to y as it is stored; the activation then applied (0 none, 1 ReLU, 2
// GELU's tanh form); residual 1 when a last operand, float32 [M, N], is then added.
template <typename W>
void EpilogueProductCall(const char* target,
                         const char* (*entry)(const float*, const W*, const float*, int, const float*, float*, int,
                                              int, int),
                         void* out, const void** in, const char* opaque, size_t opaque_len,
                         XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int m, k, n, biased, activation, residual;
  if (!(f.Int(&m) && f.Int(&k) && f.Int(&n) && f.Int(&biased) && f.Int(&activation) && f.Int(&residual) &&
        f.Done())) {
    return Fail(status, target,
                "backend config " + Quoted(opaque, opaque_len) + " is not M,K,N,bias,activation,residual");
  }
  Check(status, target, entry(static_cast<const float*>(in[0]), static_cast<const W*>(in[1]),
                              biased ? static_cast<const float*>(in[2]) : nullptr, activation,
                              residual ? static_cast<const float*>(in[biased ? 3 : 2]) : nullptr,
                              static_cast<float*>(out), m, k, n));
}

}  // namespace

extern "C" void xlagen_bf16_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                   XlaCustomCallStatus_* status) {
  ProductCall<uint32_t>("xlagen_bf16_matmul", xlagen_bf16_product, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_int8_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                   XlaCustomCallStatus_* status) {
  ProductCall<int8_t>("xlagen_int8_matmul", xlagen_int8_product, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_int8_imatmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                    XlaCustomCallStatus_* status) {
  ProductCall<int8_t>("xlagen_int8_imatmul", xlagen_int8_integer_product, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_int8_many_imatmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                         XlaCustomCallStatus_* status) {
  ProductCall<int8_t>("xlagen_int8_many_imatmul", xlagen_int8_many_integer_product, out, in, opaque, opaque_len,
                      status);
}

extern "C" void xlagen_int8_many_imatmul_epilogue(void* out, const void** in, const char* opaque, size_t opaque_len,
                                                  XlaCustomCallStatus_* status) {
  EpilogueProductCall<int8_t>("xlagen_int8_many_imatmul_epilogue", xlagen_int8_many_integer_product_epilogue, out, in,
                              opaque, opaque_len, status);
}
extern "C" void xlagen_f32_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                  XlaCustomCallStatus_* status) {
  ProductCall<float>("xlagen_f32_matmul", xlagen_f32_product, out, in, opaque, opaque_len, status);
}

// The many-row products (gemm.cc), with the products' backend config "m,k,n".
extern "C" void xlagen_f32_gemm(void* out, const void** in, const char* opaque, size_t opaque_len,
                                XlaCustomCallStatus_* status) {
  ProductCall<float>("xlagen_f32_gemm", xlagen_f32_many_product, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_f32_gemm_epilogue(void* out, const void** in, const char* opaque, size_t opaque_len,
                                         XlaCustomCallStatus_* status) {
  EpilogueProductCall<float>("xlagen_f32_gemm_epilogue", xlagen_f32_many_product_epilogue, out, in, opaque, opaque_len,
                             status);
}

extern "C" void xlagen_bf16_gemm(void* out, const void** in, const char* opaque, size_t opaque_len,
                                 XlaCustomCallStatus_* status) {
  ProductCall<uint32_t>("xlagen_bf16_gemm", xlagen_bf16_many_product, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_bf16_tile_gemm(void* out, const void** in, const char* opaque, size_t opaque_len,
                                      XlaCustomCallStatus_* status) {
  ProductCall<uint32_t>("xlagen_bf16_tile_gemm", xlagen_bf16_tile_product, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_bf16_tile_gemm_epilogue(void* out, const void** in, const char* opaque, size_t opaque_len,
                                               XlaCustomCallStatus_* status) {
  EpilogueProductCall<uint32_t>("xlagen_bf16_tile_gemm_epilogue", xlagen_bf16_tile_product_epilogue, out, in, opaque,
                                opaque_len, status);
}
extern "C" void xlagen_int8_gemm(void* out, const void** in, const char* opaque, size_t opaque_len,
                                 XlaCustomCallStatus_* status) {
  ProductCall<int8_t>("xlagen_int8_gemm", xlagen_int8_many_product, out, in, opaque, opaque_len, status);
}

// An attention call's optional layout (see xlagen_attention_at): 16 more fields, or none.
static bool ReadLayout(Fields& f, int* layout, bool* given) {
  *given = !f.Done();
  for (int i = 0; *given && i < 16; ++i) {
    if (!f.Int(layout + i)) return false;
  }
  return f.Done();
}

// The backend config is "heads,t,s,d,scale,transposed" (scale printed with 9 significant digits: exact for
// float32; transposed 1 when k is [heads, d, s]), or "heads,t,s,d,scale,0,heads_per_sequence" and a layout of
// q, k, v and out (16 fields, see xlagen_attention_at).
extern "C" void xlagen_f32_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                     XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int heads, t, s, d, transposed, heads_per_sequence = 0, layout[16];
  float scale;
  bool laid_out = false;
  if (!(f.Int(&heads) && f.Int(&t) && f.Int(&s) && f.Int(&d) && f.Float(&scale) && f.Int(&transposed) &&
        (f.Done() || (f.Int(&heads_per_sequence) && ReadLayout(f, layout, &laid_out) && laid_out && !transposed)))) {
    return Fail(status, "xlagen_f32_attention",
                "backend config " + Quoted(opaque, opaque_len) +
                    " is not heads,t,s,d,scale,transposed or heads,t,s,d,scale,0,heads_per_sequence,layout");
  }
  const float* q = static_cast<const float*>(in[0]);
  const float* k = static_cast<const float*>(in[1]);
  const float* v = static_cast<const float*>(in[2]);
  Check(status, "xlagen_f32_attention",
        laid_out ? xlagen_attention_at(q, k, v, nullptr, nullptr, static_cast<float*>(out), heads, t, s, d, scale,
                                       heads_per_sequence, 1, 1, layout)
                 : xlagen_attention(q, k, v, static_cast<float*>(out), heads, t, s, d, scale, transposed));
}

// A prompt's or an encoder's attention, `biased` or not. The backend config is
// "heads,t,s,d,scale,heads_per_mask,mask_rows", then ",bias_heads" if `biased`, then optionally a layout of q,
// k, v and out (16 fields, see xlagen_attention_at); operands q, k, v, the mask (uint8 [heads / heads_per_mask,
// mask_rows, s]) and, if `biased`, the bias (float32 [bias_heads, t, s]).
static void MaskedAttentionCall(const char* target, bool biased, void* out, const void** in, const char* opaque,
                                size_t opaque_len, XlaCustomCallStatus_* status, bool relative = false) {
  Fields f(opaque, opaque_len);
  int heads, t, s, d, heads_per_mask, mask_rows, bias_heads = 1, layout[16];
  float scale;
  bool laid_out = false;
  if (!(f.Int(&heads) && f.Int(&t) && f.Int(&s) && f.Int(&d) && f.Float(&scale) && f.Int(&heads_per_mask) &&
        f.Int(&mask_rows) && (!biased || f.Int(&bias_heads)) && ReadLayout(f, layout, &laid_out))) {
    return Fail(status, target,
                "backend config " + Quoted(opaque, opaque_len) + " is not heads,t,s,d,scale,heads_per_mask,mask_rows" +
                    (biased ? ",bias_heads" : "") + " and optionally a layout of 16 fields");
  }
  const float* q = static_cast<const float*>(in[0]);
  const float* k = static_cast<const float*>(in[1]);
  const float* v = static_cast<const float*>(in[2]);
  const uint8_t* mask = static_cast<const uint8_t*>(in[3]);
  const float* bias = biased ? static_cast<const float*>(in[4]) : nullptr;
  float* o = static_cast<float*>(out);
  if (!laid_out) {  // tensors [heads, rows, d] of their own
    const int packed[16] = {0, heads_per_mask * t * d, t * d, d, 0, heads_per_mask * s * d, s * d, d,
                            0, heads_per_mask * s * d, s * d, d, 0, heads_per_mask * t * d, t * d, d};
    std::copy(packed, packed + 16, layout);
  }
  Check(status, target,
        xlagen_relative_attention_at(q, k, v, mask, bias, relative, o, heads, t, s, d, scale, heads_per_mask,
                                     mask_rows, bias_heads, layout));
}

extern "C" void xlagen_f32_masked_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                            XlaCustomCallStatus_* status) {
  MaskedAttentionCall("xlagen_f32_masked_attention", false, out, in, opaque, opaque_len, status);
}

extern "C" void xlagen_f32_biased_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                            XlaCustomCallStatus_* status) {
  MaskedAttentionCall("xlagen_f32_biased_attention", true, out, in, opaque, opaque_len, status);
}

// The same with a relative bias, float32 [bias_heads, t + s - 1]: key j of row i adds bias[key - row + t - 1].
extern "C" void xlagen_f32_relative_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                              XlaCustomCallStatus_* status) {
  MaskedAttentionCall("xlagen_f32_relative_attention", true, out, in, opaque, opaque_len, status, true);
}

// The backend config is "groups,heads,queries,s,d,bias_heads,scale,mask_value" (floats printed with 9
// significant digits).
extern "C" void xlagen_f32_step_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                          XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int groups, heads, queries, s, d, bias_heads;
  float scale, mask_value;
  if (!(f.Int(&groups) && f.Int(&heads) && f.Int(&queries) && f.Int(&s) && f.Int(&d) && f.Int(&bias_heads) &&
        f.Float(&scale) && f.Float(&mask_value) && f.Done())) {
    return Fail(status, "xlagen_f32_step_attention",
                "backend config " + Quoted(opaque, opaque_len) +
                    " is not groups,heads,queries,s,d,bias_heads,scale,mask_value");
  }
  Check(status, "xlagen_f32_step_attention",
        xlagen_step_attention(static_cast<const float*>(in[0]), static_cast<const float*>(in[1]),
                              static_cast<const float*>(in[2]), static_cast<const float*>(in[3]),
                              static_cast<const float*>(in[4]), static_cast<const float*>(in[5]),
                              static_cast<float*>(out), groups, heads, queries, s, d, bias_heads, scale, mask_value));
}

// The backend config is "groups,queries,heads,d,l,e,scale" (scale printed with 9 significant digits); the
// operands q, m, wkt, wkv, bkv (see xlagen_memory_attention).
extern "C" void xlagen_f32_memory_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                            XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int groups, queries, heads, d, l, e;
  float scale;
  if (!(f.Int(&groups) && f.Int(&queries) && f.Int(&heads) && f.Int(&d) && f.Int(&l) && f.Int(&e) &&
        f.Float(&scale) && f.Done())) {
    return Fail(status, "xlagen_f32_memory_attention",
                "backend config " + Quoted(opaque, opaque_len) + " is not groups,queries,heads,d,l,e,scale");
  }
  Check(status, "xlagen_f32_memory_attention",
        xlagen_memory_attention(static_cast<const float*>(in[0]), static_cast<const float*>(in[1]),
                                static_cast<const float*>(in[2]), static_cast<const float*>(in[3]),
                                static_cast<const float*>(in[4]), static_cast<float*>(out), groups, queries, heads,
                                d, l, e, scale));
}

// The backend config is "b,l,width,offset,heads,d,transposed,length": operands in float32 [b, l, width] and
// the int32 start of its positions in the output.
extern "C" void xlagen_f32_split_heads(void* out, const void** in, const char* opaque, size_t opaque_len,
                                       XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int b, l, width, offset, heads, d, transposed, length;
  if (!(f.Int(&b) && f.Int(&l) && f.Int(&width) && f.Int(&offset) && f.Int(&heads) && f.Int(&d) &&
        f.Int(&transposed) && f.Int(&length) && f.Done())) {
    return Fail(status, "xlagen_f32_split_heads",
                "backend config " + Quoted(opaque, opaque_len) + " is not b,l,width,offset,heads,d,transposed,length");
  }
  Check(status, "xlagen_f32_split_heads",
        xlagen_split_heads(static_cast<const float*>(in[0]), static_cast<float*>(out), b, l, width, offset, heads, d,
                           transposed, length, *static_cast<const int32_t*>(in[1])));
}

// The backend config is "rows,e,epsilon,gamma,beta" (gamma and beta 1 when given): operands x float32
// [rows, e], then gamma and beta [e] if given.
extern "C" void xlagen_f32_layer_norm(void* out, const void** in, const char* opaque, size_t opaque_len,
                                      XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int rows, e, gamma, beta;
  float epsilon;
  if (!(f.Int(&rows) && f.Int(&e) && f.Float(&epsilon) && f.Int(&gamma) && f.Int(&beta) && f.Done())) {
    return Fail(status, "xlagen_f32_layer_norm",
                "backend config " + Quoted(opaque, opaque_len) + " is not rows,e,epsilon,gamma,beta");
  }
  const float* operands[2] = {nullptr, nullptr};
  int next = 1;
  if (gamma) operands[0] = static_cast<const float*>(in[next++]);
  if (beta) operands[1] = static_cast<const float*>(in[next++]);
  Check(status, "xlagen_f32_layer_norm",
        xlagen_layer_norm(static_cast<const float*>(in[0]), operands[0], operands[1], static_cast<float*>(out), rows,
                          e, epsilon));
}

// The backend config is "rows,e,epsilon": operands x float32 [rows, e] and the scale [e].
extern "C" void xlagen_f32_rms_norm(void* out, const void** in, const char* opaque, size_t opaque_len,
                                    XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int rows, e;
  float epsilon;
  if (!(f.Int(&rows) && f.Int(&e) && f.Float(&epsilon) && f.Done())) {
    return Fail(status, "xlagen_f32_rms_norm", "backend config " + Quoted(opaque, opaque_len) + " is not rows,e,epsilon");
  }
  Check(status, "xlagen_f32_rms_norm",
        xlagen_rms_norm(static_cast<const float*>(in[0]), static_cast<const float*>(in[1]), static_cast<float*>(out),
                        rows, e, epsilon));
}

// The backend config is "e,v,n": operands the table float32 [e, v] and the ids int32 [n]; out [n, e].
extern "C" void xlagen_f32_lookup_columns(void* out, const void** in, const char* opaque, size_t opaque_len,
                                          XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int e, v, n;
  if (!(f.Int(&e) && f.Int(&v) && f.Int(&n) && f.Done())) {
    return Fail(status, "xlagen_f32_lookup_columns", "backend config " + Quoted(opaque, opaque_len) + " is not e,v,n");
  }
  Check(status, "xlagen_f32_lookup_columns",
        xlagen_lookup_columns(static_cast<const float*>(in[0]), static_cast<const int32_t*>(in[1]),
                              static_cast<float*>(out), e, v, n));
}

// The backend config is "rows,n".
extern "C" void xlagen_f32_argmax(void* out, const void** in, const char* opaque, size_t opaque_len,
                                  XlaCustomCallStatus_* status) {
  Fields f(opaque, opaque_len);
  int rows, n;
  if (!(f.Int(&rows) && f.Int(&n) && f.Done())) {
    return Fail(status, "xlagen_f32_argmax", "backend config " + Quoted(opaque, opaque_len) + " is not rows,n");
  }
  Check(status, "xlagen_f32_argmax",
        xlagen_argmax(static_cast<const float*>(in[0]), static_cast<int32_t*>(out), rows, n));
}

// The pool's settings (see ConfigurePool): 1 when taken, 0 when the pool is already running.
extern "C" int xlagen_configure_pool(int threads, int spin_us, long lookahead_kb) {
  return xlagen::ConfigurePool(threads, spin_us, lookahead_kb) ? 1 : 0;
}

// Sets how many KiB of the product expected next each idle worker prefetches (0: none), for the calls from
// now on; xlagen_configure_pool's (default kDefaultLookaheadKB) until then.
extern "C" void xlagen_set_lookahead(long kib) {
  xlagen::GetPool().set_lookahead(kib < 0 ? 0 : static_cast<size_t>(kib) * 1024);
}
extern "C" long xlagen_lookahead() { return static_cast<long>(xlagen::GetPool().lookahead() / 1024); }

// [threads, the spin bound in microseconds, then Pool::Count's: tasks run on the pool, nanoseconds the
// workers spun, samples of the runnable threads, samples that left no core to spin on, the caller's sleeps]
extern "C" void xlagen_pool_counts(long* out) {
  xlagen::Pool& pool = xlagen::GetPool();
  out[0] = pool.threads();
  out[1] = pool.spin_us();
  pool.Count(out + 2);
}

// [float32 product calls, calls that were the product predicted after the previous one, bytes read ahead]
extern "C" void xlagen_lookahead_counts(long* out) {
  xlagen::GetSuccessors().Count(out);
  out[2] = xlagen::g_read_ahead.load(std::memory_order_relaxed);
}

// Whether a failing custom call reports an error status (1), or aborts the process (0): see
// XlaCustomCallStatus_ above.
extern "C" int xlagen_status_supported() { return g_status_checked ? 1 : 0; }

extern "C" int xlagen_constant(const char* name, long* value) {
  struct Constant {
    const char* name;
    long value;
  };
  static const Constant kConstants[] = {
      {"panel", xlagen::kPanel},
      {"int8_panel", xlagen::kInt8Panel},
      {"max_stream_rows", xlagen::kMaxStreamM},
      {"step_attention_max_head_dim", xlagen::kStepAttentionMaxD},
      {"max_default_threads", xlagen::kMaxDefaultThreads},
      {"default_spin_us", xlagen::kDefaultSpinMicroseconds},
      {"default_lookahead_kb", xlagen::kDefaultLookaheadKB},
      {"lanes", xlagen::kLanes},
  };
  for (const Constant& constant : kConstants) {
    if (std::strcmp(constant.name, name) == 0) {
      *value = constant.value;
      return 1;
    }
  }
  return 0;
}

// Registers the target with XLA's registry of custom-call targets (xla::CustomCallTargetRegistry, in
// libtensorflow_cc, which TensorFlow has loaded by the time xlagen calls this). The registry is looked up
// by its exported symbols rather than linked: linking against the 1 GB library takes longer than
// compiling this file. Returns 0 on success, or a negative code saying which lookup failed.
// Also checks this file's XlaCustomCallStatus_ against XLA's reader of it (see above).
extern "C" int xlagen_register(const char* tensorflow_library) {
  void* library = dlopen(tensorflow_library, RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return -1;
  using Global = void* (*)();
  // A member function called through its symbol: `this` is the first argument (Itanium C++ ABI).
  using Register = void (*)(void*, const std::string&, void*, const std::string&);
  auto global = reinterpret_cast<Global>(dlsym(library, "_ZN3xla24CustomCallTargetRegistry6GlobalEv"));
  auto add = reinterpret_cast<Register>(dlsym(
      library, "_ZN3xla24CustomCallTargetRegistry8RegisterERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEEPvS8_"));
  if (global == nullptr || add == nullptr) return -2;
  using GetMessage = std::optional<std::string_view> (*)(const XlaCustomCallStatus_*);
  auto get_message = reinterpret_cast<GetMessage>(
      dlsym(library, "_ZN3xla26CustomCallStatusGetMessageEPK20XlaCustomCallStatus_"));
  if (get_message != nullptr) {
    XlaCustomCallStatus_ ok, failed;
    failed.message = "xlagen status probe";
    const std::optional<std::string_view> none = get_message(&ok), some = get_message(&failed);
    g_status_checked = !none.has_value() && some.has_value() && *some == "xlagen status probe";
  }
  struct Entry {
    const char* name;
    Target target;
  };
  static const Entry kTargets[] = {
      {"xlagen_bf16_matmul", &Registered<xlagen_bf16_matmul>},
      {"xlagen_f32_matmul", &Registered<xlagen_f32_matmul>},
      {"xlagen_int8_matmul", &Registered<xlagen_int8_matmul>},
      {"xlagen_int8_imatmul", &Registered<xlagen_int8_imatmul>},
      {"xlagen_int8_many_imatmul", &Registered<xlagen_int8_many_imatmul>},
      {"xlagen_f32_gemm", &Registered<xlagen_f32_gemm>},
      {"xlagen_bf16_gemm", &Registered<xlagen_bf16_gemm>},
      {"xlagen_bf16_tile_gemm", &Registered<xlagen_bf16_tile_gemm>},
      {"xlagen_bf16_tile_gemm_epilogue", &Registered<xlagen_bf16_tile_gemm_epilogue>},
      {"xlagen_f32_gemm_epilogue", &Registered<xlagen_f32_gemm_epilogue>},
      {"xlagen_int8_many_imatmul_epilogue", &Registered<xlagen_int8_many_imatmul_epilogue>},
      {"xlagen_int8_gemm", &Registered<xlagen_int8_gemm>},
      {"xlagen_f32_attention", &Registered<xlagen_f32_attention>},
      {"xlagen_f32_masked_attention", &Registered<xlagen_f32_masked_attention>},
      {"xlagen_f32_biased_attention", &Registered<xlagen_f32_biased_attention>},
      {"xlagen_f32_relative_attention", &Registered<xlagen_f32_relative_attention>},
      {"xlagen_f32_step_attention", &Registered<xlagen_f32_step_attention>},
      {"xlagen_f32_argmax", &Registered<xlagen_f32_argmax>},
      {"xlagen_f32_split_heads", &Registered<xlagen_f32_split_heads>},
      {"xlagen_f32_layer_norm", &Registered<xlagen_f32_layer_norm>},
      {"xlagen_f32_rms_norm", &Registered<xlagen_f32_rms_norm>},
      {"xlagen_f32_lookup_columns", &Registered<xlagen_f32_lookup_columns>},
      {"xlagen_f32_memory_attention", &Registered<xlagen_f32_memory_attention>},
  };
  const std::string host("Host");
  for (const Entry& entry : kTargets) {
    add(global(), std::string(entry.name), reinterpret_cast<void*>(entry.target), host);
  }
  return 0;
}
