// Products with packed weights, y[M, N] = x[M, K] @ W, W read in a narrower format and widened in registers;
// the arithmetic is float32, except in the int8 x int8 products (below), which sum in int32 on vectors or, in
// the build with AMX (-mamx-int8), on tile registers.
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
//
// With AVX2's 8 lanes, a panel is read in passes over its row's halves (see RunPanels, RunInt8Panels); the
// layouts are the same for both instruction sets.

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// The build with AMX (-mamx-tile -mamx-int8 -mamx-bf16 -mavx512bf16, build.py's "avx512amx").
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define XLAGEN_AMX 1
#else
#define XLAGEN_AMX 0
#endif

#if XLAGEN_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"
#include "pool.h"
#include "simd.h"

namespace xlagen {
namespace {

// Rows of x per pass over a bfloat16 panel: 2 kRows accumulators stay in registers (of 32 with AVX-512, 16
// with AVX2).
constexpr int kRows = kAvx512 ? 8 : 4;
// The 16 words of a panel's row are read kLanes at a time: word w of pass h is columns 32p + kLanes h + w
// (low halves) and 32p + 16 + kLanes h + w (high halves).
constexpr int kWordPasses = 16 / kLanes;

struct Product {
  const float* x;
  const uint32_t* w;
  float* y;
  int m, k, n, panels;
};

// y for R rows of x from m0 and one panel's pass h (lo: kLanes of its first 16 columns from kLanes h, hi: the
// same of the next 16), over all of K; nl and nh of those 16 + 16 columns are within y. R is a compile-time
// count, so the 2 R sums stay in registers (with a run-time count GCC kept the sums of rows past the first
// on the stack: GPT-2-small's products took 1.15x as long at 4 rows, 1.22x at 8).
template <int R>
inline void Bf16Tile(const Product& a, const uint32_t* w, int m0, int c0, int nl, int nh, int h) {
  Vec lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = Zero();
  const float* x = a.x + static_cast<size_t>(m0) * a.k;
  w += kLanes * h;
  // Unrolled: one row of x alone was 4-8 % slower than the former run-time-count loop (which GCC unrolled).
#pragma GCC unroll 4
  for (int kk = 0; kk < a.k; ++kk) {
    const Words words = LoadWords(w + static_cast<size_t>(kk) * 16);
    const Vec wl = LowHalves(words);
    const Vec wh = HighHalves(words);
    for (int i = 0; i < R; ++i) {
      const Vec xv = Set(x[static_cast<size_t>(i) * a.k + kk]);
      lo[i] = Fma(xv, wl, lo[i]);
      hi[i] = Fma(xv, wh, hi[i]);
    }
  }
  const int lanes_lo = nl - kLanes * h, lanes_hi = nh - kLanes * h;
  for (int i = 0; i < R; ++i) {
    float* y = a.y + static_cast<size_t>(m0 + i) * a.n + c0 + kLanes * h;
    if (lanes_lo > 0) StoreFirst(y, lo[i], lanes_lo < kLanes ? lanes_lo : kLanes);
    if (lanes_hi > 0) StoreFirst(y + 16, hi[i], lanes_hi < kLanes ? lanes_hi : kLanes);
  }
}

void RunPanels(const void* args, int p0, int p1) {
  const Product& a = *static_cast<const Product*>(args);
  // Panels outside, blocks of rows inside: a panel (K * 64 bytes) comes from memory once and stays in the
  // core's cache for the other blocks (and passes), so the weights are streamed once whatever the number of
  // rows.
  for (int p = p0; p < p1; ++p) {
    const uint32_t* w = a.w + static_cast<size_t>(p) * a.k * 16;
    const int c0 = p * kPanel;
    const int nl = a.n - c0 < 16 ? a.n - c0 : 16;
    int nh = a.n - c0 - 16;
    nh = nh < 0 ? 0 : (nh > 16 ? 16 : nh);
    for (int h = 0; h < kWordPasses && kLanes * h < nl; ++h) {
      int m0 = 0;
      for (; m0 + kRows <= a.m; m0 += kRows) Bf16Tile<kRows>(a, w, m0, c0, nl, nh, h);
      ForRows<kRows - 1>(a.m - m0, [&](auto rows) { Bf16Tile<decltype(rows)::value>(a, w, m0, c0, nl, nh, h); });
    }
  }
}

// The int8 product reads W stored as int8 with one float32 scale per output column, in panels of 64
// columns: panel p holds rows 0..K-1 of columns 64p..64p+63 (64 bytes per row), then the 64 columns'
// scales (4 more rows' worth). A row is one 64-byte load, widened 16 weights at a time in registers
// (sign-extend, convert) and multiplied in float32; the panel's sums are multiplied by the scales once at
// the end, so y = (x @ Q) * s, which is x @ (Q * s) up to rounding.
// Rows of x per pass over a panel's kInt8Vectors vectors of columns (AVX-512: the whole panel, 16
// accumulators; AVX2: half of it, 8 accumulators, the passes over the two halves reading it once from memory).
constexpr int kInt8Rows = kAvx512 ? 4 : 2;
constexpr int kInt8Vectors = 4;
constexpr int kInt8Passes = kInt8Panel / (kLanes * kInt8Vectors);

struct Int8Product {
  const float* x;
  const int8_t* w;
  float* y;
  int m, k, n, panels;
};

// y for R rows of x from m0 and the panel's columns c0 + 4 kLanes h ... (pass h), over all of K.
template <int R>
inline void Int8Tile(const Int8Product& a, const int8_t* w, const float* scales, int m0, int c0, int h) {
  constexpr int G = kInt8Vectors;
  Vec acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = Zero();
  const float* x = a.x + static_cast<size_t>(m0) * a.k;
  w += kLanes * G * h;
  scales += kLanes * G * h;
  for (int kk = 0; kk < a.k; ++kk) {
    const int8_t* row = w + static_cast<size_t>(kk) * kInt8Panel;
    Vec wv[G];
    for (int g = 0; g < G; ++g) wv[g] = LoadInt8(row + kLanes * g);
    for (int r = 0; r < R; ++r) {
      const Vec xv = Set(x[static_cast<size_t>(r) * a.k + kk]);
      for (int g = 0; g < G; ++g) acc[r][g] = Fma(xv, wv[g], acc[r][g]);
    }
  }
  const int columns = (a.n - c0 < kInt8Panel ? a.n - c0 : kInt8Panel) - kLanes * G * h;
  for (int g = 0; g < G; ++g) {
    const int left = columns - kLanes * g;
    if (left <= 0) break;
    const Vec s = Load(scales + kLanes * g);
    for (int r = 0; r < R; ++r) {
      StoreFirst(a.y + static_cast<size_t>(m0 + r) * a.n + c0 + kLanes * (G * h + g), Mul(acc[r][g], s),
                 left < kLanes ? left : kLanes);
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
    for (int h = 0; h < kInt8Passes && c0 + kLanes * kInt8Vectors * h < a.n; ++h) {
      int m0 = 0;
      for (; m0 + kInt8Rows <= a.m; m0 += kInt8Rows) Int8Tile<kInt8Rows>(a, w, scales, m0, c0, h);
      ForRows<kInt8Rows - 1>(a.m - m0, [&](auto rows) { Int8Tile<decltype(rows)::value>(a, w, scales, m0, c0, h); });
    }
  }
}

// The integer products of int8 weights. The weights are the int8 panels as packed (pack_int8); each worker
// rewrites the panel it takes into quads, quads[q][c][j] = Q[4q + j, c] (rows past K zero), so that one
// 32-byte load holds 4 rows of 8 columns, the 4 bytes a DotQuads or DotUnsigned multiplies by 4 of a row of
// quantized x, Xq [M, Kq] (K rounded up to a multiple of 4). The int32 sums are exact; one float32 multiply
// by the row's and the column's scales ends.
//
// 8-bit (xlagen_int8_integer_product, few rows: batch decoding): y = (Xq @ Q) * (sx x s), each row of x
// quantized symmetrically (Xq = round(x / sx), sx = max |x[r, :]| / 127: no zero point, so no correction by
// the columns' sums, and the operands stay within -127..127, which DotQuads needs; 4 instructions per 32
// multiply-adds without VNNI).
//
// 7-bit (xlagen_int8_many_integer_product, many rows: prompts, encoders): y = (Xq - zx) @ Q * (sx x s), each
// row quantized to 7 bits with a zero point (Xq = round(x / sx) + zx, sx = (max(x, 0) - min(x, 0)) / 126,
// zx = round(-min(x, 0) / sx), so that 0 is exact; 126 steps, not 127, so that rounding zx never pushes the
// row's largest value past 127, and every value is within sx / 2): bytes of 0..127 are what maddubs takes
// unsigned without saturating (DotUnsigned), 3 instructions per 32 multiply-adds, for the price of one bit
// of the activations (half that where a row is one-signed, as after GELU or ReLU). The quads' pass also sums
// each column of Q, and zx times those sums is taken off the row's sums.
constexpr int kIntRows = kAvx512 ? 8 : 4;                       // 8-bit: rows of x per tile (kIntVectors each)
constexpr int kIntVectors = 2;                                  // 8-bit: vectors of 8 columns per tile
constexpr int kSevenRows = kAvx512 ? 6 : 3;                     // 7-bit: rows of x per tile
constexpr int kSevenVectors = 4;                                // 7-bit: vectors of 8 columns per tile
constexpr int kIntRowChunk = 64;                                // rows of x per pass over a panel's tiles
constexpr long kQuantizeAlone = 32768;                          // elements of x the caller quantizes alone

struct QuantizedRows {
  const float* x;
  int8_t* q;  // 7-bit: uint8_t values 0..127
  float* scales;
  int32_t* zeros;  // 7-bit only
  int k, kq;
};

// The largest of v's 8 lanes.
inline float Largest(__m256 v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

// Xq and sx for rows [r0, r1) of x, 8-bit: Xq = round(x * (127 / max |x|)), ties to even; a row of zeros
// gives Xq = 0, sx = 0.
void QuantizeRows(const void* args, int r0, int r1) {
  const QuantizedRows& a = *static_cast<const QuantizedRows*>(args);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = r0; r < r1; ++r) {
    const float* x = a.x + static_cast<size_t>(r) * a.k;
    int8_t* q = a.q + static_cast<size_t>(r) * a.kq;
    __m256 peak = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= a.k; i += 8) peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float top = Largest(peak);
    for (; i < a.k; ++i) top = std::fmax(top, std::fabs(x[i]));
    const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
    a.scales[r] = top / 127.0f;
    const __m256 factor = _mm256_set1_ps(inverse);
    i = 0;
    for (; i + 32 <= a.k; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), factor));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    for (; i < a.k; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
    for (; i < a.kq; ++i) q[i] = 0;
  }
}

// Xq, sx and zx for rows [r0, r1) of x, 7-bit with a zero point (above), ties to even; a row of zeros gives
// Xq = 0, sx = 0, zx = 0.
void QuantizeRowsSeven(const void* args, int r0, int r1) {
  const QuantizedRows& a = *static_cast<const QuantizedRows*>(args);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i top = _mm256_set1_epi8(127);
  for (int r = r0; r < r1; ++r) {
    const float* x = a.x + static_cast<size_t>(r) * a.k;
    uint8_t* q = reinterpret_cast<uint8_t*>(a.q) + static_cast<size_t>(r) * a.kq;
    __m256 high = _mm256_setzero_ps(), low = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= a.k; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      high = _mm256_max_ps(high, v);
      low = _mm256_min_ps(low, v);
    }
    float largest = Largest(high), smallest = -Largest(_mm256_sub_ps(_mm256_setzero_ps(), low));
    for (; i < a.k; ++i) {
      largest = std::fmax(largest, x[i]);
      smallest = std::fmin(smallest, x[i]);
    }
    const float range = largest - smallest;
    const float inverse = range > 0.0f ? 126.0f / range : 0.0f;
    const int32_t zero = static_cast<int32_t>(std::nearbyint(-smallest * inverse));
    a.scales[r] = range / 126.0f;
    a.zeros[r] = zero;
    const __m256 factor = _mm256_set1_ps(inverse);
    const __m256i offset = _mm256_set1_epi32(zero);
    i = 0;
    for (; i + 32 <= a.k; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), factor)), offset);
      }
      const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                          _mm256_min_epu8(_mm256_permutevar8x32_epi32(bytes, order), top));
    }
    for (; i < a.k; ++i) {
      const int32_t u = static_cast<int32_t>(std::nearbyint(x[i] * inverse)) + zero;
      q[i] = static_cast<uint8_t>(u < 0 ? 0 : u > 127 ? 127 : u);
    }
    for (; i < a.kq; ++i) q[i] = 0;
  }
}

