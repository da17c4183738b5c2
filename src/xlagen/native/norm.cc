// A prompt's LayerNorms: y = (x - mean) / sqrt(var + eps) * gamma + beta over each row of E values, as Keras'
// LayerNormalization computes it (inv = rsqrt(var + eps) * gamma, y = x * inv + (beta - mean * inv)), mean
// and variance in two passes over the row; and its RMS norms (T5's, the Llama family's): the same with no
// mean and no beta, y = x * (rsqrt(mean(x^2) + eps) * scale). XLA's CPU backend splits each row's sums into a reduce-window and
// a reduce, and GPT-2-small's 25 norms of 512 x 768 took about 9 ms of its 512-token prompt; here each row
// stays in the core's cache between the passes. On the calling thread alone: waking the pool's workers for
// so little work would leave them spinning beside XLA's next operation (a float32 prompt's dot), which then
// ran slower (GPT-2-small's float32 first token 0.97-0.99x with the pool, 1.00-1.01x without).

#include <cmath>

#include "kernels.h"
#include "simd.h"

namespace xlagen {
namespace {

constexpr int kNormRows = 8;  // rows per unit of RunLayerNorm's range

struct LayerNorm {
  const float* x;      // [rows, e]
  const float* gamma;  // [e] or null (1)
  const float* beta;   // [e] or null (0)
  float* y;            // [rows, e]
  int rows, e;
  float epsilon;
  bool rms;  // an RMS norm: the mean taken as 0 (the variance is then the mean square), no beta
};

// The sum of row[0..e), e = whole + the tail's lanes.
inline float RowSum(const float* row, int whole, Mask tail, bool partial, Vec (*term)(Vec, Vec), Vec mean) {
  Vec a0 = Zero(), a1 = Zero();
  int j = 0;
  for (; j + 2 * kLanes <= whole; j += 2 * kLanes) {
    a0 = Add(a0, term(Load(row + j), mean));
    a1 = Add(a1, term(Load(row + j + kLanes), mean));
  }
  for (; j < whole; j += kLanes) a0 = Add(a0, term(Load(row + j), mean));
  if (partial) a1 = Add(a1, KeepMasked(tail, term(LoadMasked(tail, row + whole), mean)));
  return ReduceAdd(Add(a0, a1));
}

inline Vec Value(Vec x, Vec) { return x; }
inline Vec Squared(Vec x, Vec mean) {
  const Vec d = Sub(x, mean);
  return Mul(d, d);
}

void RunLayerNorm(const void* args, int u0, int u1) {
  const LayerNorm& a = *static_cast<const LayerNorm*>(args);
  const int whole = a.e / kLanes * kLanes;
  const bool partial = whole < a.e;
  const Mask tail = FirstLanes(a.e - whole);
  for (int u = u0; u < u1; ++u) {
    for (int r = u * kNormRows; r < a.rows && r < (u + 1) * kNormRows; ++r) {
      const float* x = a.x + static_cast<size_t>(r) * a.e;
      float* y = a.y + static_cast<size_t>(r) * a.e;
      const float mean = a.rms ? 0.0f : RowSum(x, whole, tail, partial, Value, Zero()) / static_cast<float>(a.e);
      const float variance = RowSum(x, whole, tail, partial, Squared, Set(mean)) / static_cast<float>(a.e);
      const Vec scale = Set(1.0f / std::sqrt(variance + a.epsilon)), shift = Set(-mean);
      for (int j = 0; j < a.e; j += kLanes) {
        const bool last = j + kLanes > a.e;
        const Mask lanes = FirstLanes(last ? a.e - j : kLanes);
        const Vec inv = a.gamma ? Mul(scale, last ? LoadMasked(lanes, a.gamma + j) : Load(a.gamma + j)) : scale;
        const Vec beta = a.beta ? (last ? LoadMasked(lanes, a.beta + j) : Load(a.beta + j)) : Zero();
        const Vec res = Fma(shift, inv, beta);
        const Vec out = Fma(last ? LoadMasked(lanes, x + j) : Load(x + j), inv, res);
        if (last) {
          StoreMasked(y + j, lanes, out);
        } else {
          Store(y + j, out);
        }
      }
    }
  }
}

}  // namespace
}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_layer_norm(const float* x, const float* gamma, const float* beta, float* y, int rows,
                                         int e, float epsilon) {
  if (rows < 0 || e < 1) return "xlagen_layer_norm: rows must be at least 0 and e at least 1";
  if (!(epsilon >= 0.0f)) return "xlagen_layer_norm: epsilon must be at least 0";
  if (rows == 0) return nullptr;
  LayerNorm a{x, gamma, beta, y, rows, e, epsilon, false};
  RunLayerNorm(&a, 0, (rows + kNormRows - 1) / kNormRows);
  return nullptr;
}

extern "C" const char* xlagen_rms_norm(const float* x, const float* scale, float* y, int rows, int e, float epsilon) {
  if (rows < 0 || e < 1) return "xlagen_rms_norm: rows must be at least 0 and e at least 1";
  if (!(epsilon >= 0.0f)) return "xlagen_rms_norm: epsilon must be at least 0";
  if (rows == 0) return nullptr;
  LayerNorm a{x, scale, nullptr, y, rows, e, epsilon, true};
  RunLayerNorm(&a, 0, (rows + kNormRows - 1) / kNormRows);
  return nullptr;
}
