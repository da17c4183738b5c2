// Products with packed weights, y[M, N] = x[M, K] @ W, W read in a narrower format and widened in registers;
// the arithmetic is float32.
//
// bfloat16: XLA's own dot upcasts bfloat16 weights to a float32 copy before multiplying, which reads more than
// float32 weights do; this product widens each 64-byte load in registers (a bfloat16 is the top half of a
// float32) and multiplies in float32, so it reads half the bytes of float32 weights and computes exactly
// x @ float32(W). Layout: panels of kPanel = 32 output columns, panel p holding rows 0..K-1 of columns
// 32p..32p+31 contiguously: words[p][k][j] (uint32) = bf16(W[k, 32p + j]) | bf16(W[k, 32p + 16 + j]) << 16,
// j in 0..15. Columns past N are zero. One 64-byte load gives 16 words: shifting left by 16 yields the float32
// values of columns 32p..32p+15, masking the low half yields those of columns 32p+16..32p+31.
//
// int8: W quantized to int8 with one float32 scale per output column, in panels of kInt8Panel = 64 columns
// followed by their scales (see RunInt8Panels): a quarter of float32's bytes.

#include <immintrin.h>

#include "kernels.h"
#include "pool.h"

namespace xlagen {
namespace {

constexpr int kRows = 8;  // rows of x per pass over a bfloat16 panel (2 * kRows accumulators stay in registers)

struct Product {
  const float* x;
  const uint32_t* w;
  float* y;
  int m, k, n, panels;
};

// y for R rows of x from m0 and one panel (lo: its first 16 columns, hi: the next 16), over all of K. R is
// a compile-time count, so the 2 R sums stay in registers (with a run-time count GCC kept the sums of
// rows past the first on the stack: GPT-2-small's products took 1.15x as long at 4 rows, 1.22x at 8).
template <int R>
inline void Bf16Tile(const Product& a, const uint32_t* w, int m0, int c0, int nl, int nh) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  const float* x = a.x + static_cast<size_t>(m0) * a.k;
  // Unrolled: one row of x alone was 4-8 % slower than the former run-time-count loop (which GCC unrolled).
#pragma GCC unroll 4
  for (int kk = 0; kk < a.k; ++kk) {
    const __m512i words = _mm512_loadu_si512(w + static_cast<size_t>(kk) * 16);
    const __m512 wl = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    const __m512 wh = _mm512_castsi512_ps(_mm512_and_si512(words, high));
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(x[static_cast<size_t>(i) * a.k + kk]);
      lo[i] = _mm512_fmadd_ps(xv, wl, lo[i]);
      hi[i] = _mm512_fmadd_ps(xv, wh, hi[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float* y = a.y + static_cast<size_t>(m0 + i) * a.n + c0;
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nl) - 1), lo[i]);
    if (nh) _mm512_mask_storeu_ps(y + 16, static_cast<__mmask16>((1u << nh) - 1), hi[i]);
  }
}

void RunPanels(const void* args, int p0, int p1) {
  const Product& a = *static_cast<const Product*>(args);
  // Panels outside, blocks of rows inside: a panel (K * 64 bytes) comes from memory once and stays in the
  // core's cache for the other blocks, so the weights are streamed once whatever the number of rows.
  for (int p = p0; p < p1; ++p) {
    const uint32_t* w = a.w + static_cast<size_t>(p) * a.k * 16;
    const int c0 = p * kPanel;
    const int nl = a.n - c0 < 16 ? a.n - c0 : 16;
    int nh = a.n - c0 - 16;
    nh = nh < 0 ? 0 : (nh > 16 ? 16 : nh);
    int m0 = 0;
    for (; m0 + kRows <= a.m; m0 += kRows) Bf16Tile<kRows>(a, w, m0, c0, nl, nh);
    switch (a.m - m0) {
      case 7: Bf16Tile<7>(a, w, m0, c0, nl, nh); break;
      case 6: Bf16Tile<6>(a, w, m0, c0, nl, nh); break;
      case 5: Bf16Tile<5>(a, w, m0, c0, nl, nh); break;
      case 4: Bf16Tile<4>(a, w, m0, c0, nl, nh); break;
      case 3: Bf16Tile<3>(a, w, m0, c0, nl, nh); break;
      case 2: Bf16Tile<2>(a, w, m0, c0, nl, nh); break;
      case 1: Bf16Tile<1>(a, w, m0, c0, nl, nh); break;
      default: break;
    }
  }
}