struct IntegerProduct {
  const int8_t* xq;
  const float* xs;
  const int32_t* xz;  // 7-bit only
  const int8_t* w;
  float* y;
  int m, k, n, kq;
  const float* bias;      // [n], added to y (y + b, the float32 add of a separate one); or null
  int activation;         // then applied (Activation; 7-bit only)
  const float* residual;  // [m, n], then added (Epilogue8; 7-bit only); or null
};

// A panel's rows (64 bytes each, K of them) -> quads [Kq / 4][64][4], and, if `sums`, sums[c] = the sum of
// Q[:, c]. 32 columns at a time: the byte and word interleaves work within 128-bit halves (columns 0-15 and
// 16-31), which the last step puts in order. `tiled` (AMX's operand, Kq a multiple of 64): in tiles instead,
// [Kq / 64][4][16][16][4], a tile's 16 quads of 16 columns contiguous (1024 bytes).
void Quads(const int8_t* panel, int k, int kq, int8_t* quads, int32_t* sums, bool tiled = false) {
  const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi8(1);
  __m256i totals[kInt8Panel / 8];
  for (auto& total : totals) total = zero;
  for (int q = 0; q < kq / 4; ++q) {
    for (int c = 0; c < kInt8Panel; c += 32) {
      __m256i rows[4];
      for (int j = 0; j < 4; ++j) {
        const int kk = 4 * q + j;
        rows[j] = kk < k ? LoadInts(panel + static_cast<size_t>(kk) * kInt8Panel + c) : zero;
      }
      const __m256i t0 = _mm256_unpacklo_epi8(rows[0], rows[1]), t1 = _mm256_unpackhi_epi8(rows[0], rows[1]);
      const __m256i t2 = _mm256_unpacklo_epi8(rows[2], rows[3]), t3 = _mm256_unpackhi_epi8(rows[2], rows[3]);
      // columns 0-3 | 16-19, 4-7 | 20-23, 8-11 | 24-27, 12-15 | 28-31
      const __m256i o0 = _mm256_unpacklo_epi16(t0, t2), o1 = _mm256_unpackhi_epi16(t0, t2);
      const __m256i o2 = _mm256_unpacklo_epi16(t1, t3), o3 = _mm256_unpackhi_epi16(t1, t3);
      const __m256i out[4] = {_mm256_permute2x128_si256(o0, o1, 0x20), _mm256_permute2x128_si256(o2, o3, 0x20),
                              _mm256_permute2x128_si256(o0, o1, 0x31), _mm256_permute2x128_si256(o2, o3, 0x31)};
      int8_t* to = quads + static_cast<size_t>(q) * 4 * kInt8Panel + 4 * c;
      if (tiled) to = quads + (static_cast<size_t>(q / 16) * 4 + c / 16) * 1024 + (q % 16) * 64;
      for (int v = 0; v < 4; ++v) {  // columns c + 8 v .. c + 8 v + 7
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + (tiled ? (v / 2) * 1024 + (v % 2) * 32 : 32 * v)), out[v]);
        if (sums != nullptr) totals[c / 8 + v] = DotUnsigned(totals[c / 8 + v], ones, out[v]);
      }
    }
  }
  if (sums == nullptr) return;
  for (int v = 0; v < kInt8Panel / 8; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + 8 * v), totals[v]);
}

