// The float32 product's work description, shared by the product (f32_product.cc) and the pool's read-ahead
// of the next product (pool.cc).

#ifndef XLAGEN_NATIVE_F32_PRODUCT_H_
#define XLAGEN_NATIVE_F32_PRODUCT_H_

#include "kernels.h"

namespace xlagen {

constexpr int kBlock = 256;      // output columns per float32 unit, from kMaxStreamM + 1 rows (RunF32Units)
constexpr int kChunk = 32;       // weight rows per chunk (RunF32Units)
constexpr int kStreamRows = 8;   // weight rows read side by side, up to kMaxStreamM rows (RunF32Stream)
constexpr int kMinSpan = 1024;   // columns per streamed unit at least, unless N is smaller

struct F32Product {
  const float* x;
  const float* w;
  float* y;
  float* partial;  // [splits - 1, M, N]: the sums of splits 1.. (split 0 writes y)
  int m, k, n, blocks, split_rows;
  int span;  // up to kMaxStreamM rows of x: output columns per unit (RunF32Stream)
};

// What unit u of a product reads and writes: output columns [c0, c0 + columns) over weight rows [k_begin,
// k_end), its sums going to `out` (y for the first split of K, else the split's partial sums), at c0.
struct Unit {
  int c0, columns, k_begin, k_end;
  float* out;
};

inline Unit UnitOf(const F32Product& a, int u, int width) {
  const int block = u % a.blocks, split = u / a.blocks;
  Unit unit;
  unit.c0 = block * width;
  unit.columns = a.n - unit.c0 < width ? a.n - unit.c0 : width;
  unit.k_begin = split * a.split_rows;
  unit.k_end = a.k < unit.k_begin + a.split_rows ? a.k : unit.k_begin + a.split_rows;
  unit.out = (split == 0 ? a.y : a.partial + static_cast<size_t>(split - 1) * a.m * a.n) + unit.c0;
  return unit;
}

// The units of a float32 product (its column spans or blocks, and splits of K) for `threads` threads.
// Returns the splits.
int PlanF32(F32Product* a, int threads);

}  // namespace xlagen

#endif  // XLAGEN_NATIVE_F32_PRODUCT_H_