// The int8 product reads W stored as int8 with one float32 scale per output column, in panels of 64
// columns: panel p holds rows 0..K-1 of columns 64p..64p+63 (64 bytes per row), then the 64 columns'
// scales (4 more rows' worth). A row is one 64-byte load, widened 16 weights at a time in registers
// (sign-extend, convert) and multiplied in float32; the panel's sums are multiplied by the scales once at
// the end, so y = (x @ Q) * s, which is x @ (Q * s) up to rounding.
constexpr int kInt8Rows = 4;    // rows of x per pass over a panel (16 accumulators)

struct Int8Product {
  const float* x;
  const int8_t* w;
  float* y;
  int m, k, n, panels;
};

template <int R>
inline void Int8Tile(const Int8Product& a, const int8_t* w, const float* scales, int m0, int c0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  const float* x = a.x + static_cast<size_t>(m0) * a.k;
  for (int kk = 0; kk < a.k; ++kk) {
    const int8_t* row = w + static_cast<size_t>(kk) * kInt8Panel;
    __m512 wv[4];
    for (int g = 0; g < 4; ++g) {
      wv[g] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g))));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[static_cast<size_t>(r) * a.k + kk]);
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_fmadd_ps(xv, wv[g], acc[r][g]);
    }
  }
  const int columns = a.n - c0 < kInt8Panel ? a.n - c0 : kInt8Panel;
  for (int g = 0; g < 4; ++g) {
    const int left = columns - 16 * g;
    if (left <= 0) break;
    const __m512 s = _mm512_loadu_ps(scales + 16 * g);
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(a.y + static_cast<size_t>(m0 + r) * a.n + c0 + 16 * g, mask, _mm512_mul_ps(acc[r][g], s));
    }
  }
}

void RunInt8Panels(const void* args, int p0, int p1) {
  const Int8Product& a = *static_cast<const Int8Product*>(args);
  // As RunPanels: a panel comes from memory once and stays in the core's cache for the other row blocks.
  for (int p = p0; p < p1; ++p) {
    const int8_t* w = a.w + static_cast<size_t>(p) * (a.k + 4) * kInt8Panel;
    const float* scales = reinterpret_cast<const float*>(w + static_cast<size_t>(a.k) * kInt8Panel);
    const int c0 = p * kInt8Panel;
    int m0 = 0;
    for (; m0 + kInt8Rows <= a.m; m0 += kInt8Rows) Int8Tile<kInt8Rows>(a, w, scales, m0, c0);
    switch (a.m - m0) {
      case 3: Int8Tile<3>(a, w, scales, m0, c0); break;
      case 2: Int8Tile<2>(a, w, scales, m0, c0); break;
      case 1: Int8Tile<1>(a, w, scales, m0, c0); break;
      default: break;
    }
  }
}

}  // namespace
}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_bf16_product(const float* x, const uint32_t* w, float* y, int m, int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_bf16_product: m, k and n must be at least 1";
  Product a{x, w, y, m, k, n, (n + kPanel - 1) / kPanel};
  GetPool().Run(Task{&a, RunPanels, a.panels});
  return nullptr;
}

extern "C" const char* xlagen_int8_product(const float* x, const int8_t* w, float* y, int m, int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_int8_product: m, k and n must be at least 1";
  Int8Product a{x, w, y, m, k, n, (n + kInt8Panel - 1) / kInt8Panel};
  GetPool().Run(Task{&a, RunInt8Panels, a.panels});
  return nullptr;
}