// The int32 sums of R rows of Xq (kq bytes apart) from x by G vectors of 8 columns of quads from w (4 x
// kInt8Panel bytes per quad of rows), 8-bit or 7-bit.
template <bool kSeven, int R, int G>
void TileSums(const int8_t* x, int kq, const int8_t* w, Ints (&sums)[R][G]) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) sums[r][g] = ZeroInts();
  for (int q = 0; q < kq / 4; ++q) {
    const int8_t* row = w + static_cast<size_t>(q) * 4 * kInt8Panel;
    Ints wv[G], magnitudes[G];
    for (int g = 0; g < G; ++g) {
      wv[g] = LoadInts(row + 32 * g);
      if constexpr (!kSeven) magnitudes[g] = Magnitudes(wv[g]);
    }
    for (int r = 0; r < R; ++r) {
      const Ints xv = BroadcastQuad(x + static_cast<size_t>(r) * kq + 4 * q);
      for (int g = 0; g < G; ++g) {
        if constexpr (kSeven) {
          sums[r][g] = DotUnsigned(sums[r][g], xv, wv[g]);
        } else {
          sums[r][g] = DotQuads(sums[r][g], wv[g], magnitudes[g], xv);
        }
      }
    }
  }
}

#if !defined(__AVX512F__)
// AVX2's whole 7-bit tile, 3 rows by 4 vectors: the 12 sums, the ones and 3 scratch registers are all 16 of
// AVX2's registers. The loop's body is written in assembly: from the same code in C++, GCC 12 kept most of
// the sums on the stack, at about half the speed.
static_assert(kSevenRows == 3 && kSevenVectors == 4, "the assembly below is a tile of 3 rows by 4 vectors");
template <>
void TileSums<true, 3, 4>(const int8_t* x, int kq, const int8_t* w, Ints (&sums)[3][4]) {
  Ints a00 = ZeroInts(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  Ints a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  const Ints ones = _mm256_set1_epi16(1);
  const long stride = kq;
  for (int q = 0; q < kq / 4; ++q, x += 4, w += 4 * kInt8Panel) {
    // A row: broadcast its 4 bytes, then per vector of weights (a memory operand) maddubs, madd and add.
#define XLAGEN_ROW(address, s0, s1, s2, s3)                \
  "vpbroadcastd " address ", %%ymm13\n\t"                  \
  "vpmaddubsw (%[w]), %%ymm13, %%ymm14\n\t"                \
  "vpmaddubsw 32(%[w]), %%ymm13, %%ymm15\n\t"              \
  "vpmaddwd %[ones], %%ymm14, %%ymm14\n\t"                 \
  "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"                 \
  "vpaddd %%ymm14, %[" s0 "], %[" s0 "]\n\t"               \
  "vpaddd %%ymm15, %[" s1 "], %[" s1 "]\n\t"               \
  "vpmaddubsw 64(%[w]), %%ymm13, %%ymm14\n\t"              \
  "vpmaddubsw 96(%[w]), %%ymm13, %%ymm15\n\t"              \
  "vpmaddwd %[ones], %%ymm14, %%ymm14\n\t"                 \
  "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"                 \
  "vpaddd %%ymm14, %[" s2 "], %[" s2 "]\n\t"               \
  "vpaddd %%ymm15, %[" s3 "], %[" s3 "]\n\t"
    asm(XLAGEN_ROW("(%[x])", "a00", "a01", "a02", "a03")
        XLAGEN_ROW("(%[x],%[stride],1)", "a10", "a11", "a12", "a13")
        XLAGEN_ROW("(%[x],%[stride],2)", "a20", "a21", "a22", "a23")
        : [a00] "+x"(a00), [a01] "+x"(a01), [a02] "+x"(a02), [a03] "+x"(a03), [a10] "+x"(a10), [a11] "+x"(a11),
          [a12] "+x"(a12), [a13] "+x"(a13), [a20] "+x"(a20), [a21] "+x"(a21), [a22] "+x"(a22), [a23] "+x"(a23)
        : [x] "r"(x), [stride] "r"(stride), [w] "r"(w), [ones] "x"(ones)
        : "xmm13", "xmm14", "xmm15", "memory");
#undef XLAGEN_ROW
  }
  sums[0][0] = a00, sums[0][1] = a01, sums[0][2] = a02, sums[0][3] = a03;
  sums[1][0] = a10, sums[1][1] = a11, sums[1][2] = a12, sums[1][3] = a13;
  sums[2][0] = a20, sums[2][1] = a21, sums[2][2] = a22, sums[2][3] = a23;
}
#endif

// y for R rows of x from m0 and the panel's columns c0 + 8 G h ... c0 + 8 G (h + 1) - 1 (pass h), over all
// of Kq; `column_sums` (7-bit only) those of the panel's columns.
template <bool kSeven, int R, int G>
inline void IntegerTile(const IntegerProduct& a, const int8_t* quads, const int32_t* column_sums,
                        const float* scales, int m0, int c0, int h) {
  Ints acc[R][G];
  TileSums<kSeven, R, G>(a.xq + static_cast<size_t>(m0) * a.kq, a.kq, quads + 4 * 8 * G * h, acc);
  const int columns = (a.n - c0 < kInt8Panel ? a.n - c0 : kInt8Panel) - 8 * G * h;
  for (int g = 0; g < G; ++g) {
    const int left = columns - 8 * g;
    if (left <= 0) break;
    const int j = 8 * (G * h + g);
    const __m256 s = _mm256_loadu_ps(scales + j);
    for (int r = 0; r < R; ++r) {
      Ints sums = acc[r][g];
      if constexpr (kSeven) {
        sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(_mm256_set1_epi32(a.xz[m0 + r]), LoadInts(column_sums + j)));
      }
      const __m256 factor = _mm256_mul_ps(_mm256_set1_ps(a.xs[m0 + r]), s);
      StoreFirst8(a.y + static_cast<size_t>(m0 + r) * a.n + c0 + j,
                  Epilogue8(_mm256_mul_ps(IntsToFloats(sums), factor), a.bias ? a.bias + c0 + j : nullptr, left,
                            a.activation,
                            a.residual ? a.residual + static_cast<size_t>(m0 + r) * a.n + c0 + j : nullptr),
                  left);
    }
  }
}

template <bool kSeven>
void RunIntegerPanels(const void* args, int p0, int p1) {
  constexpr int R = kSeven ? kSevenRows : kIntRows, G = kSeven ? kSevenVectors : kIntVectors;
  constexpr int kChunk = kIntRowChunk / R * R;
  const IntegerProduct& a = *static_cast<const IntegerProduct*>(args);
  thread_local std::vector<int8_t> quads;
  quads.resize(static_cast<size_t>(a.kq) * kInt8Panel);
  int32_t column_sums[kInt8Panel];
  for (int p = p0; p < p1; ++p) {
    const int8_t* w = a.w + static_cast<size_t>(p) * (a.k + 4) * kInt8Panel;
    const float* scales = reinterpret_cast<const float*>(w + static_cast<size_t>(a.k) * kInt8Panel);
    const int c0 = p * kInt8Panel;
    Quads(w, a.k, a.kq, quads.data(), kSeven ? column_sums : nullptr);
    // Chunks of rows outside, the panel's passes inside: the chunk's rows of Xq stay in the core's cache.
    for (int r0 = 0; r0 < a.m; r0 += kChunk) {
      const int r1 = a.m - r0 < kChunk ? a.m : r0 + kChunk;
      for (int h = 0; h < kInt8Panel / (8 * G) && c0 + 8 * G * h < a.n; ++h) {
        int m0 = r0;
        // Whole tiles, except that one row left over takes one of the last tile's: 4 rows as 2 + 2, not
        // 3 + 1 (a tile of one row reads the weights for few multiply-adds).
        const int last = (r1 - r0) % R == 1 && r1 - r0 > R ? r1 - R - 1 : r1;
        for (; m0 + R <= last; m0 += R) IntegerTile<kSeven, R, G>(a, quads.data(), column_sums, scales, m0, c0, h);
        if (last < r1) {
          IntegerTile<kSeven, (R + 1) / 2, G>(a, quads.data(), column_sums, scales, m0, c0, h);
          m0 += (R + 1) / 2;
        }
        ForRows<R - 1>(r1 - m0, [&](auto rows) {
          IntegerTile<kSeven, decltype(rows)::value, G>(a, quads.data(), column_sums, scales, m0, c0, h);
        });
      }
    }
  }
}

constexpr int kAmxRows = 32;  // rows of x per block of the tile products (below): 2 tiles of 16

#if XLAGEN_AMX
// AMX (Intel's tile registers): the 7-bit product as TDPBUSD, 16 rows of Xq (unsigned bytes, 64 of K) by 16
// columns of quads (16 quads of K, signed) added into 16 x 16 int32 sums, 16,384 multiply-adds per
// instruction; and bfloat16 weights' many-row product (xlagen_bf16_tile_product) as TDPBF16PS, y = bf16(x) @ W,
// each element of x rounded to bfloat16 (to nearest, ties to even), a pair's two products exact and added
// into float32 sums, 16 x 16 x 32 multiply-adds per instruction.
//
// Both run blocks of 32 rows by 32 columns: tiles 0-3 hold the block's sums (rows r0 + 16 i by columns
// c0 + 16 j), 4 and 5 two tiles of x, 6 and 7 two of the weights. x goes into tile order first (a tile's
// 16 rows of 64 bytes contiguous: rows rounded up to kAmxRows and K to a tile's depth, zeros past the ends,
// whose sums are never stored); each panel of weights is rewritten per call as the operand a tile of
// columns takes: int8 quads[q][c] (Quads above), bfloat16 pairs[q][c] = bf16 W[2q, c] | bf16 W[2q + 1, c] <<
// 16 (Bf16Pairs). K runs in chunks (TileChunks) whose x of all rows stays in the core's L2 cache while the
// panels pass over it; between chunks a block's sums wait in a buffer. The int8 sums are exact, as with
// vectors, and the end is the same float32 arithmetic, so both give the same y.
//
// Linux hands out the tiles' register state (8 KB per thread) only to a process that asked for it
// (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 and later); without it a tile instruction is fatal, so where
// the request is refused the 7-bit product runs on vectors and the bfloat16 one refuses. A thread loads
// the tiles' configuration for each stretch of panels it takes and releases the tiles after it (another
// library on the thread may use them in between).
constexpr int kTileBytes = 1024;            // one tile: 16 rows of 64 bytes
constexpr long kChunkBytes = 768 * 1024;    // bytes of x in tile order per chunk of K, at most
constexpr int kChunkSteps = 24;             // steps of K per chunk, at most: a block's weights (2 KB a step) near the core

bool AmxGranted() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM (asm/prctl.h)
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// The LDTILECFG operand: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t row_bytes[16] = {};
  uint8_t rows[16] = {};
};

void LoadTileConfig() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.row_bytes[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// Tiles 0-3 (a block's 32 x 32 sums of 4 bytes) from `from`, `stride` bytes a row, or zero (nullptr).
inline void StartBlock(const char* from, size_t stride) {
  if (from == nullptr) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    return;
  }
  _tile_loadd(0, from, stride);
  _tile_loadd(1, from + 64, stride);
  _tile_loadd(2, from + 16 * stride, stride);
  _tile_loadd(3, from + 16 * stride + 64, stride);
}

inline void StoreBlock(char* to, size_t stride) {
  _tile_stored(0, to, stride);
  _tile_stored(1, to + 64, stride);
  _tile_stored(2, to + 16 * stride, stride);
  _tile_stored(3, to + 16 * stride + 64, stride);
}

// `steps` steps of a tile's depth of K into tiles 0-3: x's two tiles at a (the second `next` bytes on,
// kTileBytes a step), the weights' two at b (the second kTileBytes on, `step` bytes a step).
template <bool kBf16>
inline void BlockSteps(const char* a, size_t next, const char* b, size_t step, int steps) {
  for (int s = 0; s < steps; ++s, a += kTileBytes, b += step) {
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + next, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kTileBytes, 64);
    if constexpr (kBf16) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
}

// One chunk of K of a tile product: steps [step0, step1) of the tile's depth.
struct ChunkOfK {
  int step0, step1;
  bool first, last;
};

// The chunks of K (in tiles' steps) of a tile product: as many steps as keep `rows` rows of x in tile order
// within kChunkBytes; `at(step)` is the chunk starting there.
struct TileChunks {
  int steps, per_chunk;
  TileChunks(int rows, int steps_of_k) : steps(steps_of_k) {
    long most = kChunkBytes / (static_cast<long>(rows) * 64);
    if (most > kChunkSteps) most = kChunkSteps;
    per_chunk = most < 1 ? 1 : most < steps ? static_cast<int>(most) : steps;
  }
  int count() const { return (steps + per_chunk - 1) / per_chunk; }
  ChunkOfK at(int step) const {
    const int end = step + per_chunk < steps ? step + per_chunk : steps;
    return {step, end, step == 0, end == steps};
  }
};

// Rows of x per slab of the tile products: as many as keep kChunkSteps steps of K of them in tile order within
// kChunkBytes. A longer x (Whisper's encoder at batch 8: 12,000 rows) runs slab by slab; as one, its chunks
// of K would shrink to a step each, and their partial sums of every row would go to memory and back at
// every step.
constexpr int kSlabRows = static_cast<int>(kChunkBytes / (64 * kChunkSteps));
static_assert(kSlabRows % kAmxRows == 0, "a slab holds whole blocks of rows");

// x [rows, K] (row-major, `from`, `bytes` a row) -> `to` as tiles: the 16 rows of block i and the 64 bytes of
// row from 64 j at to + (i bytes / 64 + j) kTileBytes, row r of them 64 bytes after row r - 1. Units: blocks
// of 16 rows.
struct AmxTiles {
  const int8_t* from;
  int8_t* to;
  int bytes;
};

void ToTiles(const void* args, int b0, int b1) {
  const AmxTiles& a = *static_cast<const AmxTiles*>(args);
  for (int b = b0; b < b1; ++b) {
    const int8_t* from = a.from + static_cast<size_t>(b) * 16 * a.bytes;
    int8_t* to = a.to + static_cast<size_t>(b) * 16 * a.bytes;
    for (int j = 0; j < a.bytes; j += 64) {
      for (int r = 0; r < 16; ++r) {
        _mm512_storeu_si512(to + 16 * j + 64 * r, _mm512_loadu_si512(from + static_cast<size_t>(r) * a.bytes + j));
      }
    }
  }
}

// The 7-bit product's panels (units) over one chunk of K. `partial` holds the blocks' int32 sums between
// chunks (rows x n rounded up to 64, 4 bytes each), `column_sums` the panels' column sums so far.
struct AmxIntegerChunk {
  const IntegerProduct* product;
  ChunkOfK chunk;
  int32_t* partial;
  int32_t* column_sums;
  int columns;  // of partial and column_sums: n rounded up to kInt8Panel
};

void RunAmxPanels(const void* args, int p0, int p1) {
  const AmxIntegerChunk& c = *static_cast<const AmxIntegerChunk*>(args);
  const IntegerProduct& a = *c.product;
  LoadTileConfig();
  const int depth = (c.chunk.step1 - c.chunk.step0) * 64;  // bytes of K in this chunk
  thread_local std::vector<int8_t> quads;
  quads.resize(static_cast<size_t>(depth) * kInt8Panel);
  int32_t chunk_sums[kInt8Panel];
  alignas(64) int32_t sums[kAmxRows][kAmxRows];
  const size_t partial_row = static_cast<size_t>(c.columns) * sizeof(int32_t);
  const int k0 = c.chunk.step0 * 64;
  for (int p = p0; p < p1; ++p) {
    const int8_t* w = a.w + static_cast<size_t>(p) * (a.k + 4) * kInt8Panel;
    const float* scales = reinterpret_cast<const float*>(w + static_cast<size_t>(a.k) * kInt8Panel);
    const int c0 = p * kInt8Panel;
    Quads(w + static_cast<size_t>(k0) * kInt8Panel, a.k - k0, depth, quads.data(), chunk_sums, true);  // k0 < K
    int32_t* totals = c.column_sums + c0;
    for (int j = 0; j < kInt8Panel; ++j) totals[j] = (c.chunk.first ? 0 : totals[j]) + chunk_sums[j];
    for (int j0 = 0; j0 < kInt8Panel && c0 + j0 < a.n; j0 += kAmxRows) {
      const char* b = reinterpret_cast<const char*>(quads.data()) + j0 / 16 * kTileBytes;
      const int columns = a.n - c0 - j0 < kAmxRows ? a.n - c0 - j0 : kAmxRows;
      for (int r0 = 0; r0 < a.m; r0 += kAmxRows) {
        char* partial = reinterpret_cast<char*>(c.partial + static_cast<size_t>(r0) * c.columns + c0 + j0);
        StartBlock(c.chunk.first ? nullptr : partial, partial_row);
        const char* x = reinterpret_cast<const char*>(a.xq) + static_cast<size_t>(r0) * a.kq + 16 * k0;
        BlockSteps<false>(x, static_cast<size_t>(16) * a.kq, b, 4 * kTileBytes, c.chunk.step1 - c.chunk.step0);
        if (!c.chunk.last) {
          StoreBlock(partial, partial_row);
          continue;
        }
        StoreBlock(reinterpret_cast<char*>(&sums[0][0]), sizeof(sums[0]));
        const int rows = a.m - r0 < kAmxRows ? a.m - r0 : kAmxRows;
        for (int r = 0; r < rows; ++r) {
          for (int g = 0; g < kAmxRows / 8 && 8 * g < columns; ++g) {
            const int j = j0 + 8 * g;
            Ints total = LoadInts(&sums[r][8 * g]);
            total = _mm256_sub_epi32(total, _mm256_mullo_epi32(_mm256_set1_epi32(a.xz[r0 + r]), LoadInts(totals + j)));
            const __m256 factor = _mm256_mul_ps(_mm256_set1_ps(a.xs[r0 + r]), _mm256_loadu_ps(scales + j));
            StoreFirst8(a.y + static_cast<size_t>(r0 + r) * a.n + c0 + j,
                        Epilogue8(_mm256_mul_ps(IntsToFloats(total), factor), a.bias ? a.bias + c0 + j : nullptr,
                                  columns - 8 * g, a.activation,
                                  a.residual ? a.residual + static_cast<size_t>(r0 + r) * a.n + c0 + j : nullptr),
                        columns - 8 * g);
          }
        }
      }
    }
  }
  _tile_release();
}

// The 7-bit product of quantized rows on the tiles: xq [rows, kq] row-major (rows a multiple of kAmxRows,
// kq of 64), xs and xz as QuantizeRowsSeven leaves them.
void RunAmxIntegerProduct(IntegerProduct a, int rows) {
  thread_local std::vector<int8_t> tiles;
  tiles.resize(static_cast<size_t>(rows) * a.kq);
  AmxTiles blocks{a.xq, tiles.data(), a.kq};
  if (static_cast<long>(rows) * a.kq <= kQuantizeAlone) {
    ToTiles(&blocks, 0, rows / 16);
  } else {
    GetPool().Run(Task{&blocks, ToTiles, rows / 16});
  }
  const int columns = (a.n + kInt8Panel - 1) / kInt8Panel * kInt8Panel;
  thread_local std::vector<int32_t> partial, column_sums;
  column_sums.resize(columns);
  for (int s0 = 0; s0 < a.m; s0 += kSlabRows) {
    IntegerProduct slab = a;
    slab.xq = tiles.data() + static_cast<size_t>(s0) * a.kq;
    slab.xs = a.xs + s0;
    slab.xz = a.xz + s0;
    slab.y = a.y + static_cast<size_t>(s0) * a.n;
    slab.residual = a.residual ? a.residual + static_cast<size_t>(s0) * a.n : nullptr;
    slab.m = a.m - s0 < kSlabRows ? a.m - s0 : kSlabRows;
    const int slab_rows = (slab.m + kAmxRows - 1) / kAmxRows * kAmxRows;
    const TileChunks chunks(slab_rows, a.kq / 64);
    if (chunks.count() > 1) partial.resize(static_cast<size_t>(slab_rows) * columns);
    for (int step = 0; step < chunks.steps; step += chunks.per_chunk) {
      AmxIntegerChunk chunk{&slab, chunks.at(step), partial.data(), column_sums.data(), columns};
      GetPool().Run(Task{&chunk, RunAmxPanels, columns / kInt8Panel});
    }
  }
}

constexpr int kBf16Depth = 32;  // bfloat16 values of K per tile (64 bytes)

struct Bf16TileProduct {
  const float* x;
  const uint32_t* w;
  uint16_t* tiles;  // x in tile order
  float* y;
  int m, k, n, kp;  // kp: K rounded up to kBf16Depth
  const float* bias;      // [n], added to y; or null
  int activation;         // then applied (Activation)
  const float* residual;  // [m, n], then added (Epilogue8); or null
};

// x's rows of blocks [b0, b1) of 16 rows, as bfloat16 in tile order: tile (b, j) at tiles + (b kp / 32 + j) 512.
void Bf16ToTiles(const void* args, int b0, int b1) {
  const Bf16TileProduct& a = *static_cast<const Bf16TileProduct*>(args);
  for (int b = b0; b < b1; ++b) {
    for (int r = 0; r < 16; ++r) {
      const int row = 16 * b + r;
      uint16_t* to = a.tiles + static_cast<size_t>(b) * 16 * a.kp + kBf16Depth * r;
      const float* x = a.x + static_cast<size_t>(row) * a.k;
      for (int j = 0; j < a.kp; j += kBf16Depth, to += 16 * kBf16Depth) {
        const int left = row < a.m ? a.k - j : 0;
        __m512 lo, hi;
        if (left >= 32) {
          lo = _mm512_loadu_ps(x + j), hi = _mm512_loadu_ps(x + j + 16);
        } else {
          lo = LoadMasked(FirstLanes(left < 16 ? (left > 0 ? left : 0) : 16), x + j);
          hi = LoadMasked(FirstLanes(left > 16 ? left - 16 : 0), x + j + 16);
        }
        const __m512bh pair = _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values first
        _mm512_storeu_si512(to, reinterpret_cast<const __m512i&>(pair));
      }
    }
  }
}

// A bfloat16 panel's words[k][16] (column j low, 16 + j high) -> pairs in tiles, [kp / 32][2][16][16]: the
// tile of step s and columns 16 t.. holds pairs[q][c] for q in 16 s.. (rows past k zero).
void Bf16Pairs(const uint32_t* panel, int k, int kp, uint32_t* pairs) {
  const __m512i low = _mm512_set1_epi32(0xFFFF), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i zero = _mm512_setzero_si512();
  for (int q = 0; q < kp / 2; ++q) {
    const __m512i first = 2 * q < k ? _mm512_loadu_si512(panel + static_cast<size_t>(2 * q) * 16) : zero;
    const __m512i second = 2 * q + 1 < k ? _mm512_loadu_si512(panel + static_cast<size_t>(2 * q + 1) * 16) : zero;
    uint32_t* to = pairs + static_cast<size_t>(q / 16) * 512 + (q % 16) * 16;
    _mm512_storeu_si512(to, _mm512_or_si512(_mm512_and_si512(first, low), _mm512_slli_epi32(second, 16)));
    _mm512_storeu_si512(to + 256, _mm512_or_si512(_mm512_srli_epi32(first, 16), _mm512_and_si512(second, high)));
  }
}

// The bfloat16 product's panels (units) over one chunk of K; `partial` as AmxIntegerChunk's (float32 sums,
// n rounded up to kPanel columns).
struct Bf16TileChunk {
  const Bf16TileProduct* product;
  ChunkOfK chunk;
  float* partial;
  int columns;
};

void RunBf16TilePanels(const void* args, int p0, int p1) {
  const Bf16TileChunk& c = *static_cast<const Bf16TileChunk*>(args);
  const Bf16TileProduct& a = *c.product;
  LoadTileConfig();
  const int depth = (c.chunk.step1 - c.chunk.step0) * kBf16Depth;  // values of K in this chunk
  const int k0 = c.chunk.step0 * kBf16Depth;
  thread_local std::vector<uint32_t> pairs;
  pairs.resize(static_cast<size_t>(depth) / 2 * kPanel);
  alignas(64) float sums[kAmxRows][kPanel];
  const size_t partial_row = static_cast<size_t>(c.columns) * sizeof(float);
  const size_t y_row = static_cast<size_t>(a.n) * sizeof(float);
  for (int p = p0; p < p1; ++p) {
    Bf16Pairs(a.w + (static_cast<size_t>(p) * a.k + k0) * 16, a.k - k0, depth, pairs.data());  // k0 < K
    const int c0 = p * kPanel;
    const int columns = a.n - c0 < kPanel ? a.n - c0 : kPanel;
    for (int r0 = 0; r0 < a.m; r0 += kAmxRows) {
      char* partial = reinterpret_cast<char*>(c.partial + static_cast<size_t>(r0) * c.columns + c0);
      StartBlock(c.chunk.first ? nullptr : partial, partial_row);
      const char* x = reinterpret_cast<const char*>(a.tiles + static_cast<size_t>(r0) * a.kp) + 32 * k0;
      BlockSteps<true>(x, static_cast<size_t>(32) * a.kp, reinterpret_cast<const char*>(pairs.data()),
                       2 * kTileBytes, c.chunk.step1 - c.chunk.step0);
      const int rows = a.m - r0 < kAmxRows ? a.m - r0 : kAmxRows;
      float* y = a.y + static_cast<size_t>(r0) * a.n + c0;
      if (!c.chunk.last) {
        StoreBlock(partial, partial_row);
      } else if (rows == kAmxRows && columns == kPanel && a.bias == nullptr && a.activation == kLinear &&
                 a.residual == nullptr) {
        StoreBlock(reinterpret_cast<char*>(y), y_row);  // the whole block, as it is: straight into y
      } else {
        StoreBlock(reinterpret_cast<char*>(&sums[0][0]), sizeof(sums[0]));
        for (int r = 0; r < rows; ++r) {
          float* row = y + static_cast<size_t>(r) * a.n;
          for (int j = 0; j < columns; j += 8) {
            StoreFirst8(row + j,
                        Epilogue8(_mm256_load_ps(&sums[r][j]), a.bias ? a.bias + c0 + j : nullptr, columns - j,
                                  a.activation,
                                  a.residual ? a.residual + static_cast<size_t>(r0 + r) * a.n + c0 + j : nullptr),
                        columns - j);
          }
        }
      }
    }
  }
  _tile_release();
}

void RunBf16TileProduct(const float* x, const uint32_t* w, const float* bias, int activation, const float* residual,
                        float* y, int m, int k, int n) {
  const int kp = (k + kBf16Depth - 1) / kBf16Depth * kBf16Depth;
  const int rows = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  thread_local std::vector<uint16_t> tiles;
  tiles.resize(static_cast<size_t>(rows) * kp);
  Bf16TileProduct a{x, w, tiles.data(), y, m, k, n, kp, bias, activation, residual};
  if (static_cast<long>(m) * k <= kQuantizeAlone) {
    Bf16ToTiles(&a, 0, rows / 16);
  } else {
    GetPool().Run(Task{&a, Bf16ToTiles, rows / 16});
  }
  const int columns = (n + kPanel - 1) / kPanel * kPanel;
  thread_local std::vector<float> partial;
  for (int s0 = 0; s0 < m; s0 += kSlabRows) {
    Bf16TileProduct slab = a;
    slab.tiles = tiles.data() + static_cast<size_t>(s0) * kp;
    slab.y = y + static_cast<size_t>(s0) * n;
    slab.residual = residual ? residual + static_cast<size_t>(s0) * n : nullptr;
    slab.m = m - s0 < kSlabRows ? m - s0 : kSlabRows;
    const int slab_rows = (slab.m + kAmxRows - 1) / kAmxRows * kAmxRows;
    const TileChunks chunks(slab_rows, kp / kBf16Depth);
    if (chunks.count() > 1) partial.resize(static_cast<size_t>(slab_rows) * columns);
    for (int step = 0; step < chunks.steps; step += chunks.per_chunk) {
      Bf16TileChunk chunk{&slab, chunks.at(step), partial.data(), columns};
      GetPool().Run(Task{&chunk, RunBf16TilePanels, columns / kPanel});
    }
  }
}
#endif

// Quantizes x's rows (by the pool unless they are few) and runs the integer product's panels on the pool.
template <bool kSeven>
void RunIntegerProduct(const float* x, const int8_t* w, const float* bias, int activation, const float* residual,
                       float* y, int m, int k, int n) {
#if XLAGEN_AMX
  const bool amx = kSeven && AmxGranted();
#else
  constexpr bool amx = false;
#endif
  const int kq = amx ? (k + 63) / 64 * 64 : (k + 3) / 4 * 4;
  const int rows = amx ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;  // tiles read whole blocks of rows
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xz;
  xq.resize(static_cast<size_t>(rows) * kq);
  if (rows > m) std::memset(xq.data() + static_cast<size_t>(m) * kq, 0, static_cast<size_t>(rows - m) * kq);
  xs.resize(m);
  xz.resize(m);
  QuantizedRows quantized{x, xq.data(), xs.data(), xz.data(), k, kq};
  void (*quantize)(const void*, int, int) = kSeven ? QuantizeRowsSeven : QuantizeRows;
  if (static_cast<long>(m) * k <= kQuantizeAlone) {
    quantize(&quantized, 0, m);  // a decoding step's few rows: not worth waking the pool
  } else {
    GetPool().Run(Task{&quantized, quantize, m});
  }
  IntegerProduct a{xq.data(), xs.data(), xz.data(), w, y, m, k, n, kq, bias, activation, residual};
#if XLAGEN_AMX
  if (amx) return RunAmxIntegerProduct(a, rows);
#endif
  void (*panels)(const void*, int, int) = RunIntegerPanels<kSeven>;
  GetPool().Run(Task{&a, panels, (n + kInt8Panel - 1) / kInt8Panel});
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

extern "C" const char* xlagen_int8_integer_product(const float* x, const int8_t* w, float* y, int m, int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_int8_integer_product: m, k and n must be at least 1";
  RunIntegerProduct<false>(x, w, nullptr, kLinear, nullptr, y, m, k, n);
  return nullptr;
}

extern "C" const char* xlagen_bf16_tile_product_epilogue(const float* x, const uint32_t* w, const float* bias,
                                                         int activation, const float* residual, float* y, int m, int k,
                                                         int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_bf16_tile_product: m, k and n must be at least 1";
  if (activation < kLinear || activation > kGeluTanh) return "xlagen_bf16_tile_product: activation must be 0, 1 or 2";
#if XLAGEN_AMX
  if (!AmxGranted()) return "xlagen_bf16_tile_product: Linux did not grant this process AMX's tiles";
  RunBf16TileProduct(x, w, bias, activation, residual, y, m, k, n);
  return nullptr;
#else
  (void)x, (void)w, (void)bias, (void)residual, (void)y;
  return "xlagen_bf16_tile_product: needs the kernels' AMX build (a CPU with amx_bf16 and amx_int8)";
#endif
}

extern "C" const char* xlagen_bf16_tile_product(const float* x, const uint32_t* w, float* y, int m, int k, int n) {
  return xlagen_bf16_tile_product_epilogue(x, w, nullptr, kLinear, nullptr, y, m, k, n);
}

extern "C" int xlagen_amx_tiles() {
#if XLAGEN_AMX
  return AmxGranted() ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" const char* xlagen_int8_many_integer_product_epilogue(const float* x, const int8_t* w, const float* bias,
                                                                 int activation, const float* residual, float* y, int m,
                                                                 int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_int8_many_integer_product: m, k and n must be at least 1";
  if (activation < kLinear || activation > kGeluTanh) {
    return "xlagen_int8_many_integer_product: activation must be 0, 1 or 2";
  }
  RunIntegerProduct<true>(x, w, bias, activation, residual, y, m, k, n);
  return nullptr;
}

extern "C" const char* xlagen_int8_many_integer_product(const float* x, const int8_t* w, float* y, int m, int k,
                                                        int n) {
  return xlagen_int8_many_integer_product_epilogue(x, w, nullptr, kLinear, nullptr, y, m, k, n);
}
