// xlagen's matrix products for XLA's CPU backend, y[M, N] = x[M, K] @ W[K, N] for the few rows of x of a
// decoding step, registered as XLA custom-call targets (status-returning API) by xlagen_register;
// xlagen/native/__init__.py builds this file with the system compiler, registers it and emits the calls.
//
// Why: a decoding step reads every weight once, so its time is the time to stream the weights from
// memory. Three targets:
//
// "xlagen_f32_matmul": float32 W as XLA stores it (row-major [K, N]), no copy and no packing. XLA's own dot
// streams a decoding step's weights more slowly than the cores can read them; this kernel reads, for up
// to sixteen rows of x (every product xlagen sends it), long runs of eight weight rows side by side (see
// RunF32Stream), and for more rows each weight row in 1 KB runs with software prefetching (RunF32Units).
//
// "xlagen_bf16_matmul": W stored as bfloat16 in a packed panel layout. XLA's own dot upcasts bfloat16
// weights to a float32 copy before multiplying, which reads more than float32 weights do; this kernel
// widens each 64-byte load in registers (a bfloat16 is the top half of a float32) and multiplies in
// float32, so it reads half the bytes of float32 weights and computes exactly x @ float32(W).
// Layout: panels of 32 output columns, panel p holding rows 0..K-1 of columns 32p..32p+31 contiguously:
// words[p][k][j] (uint32) = bf16(W[k, 32p + j]) | bf16(W[k, 32p + 16 + j]) << 16, j in 0..15.
// Columns past N are zero. One 64-byte load gives 16 words: shifting left by 16 yields the float32 values
// of columns 32p..32p+15, masking the low half yields those of columns 32p+16..32p+31.
//
// "xlagen_int8_matmul": W quantized to int8 with one float32 scale per output column, in panels of 64
// columns followed by their scales (see RunInt8Panels): a quarter of float32's bytes.
//
// The backend config (the custom call's opaque string) is "M,K,N". Work is split into units (panels, or
// column blocks) between the calling thread and the pool's workers (XLAGEN_NATIVE_THREADS, default: the
// CPUs this process may use, at most 8).
//
// Between two float32 products of a decoding step, while XLA runs the step's other operations, the idle
// workers read ahead the start of the weights they will take in the next product (see Successors).
//
// A fourth target, "xlagen_f32_attention", is not a product of weights: the whole softmax attention of a
// long encoder (see RunAttention), on the same pool; nor are the step attention, the argmax and the
// folded cross-attention over an encoder output ("xlagen_f32_memory_attention", see MemoryAttention).

#include <dlfcn.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

struct XlaCustomCallStatus_;

namespace {

constexpr int kPanel = 32;  // output columns per panel
constexpr int kRows = 8;    // rows of x per pass over a panel (2 * kRows accumulators stay in registers)
constexpr int kMaxDefaultThreads = 8;
constexpr int kDefaultSpinMicroseconds = 600;
// Bytes of the next float32 product each idle worker reads ahead, at most: they fill the core's L2 (1 MB
// here) no more than the gap between two products lets them (XLAGEN_NATIVE_LOOKAHEAD_KB, xlagen_set_lookahead).
constexpr int kDefaultLookaheadKB = 768;

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
constexpr int kInt8Panel = 64;  // output columns per int8 panel
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

// The float32 product for more than kMaxStreamM rows (the streams below take fewer) reads W [K, N] as XLA
// stores it (row-major), with no packing. A unit of work is a
// block of 256 output columns (1 KB of each weight row: shorter runs stream at half the rate here) over a
// range of K. The range is walked in chunks of 32 weight rows (32 KB, which stay in this CPU's 48 KB L1);
// every row of x is multiplied by a chunk, in register tiles (F32Tile), before the next chunk is read, so
// the weights are streamed once whatever M is. A tile loads its running sums from y and stores them back
// once per chunk: with chunks of 8 rows (and 4-row tiles at most) GPT-2-small's products took 1.2x as
// long at one row and 1.7x at eight (benchmarks/kernel_variants.py). While the first tiles
// of a chunk are multiplied they prefetch the next chunk's same columns. Narrow products (too few blocks
// for every thread) also split K; the splits' partial sums go to a scratch buffer that the calling thread
// adds up once the units are done. Only the last vector of a product's last, narrower block uses a masked
// load: this CPU runs masked 512-bit loads at a fraction of their speed (the whole kernel at 13.4 GB/s on
// one thread instead of 31.6).
constexpr int kBlock = 256;  // output columns per float32 unit
constexpr int kChunk = 32;   // weight rows per chunk

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

// acc[R rows][V vectors] += x[r0.., k0..k0+rows) @ w[k0.., 16 v0 .. 16 (v0 + V)) on a full block; y holds
// the running sums (zero when first is set).
template <int R, int V>
__attribute__((always_inline)) inline void F32Tile(const F32Product& a, const float* w, float* out, int r0, int v0,
                                                   int k0, int rows, bool first, const float* next) {
  // Two separate loops, not one with `first ? zero : load` per sum: GCC builds that one through the stack.
  __m512 acc[R][V];
  if (first) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  } else {
    for (int r = 0; r < R; ++r) {
      const float* y = out + static_cast<size_t>(r0 + r) * a.n + 16 * v0;
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(y + 16 * v);
    }
  }
  const float* x = a.x + static_cast<size_t>(r0) * a.k + k0;
  for (int kk = 0; kk < rows; ++kk) {
    const float* row = w + static_cast<size_t>(kk) * a.n + 16 * v0;
    if (next != nullptr) {
      const float* ahead = next + static_cast<size_t>(kk) * a.n + 16 * v0;
      for (int v = 0; v < V; ++v) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * v), _MM_HINT_T0);
    }
    __m512 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(row + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[static_cast<size_t>(r) * a.k + kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = out + static_cast<size_t>(r0 + r) * a.n + 16 * v0;
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + 16 * v, acc[r][v]);
  }
}

// Row r's vectors v.. of a narrow block, `whole` of them complete: tiles of V, V / 2, ..., 1 vectors.
// Returns the first vector left (the partial one, if any).
template <int V>
int F32WholeVectors(const F32Product& a, const float* w, float* out, int r, int v, int whole, int k0, int rows,
                    bool first) {
  if (whole - v >= V) {
    F32Tile<1, V>(a, w, out, r, v, k0, rows, first, nullptr);
    v += V;
  }
  if constexpr (V > 1) return F32WholeVectors<V / 2>(a, w, out, r, v, whole, k0, rows, first);
  return v;
}

void RunF32Units(const void* args, int u0, int u1) {
  const F32Product& a = *static_cast<const F32Product*>(args);
  for (int u = u0; u < u1; ++u) {
    const Unit unit = UnitOf(a, u, kBlock);
    const int c0 = unit.c0, k_begin = unit.k_begin, k_end = unit.k_end;
    float* out = unit.out;
    const bool full = unit.columns == kBlock;
    for (int k0 = k_begin; k0 < k_end; k0 += kChunk) {
      const int rows = k_end - k0 < kChunk ? k_end - k0 : kChunk;
      const float* w = a.w + static_cast<size_t>(k0) * a.n + c0;
      const bool first = k0 == k_begin;
      // The tiles of the first rows of x ask for the same columns of the next chunk, spread over the pass
      // (asking for all 8 x 16 lines at the start of a chunk was no faster than not prefetching at 8 rows).
      const float* next = k0 + 2 * kChunk <= k_end ? w + static_cast<size_t>(kChunk) * a.n : nullptr;
      if (full) {
        // Eight rows at a time read the chunk once per pass, so the next chunk's prefetches are spread
        // over all the multiplications of this one.
        int r = 0;
        for (; r + 8 <= a.m; r += 8) {
          for (int v = 0; v < 16; v += 2) F32Tile<8, 2>(a, w, out, r, v, k0, rows, first, r == 0 ? next : nullptr);
        }
        for (; r + 4 <= a.m; r += 4) {
          for (int v = 0; v < 16; v += 4) F32Tile<4, 4>(a, w, out, r, v, k0, rows, first, r == 0 ? next : nullptr);
        }
        for (; r + 2 <= a.m; r += 2) {
          for (int v = 0; v < 16; v += 8) F32Tile<2, 8>(a, w, out, r, v, k0, rows, first, r == 0 ? next : nullptr);
        }
        if (r < a.m) F32Tile<1, 16>(a, w, out, r, 0, k0, rows, first, r == 0 ? next : nullptr);
        continue;
      }
      // The last, narrower block (fewer than 16 vectors): whole vectors, then one masked vector.
      const int whole = (a.n - c0) / 16;
      for (int r = 0; r < a.m; ++r) {
        const int v = F32WholeVectors<8>(a, w, out, r, 0, whole, k0, rows, first);
        if (v * 16 < a.n - c0) {
          const __mmask16 mask = static_cast<__mmask16>((1u << (a.n - c0 - v * 16)) - 1);
          float* y = out + static_cast<size_t>(r) * a.n + 16 * v;
          const float* x = a.x + static_cast<size_t>(r) * a.k + k0;
          __m512 acc = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y);
          for (int kk = 0; kk < rows; ++kk) {
            acc = _mm512_fmadd_ps(_mm512_set1_ps(x[kk]),
                                  _mm512_maskz_loadu_ps(mask, w + static_cast<size_t>(kk) * a.n + 16 * v), acc);
          }
          _mm512_mask_storeu_ps(y, mask, acc);
        }
      }
    }
  }
}

// Up to sixteen rows of x (greedy decoding, beams, batches; beam 2 over a batch of 8): each unit streams
// its rows of w over `span` columns (the whole row when N <= kMinSpan), eight rows at a time, each row a
// long sequential run, and keeps its sums in a packed buffer of its own (L1 or L2). The tiles above read
// 1 KB runs of 32 rows instead; in a phase where this VM's memory was slow, those scattered runs read a
// step's weights 1.3-1.9x more slowly than these streams (1.2-1.7x at 1 to 8 rows;
// `benchmarks/kernel_variants.py`, docs/performance.md). The sums are in the same order: weight row by
// weight row.
constexpr int kStreamRows = 8;    // weight rows read side by side
constexpr int kMinSpan = 1024;    // columns per unit at least, unless N is smaller
constexpr int kMaxStreamM = 16;   // rows of x up to which products take this path
// Up to this many rows of x, a pass covers two vectors of columns for every row; from one more, one vector
// for all the rows (up to 16 sums in registers), so that each weight vector is read once per group. At 4 to
// 16 rows one vector per pass read GPT-2's step 1.06-1.73x faster than two vectors for 8 rows at a time
// (the rows beyond 8 in a second sweep over the same weights), at 1 and 2 rows no faster.
constexpr int kWideM = 3;
// From this many rows of x, the multiply-adds take long enough per weight line that the hardware's own
// prefetching leaves the loads waiting (memory and arithmetic took the sum of their times, not the larger):
// each pass asks for the next group's same columns, kStreamRows rows down. At 8 rows this read GPT-2's
// products 1.14-1.45x faster (two vectors per pass); with one vector per pass, 4 to 7 rows gained too
// (0.99-1.05x; docs/performance.md).
constexpr int kPrefetchM = 4;
// Up to this many rows of x, x's eight broadcast vectors per row stay in registers; beyond, they would be
// spilled, and x is broadcast from memory instead (one row: 0.96-0.99x as fast from memory).
constexpr int kVectorM = 2;
// The packed sums: 32 columns at a time, each of the unit's rows of x 32 floats apart in them, so that a
// pass reaches every sum it keeps at a fixed offset from one pointer (with y's rows N apart, the compiler
// kept the sixteen row addresses of a pass in vector registers and moved them back one by one). Copied to
// y's rows once the unit's weight rows are done.
constexpr int kPackColumns = 32;

// The calling thread's packed sums for `floats` floats, 64-byte aligned.
float* PackedSums(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats + 16) buffer.resize(floats + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

// Where the packed sums of row r (of R) at column j are.
__attribute__((always_inline)) inline float* PackedAt(float* sums, int rows, int r, int j) {
  return sums + (j / kPackColumns) * kPackColumns * rows + kPackColumns * r + j % kPackColumns;
}

// x[i] as a vector: already broadcast (few rows: the vectors stay in registers), or broadcast from memory
// (the caller hides x from the optimizer, which would otherwise hoist the values into registers and
// broadcast them with shuffles on the FMA pipes).
__attribute__((always_inline)) inline __m512 Lane(const __m512* x, int i) { return x[i]; }
__attribute__((always_inline)) inline __m512 Lane(const float* x, int i) { return _mm512_set1_ps(x[i]); }

// R rows of packed sums, V vectors of columns from j (Masked: one vector under `mask`), `sums` at row 0 of
// those columns: the running sums (zero when first is set) plus the weight rows w[s] times x[s * R + r];
// with Ahead, each weight line of the next group (`ahead` floats down) is asked for.
template <int R, int V, bool Ahead, bool Masked, typename X>
__attribute__((always_inline)) inline void StreamVectors(const float* const* w, const X* x, float* sums, int j,
                                                         bool first, __mmask16 mask, size_t ahead) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(sums + kPackColumns * r + 16 * v);
    }
  }
#pragma GCC unroll 8
  for (int s = 0; s < kStreamRows; ++s) {
    __m512 wv[V];
    for (int v = 0; v < V; ++v) {
      if constexpr (Ahead) _mm_prefetch(reinterpret_cast<const char*>(w[s] + ahead + j + 16 * v), _MM_HINT_T0);
      wv[v] = Masked ? _mm512_maskz_loadu_ps(mask, w[s] + j) : _mm512_loadu_ps(w[s] + j + 16 * v);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = Lane(x, s * R + r);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) _mm512_store_ps(sums + kPackColumns * r + 16 * v, acc[r][v]);
  }
}

// The unit's group of weight rows over all its columns: passes of V vectors for every row (two, then the
// rest one by one for few rows; one for more), the last vector under `tail` if it is partial.
template <int R, int V, bool Ahead, typename X>
__attribute__((always_inline)) inline void StreamGroup(const float* const* w, const X* x, float* sums, int whole,
                                                       int width, __mmask16 tail, bool first, size_t ahead) {
  auto at = [&](int j) { return PackedAt(sums, R, 0, j); };
  int j = 0;
  for (; j + 16 * V <= whole; j += 16 * V) StreamVectors<R, V, Ahead, false>(w, x, at(j), j, first, 0xFFFF, ahead);
  for (; j < whole; j += 16) StreamVectors<R, 1, false, false>(w, x, at(j), j, first, 0xFFFF, 0);
  if (j < width) StreamVectors<R, 1, false, true>(w, x, at(j), j, first, tail, 0);
}

template <int R>
void StreamUnits(const F32Product& a, int u0, int u1) {
  constexpr int V = R <= kWideM ? 2 : 1;
  for (int u = u0; u < u1; ++u) {
    const Unit unit = UnitOf(a, u, a.span);
    const int width = unit.columns, k_begin = unit.k_begin, k_end = unit.k_end;
    const int whole = width / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (width - whole)) - 1);
    const int packs = (width + kPackColumns - 1) / kPackColumns;
    float* sums = PackedSums(static_cast<size_t>(packs) * kPackColumns * R);
    for (int k0 = k_begin; k0 < k_end; k0 += kStreamRows) {
      // Rows past k_end repeat row k0 (already in L1) with a zero x.
      const int rows = k_end - k0 < kStreamRows ? k_end - k0 : kStreamRows;
      const float* w[kStreamRows];
      float xs[kStreamRows * R];
      for (int s = 0; s < kStreamRows; ++s) {
        w[s] = a.w + static_cast<size_t>(s < rows ? k0 + s : k0) * a.n + unit.c0;
        for (int r = 0; r < R; ++r) xs[s * R + r] = s < rows ? a.x[static_cast<size_t>(r) * a.k + k0 + s] : 0.0f;
      }
      const bool first = k0 == k_begin;
      // The next group of this unit's weight rows, if any (a prefetch never faults, but would waste a read).
      const size_t ahead = R >= kPrefetchM && k0 + 2 * kStreamRows <= k_end ? size_t{kStreamRows} * a.n : 0;
      if constexpr (R <= kVectorM) {
        __m512 xv[kStreamRows * R];
        for (int i = 0; i < kStreamRows * R; ++i) xv[i] = _mm512_set1_ps(xs[i]);
        StreamGroup<R, V, false>(w, xv, sums, whole, width, tail, first, 0);
      } else {
        const float* x = xs;
        asm("" : "+r"(x));
        if (ahead != 0) {
          StreamGroup<R, V, true>(w, x, sums, whole, width, tail, first, ahead);
        } else {
          StreamGroup<R, V, false>(w, x, sums, whole, width, tail, first, 0);
        }
      }
    }
    for (int r = 0; r < R; ++r) {  // the packed sums to the unit's rows of y (or of its split's partial sums)
      float* y = unit.out + static_cast<size_t>(r) * a.n;
      for (int j = 0; j < width; j += 16) {
        const __m512 v = _mm512_load_ps(PackedAt(sums, R, r, j));
        if (j < whole) {
          _mm512_storeu_ps(y + j, v);
        } else {
          _mm512_mask_storeu_ps(y + j, tail, v);
        }
      }
    }
  }
}

void RunF32Stream(const void* args, int u0, int u1) {
  const F32Product& a = *static_cast<const F32Product*>(args);
  switch (a.m) {
    case 1: StreamUnits<1>(a, u0, u1); break;
    case 2: StreamUnits<2>(a, u0, u1); break;
    case 3: StreamUnits<3>(a, u0, u1); break;
    case 4: StreamUnits<4>(a, u0, u1); break;
    case 5: StreamUnits<5>(a, u0, u1); break;
    case 6: StreamUnits<6>(a, u0, u1); break;
    case 7: StreamUnits<7>(a, u0, u1); break;
    case 8: StreamUnits<8>(a, u0, u1); break;
    case 9: StreamUnits<9>(a, u0, u1); break;
    case 10: StreamUnits<10>(a, u0, u1); break;
    case 11: StreamUnits<11>(a, u0, u1); break;
    case 12: StreamUnits<12>(a, u0, u1); break;
    case 13: StreamUnits<13>(a, u0, u1); break;
    case 14: StreamUnits<14>(a, u0, u1); break;
    case 15: StreamUnits<15>(a, u0, u1); break;
    case 16: StreamUnits<16>(a, u0, u1); break;
    default: std::abort();  // xlagen_f32_matmul sends at most kMaxStreamM rows here
  }
}

// The units of a float32 product (its column spans or blocks, and splits of K) for `threads` threads: enough
// units for every thread to take several, but at least 64 weight rows per split. Returns the splits.
int PlanF32(F32Product* a, int threads) {
  const int wanted = 4 * threads;
  const bool stream = a->m <= kMaxStreamM;
  if (stream) {  // column spans of at least kMinSpan, of equal width
    int spans = a->n / kMinSpan;
    spans = spans < 1 ? 1 : (spans > wanted ? wanted : spans);
    a->span = ((a->n + spans - 1) / spans + 15) / 16 * 16;
    a->blocks = (a->n + a->span - 1) / a->span;
  } else {
    a->blocks = (a->n + kBlock - 1) / kBlock;
  }
  int splits = (wanted + a->blocks - 1) / a->blocks;
  const int most = a->k / 64 > 1 ? a->k / 64 : 1;
  splits = splits < most ? splits : most;
  const int step = stream ? kStreamRows : kChunk;
  a->split_rows = (a->k + splits - 1) / splits;
  a->split_rows = (a->split_rows + step - 1) / step * step;
  return (a->k + a->split_rows - 1) / a->split_rows;
}

// The product that comes next, as far as the last calls tell. A decoding step calls the same products in the
// same order at every step (the weights of a compiled loop keep their buffers), and between two products XLA
// runs the step's other operations (norms, attention, ...) on the calling thread, while the memory is idle
// and the pool's workers spin. An idle worker reads ahead the start of the next product's share of the
// weights that it will take (Pool::Lookahead); a wrong guess costs only the bytes read for nothing.
class Successors {
 public:
  // Records that `current` came after the previous product; returns in *next the product that came after
  // `current` last time (false when none did).
  bool Follow(const F32Product& current, F32Product* next) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++calls_;
    if (last_ != nullptr) {
      auto found = next_.find(last_);
      if (found != next_.end()) {
        if (found->second.w == current.w) ++predicted_;
        found->second = current;
      } else {
        if (next_.size() >= kMaxProducts) next_.clear();
        next_.emplace(last_, current);
      }
    }
    last_ = current.w;
    const auto found = next_.find(current.w);
    if (found == next_.end()) return false;
    *next = found->second;
    return true;
  }

  // [calls, calls that were the product predicted after the previous one]
  void Count(long* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    out[0] = calls_;
    out[1] = predicted_;
  }

 private:
  static constexpr size_t kMaxProducts = 4096;  // weights remembered (a program's products, and then some)
  std::mutex mutex_;
  const float* last_ = nullptr;
  std::unordered_map<const float*, F32Product> next_;  // weights -> the product that came next
  long calls_ = 0, predicted_ = 0;
};

Successors& GetSuccessors() {
  static Successors* successors = new Successors;  // never destroyed, like the pool
  return *successors;
}

std::atomic<long> g_read_ahead{0};  // bytes the workers have read ahead

// Prefetches the first `budget` bytes that a worker will read of `a` (as PlanF32 split it): the workers take
// units from the back (Pool::Work), worker `offset` of `stride` the units from the last down, one in
// `stride`, each unit's weight rows in the order it reads them. Stops early when `stop` says to. A prefetch
// never faults, so a product whose weights have been freed since is harmless.
template <typename Stop>
void PrefetchF32(const F32Product& a, int offset, int stride, size_t budget, Stop stop) {
  const int units = a.blocks * ((a.k + a.split_rows - 1) / a.split_rows);
  const int width = a.m <= kMaxStreamM ? a.span : kBlock;
  size_t fetched = 0;
  for (int u = units - 1 - offset; u >= 0; u -= stride) {
    const Unit unit = UnitOf(a, u, width);
    const int bytes = 4 * unit.columns;
    for (int k = unit.k_begin; k < unit.k_end; ++k) {
      const char* row = reinterpret_cast<const char*>(a.w + static_cast<size_t>(k) * a.n + unit.c0);
      for (int b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
      _mm_prefetch(row + bytes - 1, _MM_HINT_T0);  // the last line, when the row does not start one
      fetched += bytes;
      if (fetched >= budget || stop()) break;
    }
    if (fetched >= budget || stop()) break;
  }
  g_read_ahead.fetch_add(static_cast<long>(fetched), std::memory_order_relaxed);
}

// One product for the pool: `units` independent pieces of work, run(args, u0, u1) does units [u0, u1).
struct Task {
  const void* args;
  void (*run)(const void* args, int u0, int u1);
  int units;
};

// A fixed pool of workers that help the calling thread with one product at a time. The units are handed
// out in chunks from a shared range, so nobody waits for a worker that the OS has not scheduled (XLA's own
// threads may hold the cores): the caller takes every chunk left and then waits only for chunks already
// taken. Idle workers spin for a while (a decoding step issues its products tens of microseconds apart),
// reading ahead the weights of the float32 product expected next (Lookahead), then sleep on a futex.
class Pool {
 public:
  Pool(int threads, std::chrono::microseconds spin, size_t lookahead)
      : threads_(threads), spin_(spin), lookahead_(lookahead) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { Loop(i); });
  }

  int threads() const { return threads_; }
  size_t lookahead() const { return threads_ == 1 ? 0 : lookahead_.load(std::memory_order_relaxed); }
  void set_lookahead(size_t bytes) { lookahead_.store(bytes, std::memory_order_relaxed); }

  // Hands the idle workers the product expected next (as PlanF32 split it), whose weights they prefetch
  // until a task comes.
  void Lookahead(const F32Product& next) {
    if (threads_ == 1 || lookahead_.load(std::memory_order_relaxed) == 0) return;
    std::lock_guard<std::mutex> lock(job_mutex_);
    job_ = next;
    job_seq_.fetch_add(1, std::memory_order_release);
  }

  void Run(const Task& a) {
    // XLA may run independent custom calls concurrently: a call that finds the pool busy computes alone.
    if (threads_ == 1 || busy_.test_and_set(std::memory_order_acquire)) {
      a.run(a.args, 0, a.units);
      return;
    }
    const int chunks = 4 * threads_;
    chunk_ = (a.units + chunks - 1) / chunks;
    range_.store(static_cast<uint64_t>(a.units), std::memory_order_relaxed);
    task_ = &a;
    open_.store(true, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
              nullptr, 0);
    }
    Work(a, true);
    // Dekker-style handshake with Loop: after this store, a worker that has not joined yet sees the task
    // closed and leaves it alone; one that joined before is counted in active_ and is waited for.
    open_.store(false, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) != 0) _mm_pause();
    busy_.clear(std::memory_order_release);
  }

 private:
  // The calling thread takes chunks from the front of the units, the workers from the back (the units
  // whose weights they prefetched while idle, see Lookahead), until the two meet.
  void Work(const Task& a, bool front) {
    uint64_t range = range_.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t first = static_cast<uint32_t>(range >> 32), end = static_cast<uint32_t>(range);
      if (first >= end) return;
      uint32_t u0, u1;
      if (front) {
        u0 = first;
        u1 = end - first > static_cast<uint32_t>(chunk_) ? first + chunk_ : end;
      } else {
        u1 = end;
        u0 = end - first > static_cast<uint32_t>(chunk_) ? end - chunk_ : first;
      }
      const uint64_t rest = front ? (static_cast<uint64_t>(u1) << 32) | end : (static_cast<uint64_t>(first) << 32) | u0;
      if (!range_.compare_exchange_weak(range, rest, std::memory_order_relaxed)) continue;
      a.run(a.args, static_cast<int>(u0), static_cast<int>(u1));
      range = range_.load(std::memory_order_relaxed);
    }
  }

  void Loop(int index) {
    uint32_t seen = 0;  // the generation at construction: a worker that starts late still sees the first task
    uint32_t job_done = 0;
    for (;;) {
      int spins = 0;
      auto spin_until = std::chrono::steady_clock::now() + spin_;
      uint32_t now;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        if (job_seq_.load(std::memory_order_acquire) != job_done) {
          F32Product next;
          {
            std::lock_guard<std::mutex> lock(job_mutex_);
            next = job_;
            job_done = job_seq_.load(std::memory_order_relaxed);
          }
          PrefetchF32(next, index - 1, threads_ - 1, lookahead_.load(std::memory_order_relaxed),
                      [&] { return generation_.load(std::memory_order_relaxed) != seen; });
          continue;
        }
        if ((++spins & 63) != 0 || std::chrono::steady_clock::now() < spin_until) {
          _mm_pause();
          continue;
        }
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (generation_.load(std::memory_order_seq_cst) == seen) {
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, seen, nullptr,
                  nullptr, 0);
        }
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        spin_until = std::chrono::steady_clock::now() + spin_;
      }
      seen = now;
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst)) Work(*task_, false);  // the task of the newest generation
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const int threads_;
  const std::chrono::microseconds spin_;  // how long an idle worker spins before it sleeps
  std::atomic<size_t> lookahead_;          // bytes of the next product each idle worker prefetches
  std::mutex job_mutex_;
  F32Product job_{};                       // the product expected next
  std::atomic<uint32_t> job_seq_{0};       // bumped per expected product
  std::vector<std::thread> workers_;
  const Task* task_ = nullptr;
  int chunk_ = 1;                          // units per chunk of the current task
  std::atomic<uint64_t> range_{0};         // units not handed out yet: [high 32 bits, low 32 bits)
  std::atomic<bool> open_{false};          // whether workers may still join the current task
  std::atomic<int> active_{0};             // workers inside the current task
  std::atomic<uint32_t> generation_{0};    // bumped per task; workers wait on it (futex)
  std::atomic<int> sleepers_{0};
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
};

Pool& GetPool() {
  static Pool* pool = [] {
    int threads = 0;
    if (const char* env = std::getenv("XLAGEN_NATIVE_THREADS")) threads = std::atoi(env);
    if (threads < 1) {
      // The products are bound by memory bandwidth, which a few cores saturate; more threads would only
      // spin between products.
      cpu_set_t cpus;
      threads = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
      threads = threads > kMaxDefaultThreads ? kMaxDefaultThreads : threads;
    }
    int spin = kDefaultSpinMicroseconds;
    if (const char* env = std::getenv("XLAGEN_NATIVE_SPIN_US")) spin = std::atoi(env);
    long lookahead = kDefaultLookaheadKB;
    if (const char* env = std::getenv("XLAGEN_NATIVE_LOOKAHEAD_KB")) lookahead = std::atol(env);
    // Never destroyed: its workers live as long as the process.
    return new Pool(threads < 1 ? 1 : threads, std::chrono::microseconds(spin < 0 ? 0 : spin),
                    lookahead < 0 ? 0 : static_cast<size_t>(lookahead) * 1024);
  }();
  return *pool;
}

// A custom call's backend config as a C string for sscanf (XLA passes its bytes without a terminating 0).
struct BackendConfig {
  char text[128];
  BackendConfig(const char* opaque, size_t length) {
    if (length > sizeof(text) - 1) length = sizeof(text) - 1;
    std::memcpy(text, opaque, length);
    text[length] = '\0';
  }
};

// The backend config "M,K,N" (xlagen always writes it so).
void ParseShape(const char* opaque, size_t opaque_len, int* m, int* k, int* n) {
  const BackendConfig config(opaque, opaque_len);
  if (std::sscanf(config.text, "%d,%d,%d", m, k, n) != 3) std::abort();
}

// "xlagen_f32_attention": softmax(scale * q k^T) v over all keys (no mask), for each of B x H heads, for
// long self-attention (Whisper's encoder: 1500 positions). XLA computes the scores, writes them out
// [T, S], reads them back for the softmax and again for the product with v; here each unit (8 query rows
// of one head) keeps its scores in the core's cache: the head's k (transposed once per thread, [D, S])
// and v stay in L2 across its units. The scores are scaled after the product, as XLA does; the softmax
// divides once per output row rather than once per weight.
//
// With keys given transposed ([heads, d, s]: a decoder's cross-attention memory, transposed once when it
// is projected), the unit's few query rows read the keys straight from memory, one contiguous row of s
// keys per head dimension, rather than through a copy: each key and value is read once per unit, at the
// rate memory streams (XLA's dots over Whisper's memory read it at a third of that, docs/performance.md).
constexpr int kAttentionRows = 8;  // query rows per unit

struct Attention {
  const float* q;  // [heads, t, d]
  const float* k;  // [heads, s, d], or [heads, d, s] when transposed
  const float* v;  // [heads, s, d]
  float* out;      // [heads, t, d]
  int heads, t, s, d, blocks;  // blocks: units per head
  float scale;
  uint64_t call;  // which call this is: a thread's transposed k is reused within one call only
  int transposed;
};

std::atomic<uint64_t> g_attention_calls{0};

// exp(x) for x <= 0 (scores minus their row's maximum): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its
// degree-7 polynomial (Cephes' expf coefficients), times 2^n by scalef; below -104 it is 0.
inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: exact first step
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The largest of row[0..n).
inline float RowMax(const float* row, int n) {
  const int whole = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1);
  __m512 high = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < whole; j += 16) high = _mm512_max_ps(high, _mm512_loadu_ps(row + j));
  if (tail) high = _mm512_mask_max_ps(high, tail, high, _mm512_maskz_loadu_ps(tail, row + whole));
  return _mm512_reduce_max_ps(high);
}

// row[0..n) = exp(row[j] - top) in place, for a row whose largest value is `top`; returns their sum.
inline float ExpInPlace(float* row, int n, float top) {
  const int whole = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1);
  const __m512 high = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < whole; j += 16) {
    const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), high));
    _mm512_storeu_ps(row + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, ExpNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + whole), high)));
    _mm512_mask_storeu_ps(row + whole, tail, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// out[rows of the unit] = weights @ v / sums, for D = 16 DV, R rows of weights at a time (4 DV sums).
template <int DV>
void AttentionOutput(const Attention& a, const float* weights, int padded, const float* sums, const float* v,
                     float* out, int rows) {
  constexpr int R = 16 / DV < 1 ? 1 : (16 / DV > kAttentionRows ? kAttentionRows : 16 / DV);
  for (int r0 = 0; r0 < rows; r0 += R) {
    __m512 acc[R][DV];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int j = 0; j < a.s; ++j) {
      __m512 vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + static_cast<size_t>(j) * a.d + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(weights[static_cast<size_t>(r0 + r) * padded + j]);
        for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R && r0 + r < rows; ++r) {
      const __m512 inverse = _mm512_set1_ps(1.0f / sums[r0 + r]);
      for (int c = 0; c < DV; ++c) {
        _mm512_storeu_ps(out + static_cast<size_t>(r0 + r) * a.d + 16 * c, _mm512_mul_ps(acc[r][c], inverse));
      }
    }
  }
}

// The scaled scores [rows, padded] of a unit's query rows q [rows, d] against a head's transposed keys
// kt [d, s], accumulated one head dimension at a time: each kt row is read once, in order, and the rows'
// scores stay in L1. Columns from s to padded are left as they are (the softmax ignores them).
void TransposedScores(const Attention& a, const float* kt, const float* q, int rows, float* scores, int padded) {
  const int whole = a.s / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (a.s - whole)) - 1);
  for (int r = 0; r < rows; ++r) std::memset(scores + static_cast<size_t>(r) * padded, 0, sizeof(float) * a.s);
  for (int c = 0; c < a.d; ++c) {
    const float* row = kt + static_cast<size_t>(c) * a.s;
    for (int r = 0; r < rows; ++r) {
      const __m512 x = _mm512_set1_ps(q[static_cast<size_t>(r) * a.d + c]);
      float* out = scores + static_cast<size_t>(r) * padded;
      for (int j = 0; j < whole; j += 16) {
        _mm512_storeu_ps(out + j, _mm512_fmadd_ps(x, _mm512_loadu_ps(row + j), _mm512_loadu_ps(out + j)));
      }
      if (tail) {
        const __m512 k = _mm512_maskz_loadu_ps(tail, row + whole);
        _mm512_mask_storeu_ps(out + whole, tail, _mm512_fmadd_ps(x, k, _mm512_maskz_loadu_ps(tail, out + whole)));
      }
    }
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int r = 0; r < rows; ++r) {
    float* out = scores + static_cast<size_t>(r) * padded;
    for (int j = 0; j < whole; j += 16) _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(out + j), scale));
    if (tail) _mm512_mask_storeu_ps(out + whole, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, out + whole), scale));
  }
}

void RunAttention(const void* args, int u0, int u1) {
  const Attention& a = *static_cast<const Attention*>(args);
  const int padded = (a.s + 31) / 32 * 32;  // score columns, in pairs of vectors
  thread_local std::vector<float> kt, scores, q;
  thread_local uint64_t kt_call = 0;
  thread_local int kt_head = -1;
  scores.resize(static_cast<size_t>(kAttentionRows) * padded);
  q.resize(static_cast<size_t>(kAttentionRows) * a.d);
  for (int u = u0; u < u1; ++u) {
    const int head = u / a.blocks, t0 = (u % a.blocks) * kAttentionRows;
    const int rows = a.t - t0 < kAttentionRows ? a.t - t0 : kAttentionRows;
    const size_t head_offset = static_cast<size_t>(head) * a.s * a.d;
    if (a.transposed) {
      TransposedScores(a, a.k + head_offset, a.q + (static_cast<size_t>(head) * a.t + t0) * a.d, rows,
                       scores.data(), padded);
    } else {
      if (kt_call != a.call || kt_head != head) {  // k [s, d] -> kt [d, padded], zeros past s
        kt.assign(static_cast<size_t>(a.d) * padded, 0.0f);
        const float* k = a.k + head_offset;
        for (int j = 0; j < a.s; ++j)
          for (int c = 0; c < a.d; ++c) kt[static_cast<size_t>(c) * padded + j] = k[static_cast<size_t>(j) * a.d + c];
        kt_call = a.call;
        kt_head = head;
      }
      // The unit's query rows, zeros past t (their scores are computed and not used).
      std::fill(q.begin(), q.end(), 0.0f);
      std::memcpy(q.data(), a.q + (static_cast<size_t>(head) * a.t + t0) * a.d, sizeof(float) * rows * a.d);
      const __m512 scale = _mm512_set1_ps(a.scale);
      for (int j = 0; j < padded; j += 32) {
        __m512 acc[kAttentionRows][2];
        for (int r = 0; r < kAttentionRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int c = 0; c < a.d; ++c) {
          const float* row = kt.data() + static_cast<size_t>(c) * padded + j;
          const __m512 k0 = _mm512_loadu_ps(row), k1 = _mm512_loadu_ps(row + 16);
          for (int r = 0; r < kAttentionRows; ++r) {
            const __m512 x = _mm512_set1_ps(q[static_cast<size_t>(r) * a.d + c]);
            acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
          }
        }
        for (int r = 0; r < kAttentionRows; ++r) {
          float* out = scores.data() + static_cast<size_t>(r) * padded + j;
          _mm512_storeu_ps(out, _mm512_mul_ps(acc[r][0], scale));
          _mm512_storeu_ps(out + 16, _mm512_mul_ps(acc[r][1], scale));
        }
      }
    }
    // Softmax numerators in place, and their sums (the columns past s are never read).
    float sums[kAttentionRows];
    for (int r = 0; r < rows; ++r) {
      float* row = scores.data() + static_cast<size_t>(r) * padded;
      sums[r] = ExpInPlace(row, a.s, RowMax(row, a.s));
    }
    const float* v = a.v + head_offset;
    float* out = a.out + (static_cast<size_t>(head) * a.t + t0) * a.d;
    switch (a.d / 16) {
      case 1: AttentionOutput<1>(a, scores.data(), padded, sums, v, out, rows); break;
      case 2: AttentionOutput<2>(a, scores.data(), padded, sums, v, out, rows); break;
      case 4: AttentionOutput<4>(a, scores.data(), padded, sums, v, out, rows); break;
      case 8: AttentionOutput<8>(a, scores.data(), padded, sums, v, out, rows); break;
      default: std::abort();  // xlagen only emits D = 16, 32, 64 or 128
    }
  }
}

// One decoding step's self-attention (T = 1 per sequence; a prompt's K beams as K queries over its K slots of
// the cache laid end to end): for query i of group g and head h, the scores of the cache's S keys and of the
// step's own new key, softmax, and the weighted sum of the values and the new value. `bias` [G, bias_heads,
// K, S + 1] is added to the scaled scores; -inf marks a key the query may not see (its score is then
// kMaskValue, as `xlagen.layers.attention` masks: finite, so no row turns into NaN).
struct StepAttention {
  const float* q;      // [G, H, K, D]
  const float* k;      // [G, H, S, D]: the cache as it was before this step
  const float* v;      // [G, H, S, D]
  const float* new_k;  // [G, H, K, D]
  const float* new_v;  // [G, H, K, D]
  const float* bias;   // [G, bias_heads, K, S + 1]
  float* out;          // [G, H, K, D]
  int heads, queries, s, d, bias_heads;
  float scale;
};

constexpr float kMaskValue = -1e9f;  // xlagen.layers.attention.MASK_VALUE
// Steps with fewer multiply-adds than this (heads x queries x keys x head dim) run on the calling thread
// alone: waking the workers would stop them reading the next product's weights ahead, for a few us of work.
constexpr long kStepAttentionAlone = 1L << 20;

constexpr int kStepAttentionMaxD = 256;  // head sizes up to this (xlagen.native.STEP_ATTENTION_MAX_HEAD_DIM)

// The D = 16 (whole - 1) + tail floats of a head vector: `whole` vectors, the last under `tail`.
inline float DotRow(const float* a, const float* b, int whole, __mmask16 tail) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c + 1 < whole; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * c), _mm512_loadu_ps(b + 16 * c), acc);
  const int c = whole - 1;
  acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + 16 * c), _mm512_maskz_loadu_ps(tail, b + 16 * c), acc);
  return _mm512_reduce_add_ps(acc);
}

void RunStepAttention(const void* args, int u0, int u1) {
  const StepAttention& a = *static_cast<const StepAttention*>(args);
  thread_local std::vector<float> scores;
  const int n = a.s + 1;  // the cache's keys, then the new one
  scores.resize(static_cast<size_t>(n));
  const int vectors = (a.d + 15) / 16;  // of a head vector, the last under `last`
  const __mmask16 last = static_cast<__mmask16>(0xFFFFu >> (16 * vectors - a.d));
  for (int u = u0; u < u1; ++u) {  // u = (g * heads + h) * queries + i
    const int i = u % a.queries, gh = u / a.queries, g = gh / a.heads, h = gh % a.heads;
    const float* q = a.q + static_cast<size_t>(u) * a.d;
    const float* k = a.k + static_cast<size_t>(gh) * a.s * a.d;
    const float* v = a.v + static_cast<size_t>(gh) * a.s * a.d;
    const float* bias =
        a.bias + ((static_cast<size_t>(g) * a.bias_heads + (a.bias_heads == 1 ? 0 : h)) * a.queries + i) * n;
    float* row = scores.data();
    float top = -INFINITY;
    for (int j = 0; j < n; ++j) {
      float score = kMaskValue;
      if (bias[j] != -INFINITY) {
        const float* key = j < a.s ? k + static_cast<size_t>(j) * a.d : a.new_k + static_cast<size_t>(u) * a.d;
        score = DotRow(q, key, vectors, last) * a.scale + bias[j];
      }
      row[j] = score;
      top = score > top ? score : top;
    }
    const float total = ExpInPlace(row, n, top);
    // The weighted values (a masked key's weight is 0 and is skipped: its value is never read).
    __m512 acc[kStepAttentionMaxD / 16];
    for (int c = 0; c < vectors; ++c) acc[c] = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j) {
      if (row[j] == 0.0f) continue;
      const __m512 w = _mm512_set1_ps(row[j]);
      const float* value = j < a.s ? v + static_cast<size_t>(j) * a.d : a.new_v + static_cast<size_t>(u) * a.d;
      for (int c = 0; c + 1 < vectors; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * c), acc[c]);
      acc[vectors - 1] =
          _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(last, value + 16 * (vectors - 1)), acc[vectors - 1]);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / total);
    float* out = a.out + static_cast<size_t>(u) * a.d;
    for (int c = 0; c + 1 < vectors; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inverse));
    _mm512_mask_storeu_ps(out + 16 * (vectors - 1), last, _mm512_mul_ps(acc[vectors - 1], inverse));
  }
}

}  // namespace

extern "C" void xlagen_bf16_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                   XlaCustomCallStatus_* /*status*/) {
  Product a{static_cast<const float*>(in[0]), static_cast<const uint32_t*>(in[1]), static_cast<float*>(out), 0,
            0, 0, 0};
  ParseShape(opaque, opaque_len, &a.m, &a.k, &a.n);
  a.panels = (a.n + kPanel - 1) / kPanel;
  GetPool().Run(Task{&a, RunPanels, a.panels});
}

extern "C" void xlagen_int8_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                   XlaCustomCallStatus_* /*status*/) {
  Int8Product a{static_cast<const float*>(in[0]), static_cast<const int8_t*>(in[1]), static_cast<float*>(out), 0,
                0, 0, 0};
  ParseShape(opaque, opaque_len, &a.m, &a.k, &a.n);
  a.panels = (a.n + kInt8Panel - 1) / kInt8Panel;
  GetPool().Run(Task{&a, RunInt8Panels, a.panels});
}

extern "C" void xlagen_f32_matmul(void* out, const void** in, const char* opaque, size_t opaque_len,
                                  XlaCustomCallStatus_* /*status*/) {
  F32Product a{static_cast<const float*>(in[0]), static_cast<const float*>(in[1]), static_cast<float*>(out),
               nullptr, 0, 0, 0, 0, 0, 0};
  ParseShape(opaque, opaque_len, &a.m, &a.k, &a.n);
  Pool& pool = GetPool();
  const int splits = PlanF32(&a, pool.threads());
  F32Product next;
  const bool predicted = GetSuccessors().Follow(a, &next);
  thread_local std::vector<float> partial;
  if (splits > 1) {
    partial.resize(static_cast<size_t>(splits - 1) * a.m * a.n);
    a.partial = partial.data();
  }
  pool.Run(Task{&a, a.m <= kMaxStreamM ? RunF32Stream : RunF32Units, a.blocks * splits});
  const size_t size = static_cast<size_t>(a.m) * a.n;
  for (int s = 1; s < splits; ++s) {
    const float* p = a.partial + static_cast<size_t>(s - 1) * size;
    for (size_t i = 0; i < size; ++i) a.y[i] += p[i];
  }
  if (predicted) pool.Lookahead(next);  // planned when it was called
}

// The backend config is "heads,t,s,d,scale,transposed" (scale printed with 9 significant digits: exact for
// float32; transposed 1 when k is [heads, d, s]).
extern "C" void xlagen_f32_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                     XlaCustomCallStatus_* /*status*/) {
  Attention a{static_cast<const float*>(in[0]), static_cast<const float*>(in[1]), static_cast<const float*>(in[2]),
              static_cast<float*>(out), 0, 0, 0, 0, 0, 0.0f, 0, 0};
  const BackendConfig config(opaque, opaque_len);
  if (std::sscanf(config.text, "%d,%d,%d,%d,%f,%d", &a.heads, &a.t, &a.s, &a.d, &a.scale, &a.transposed) != 6) {
    std::abort();
  }
  a.blocks = (a.t + kAttentionRows - 1) / kAttentionRows;
  a.call = g_attention_calls.fetch_add(1) + 1;
  GetPool().Run(Task{&a, RunAttention, a.heads * a.blocks});
}

// The backend config is "groups,heads,queries,s,d,bias_heads,scale" (scale printed with 9 significant digits).
extern "C" void xlagen_f32_step_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                          XlaCustomCallStatus_* /*status*/) {
  StepAttention a{static_cast<const float*>(in[0]), static_cast<const float*>(in[1]), static_cast<const float*>(in[2]),
                  static_cast<const float*>(in[3]), static_cast<const float*>(in[4]), static_cast<const float*>(in[5]),
                  static_cast<float*>(out), 0, 0, 0, 0, 0, 0.0f};
  const BackendConfig config(opaque, opaque_len);
  int groups = 0;
  if (std::sscanf(config.text, "%d,%d,%d,%d,%d,%d,%f", &groups, &a.heads, &a.queries, &a.s, &a.d, &a.bias_heads,
                  &a.scale) != 7 || a.d < 1 || a.d > kStepAttentionMaxD) {
    std::abort();
  }
  const int units = groups * a.heads * a.queries;
  if (static_cast<long>(units) * (a.s + 1) * a.d < kStepAttentionAlone) {
    RunStepAttention(&a, 0, units);
  } else {
    GetPool().Run(Task{&a, RunStepAttention, units});
  }
}

// "xlagen_f32_argmax": the index of each row's largest value, the first on ties (greedy decoding's choice
// over a vocabulary of logits). XLA's argmax is a reduction of (value, index) pairs that its CPU backend
// runs one element at a time (about 0.9 ms per step for Whisper-tiny's 8 x 51,865 logits); here each of 16
// lanes keeps its own largest value and index, and the lanes are compared once at the end. NaN is never
// larger than anything, so it is skipped (the lanes' values are never NaN); a row of only -inf or NaN gives 0.
struct Argmax {
  const float* x;  // [rows, n]
  int32_t* out;    // [rows]
  int n;
};

void RunArgmax(const void* args, int u0, int u1) {
  const Argmax& a = *static_cast<const Argmax*>(args);
  const __m512i step = _mm512_set1_epi32(16);
  const int whole = a.n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (a.n - whole)) - 1);
  for (int r = u0; r < u1; ++r) {
    const float* row = a.x + static_cast<size_t>(r) * a.n;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = where;
    for (int j = 0; j < whole; j += 16) {
      const __mmask16 larger = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), best, _CMP_GT_OQ);
      best = _mm512_mask_loadu_ps(best, larger, row + j);
      where = _mm512_mask_mov_epi32(where, larger, index);
      index = _mm512_add_epi32(index, step);
    }
    if (tail) {
      const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, row + whole);
      const __mmask16 larger = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, larger, x);
      where = _mm512_mask_mov_epi32(where, larger, index);
    }
    // Each lane holds its first maximum; of the lanes with the row's maximum, the smallest index.
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    a.out[r] = _mm512_mask_reduce_min_epi32(at_top, where);
  }
}

// "xlagen_f32_memory_attention": a decoding step's cross-attention over a long encoder output M [L, E] with
// the key and value projections folded in, for one query row per head (greedy decoding, sampling). With
// keys K_h = M Wk_h and values V_h = M Wv_h + bv_h of head h,
//   softmax(q_h K_h^T) V_h = (softmax((q_h Wk_h^T) M^T) M) Wv_h + bv_h
// (the key bias adds the same amount to every score, which the softmax ignores). Each of the decoder's
// layers then reads M itself rather than its own projected keys and values: half the bytes per layer (M
// once against K and V), and the same M for every layer, with no projection of M per layer before the
// loop. The price is compute: the scores and the weighted sum run over E rather than D per head, which
// pays while a head has few query rows (one per memory row: 6 x 1500 x 384 multiply-adds per row and
// layer for Whisper-tiny, against reading 2 x 1500 x 384 floats). See docs/performance.md.
//
// Three passes on the pool: (1) q'_h = scale * q_h Wk_h^T for every query row (Wk given transposed,
// [H * D, E], made once per generation); (2) per memory row and chunk of keys, the scores of its rows
// against the chunk (M's rows read once, in order), their exponentials and the partial weighted sum of the
// chunk's rows of M (still in L2), with the chunk's maximum and total; (3) per head and row, the partial
// sums combined and projected with Wv_h, plus bv_h.
struct MemoryAttention {
  const float* q;    // [groups, queries, heads, d]
  const float* m;    // [groups, l, e]
  const float* wkt;  // [heads * d, e]
  const float* wkv;  // [e, 2 * heads * d]: the key/value kernel, the values in the second half
  const float* bkv;  // [2 * heads * d]
  float* out;        // [groups, queries, heads * d]
  float* qp;         // scratch [groups, queries * heads, e]
  float* partial;    // scratch [groups, chunks, queries * heads, e + 2]: the weighted sum, maximum, total
  int groups, queries, heads, d, l, e, chunks, chunk;
  float scale;
};

constexpr int kMemoryRows = 6;  // query rows per register block (6 x 4 accumulators)

// Pass 1, one unit per query row of one memory row: qp[row] = scale * q[row] @ wkt[head rows].
void RunMemoryQueries(const void* args, int u0, int u1) {
  const MemoryAttention& a = *static_cast<const MemoryAttention*>(args);
  for (int u = u0; u < u1; ++u) {
    const int head = u % a.heads;
    const float* q = a.q + static_cast<size_t>(u) * a.d;
    const float* w = a.wkt + static_cast<size_t>(head) * a.d * a.e;
    float* out = a.qp + static_cast<size_t>(u) * a.e;
    for (int c = 0; c < a.e; c += 64) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int k = 0; k < a.d; ++k) {
        const __m512 x = _mm512_set1_ps(q[k] * a.scale);
        const float* row = w + static_cast<size_t>(k) * a.e + c;
        for (int v = 0; v < 4; ++v) acc[v] = _mm512_fmadd_ps(x, _mm512_loadu_ps(row + 16 * v), acc[v]);
      }
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + c + 16 * v, acc[v]);
    }
  }
}

// The four sums of the lanes of a0..a3, in that order.
inline __m128 FourSums(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(s);
}

// The scores [R, keys] (row stride `stride`) of R query rows qp [R, e] against rows m [keys, e], four keys
// at a time: each key row is read once for the R rows.
template <int R>
void MemoryScores(const float* qp, const float* m, int keys, int e, float* scores, int stride) {
  int j = 0;
  for (; j + 4 <= keys; j += 4) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_ps();
    for (int c = 0; c < e; c += 16) {
      __m512 key[4];
      for (int k = 0; k < 4; ++k) {
        key[k] = _mm512_loadu_ps(m + static_cast<size_t>(j + k) * e + c);
        _mm_prefetch(reinterpret_cast<const char*>(m + static_cast<size_t>(j + 8 + k) * e + c), _MM_HINT_T0);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_loadu_ps(qp + static_cast<size_t>(r) * e + c);
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_fmadd_ps(x, key[k], acc[r][k]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(scores + static_cast<size_t>(r) * stride + j, FourSums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    }
  }
  for (; j < keys; ++j) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < e; c += 16) {
      const __m512 key = _mm512_loadu_ps(m + static_cast<size_t>(j) * e + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + static_cast<size_t>(r) * e + c), key, acc[r]);
    }
    for (int r = 0; r < R; ++r) scores[static_cast<size_t>(r) * stride + j] = _mm512_reduce_add_ps(acc[r]);
  }
}

// out[r] = sum over the keys of weights[r, key] * m[key] for R rows (row stride `stride`), 64 columns at a
// time: each pass reads a quarter-kilobyte column strip of every key row, so m is read once overall.
// While it runs (compute on rows already in L2), it brings `ahead` (the next unit's rows, `ahead_lines` cache
// lines) from memory into L2, spread evenly over its iterations.
template <int R>
void MemorySums(const float* weights, int stride, const float* m, int keys, int e, float* out, int out_stride,
                const char* ahead, int ahead_lines) {
  const int iterations = e / 64 * keys;
  const int per_iteration = iterations > 0 ? (ahead_lines + iterations - 1) / iterations : 0;
  const char* const ahead_end = ahead + static_cast<size_t>(ahead_lines) * 64;
  for (int c = 0; c < e; c += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int j = 0; j < keys; ++j) {
      __m512 row[4];
      for (int v = 0; v < 4; ++v) row[v] = _mm512_loadu_ps(m + static_cast<size_t>(j) * e + c + 16 * v);
      for (int p = 0; p < per_iteration && ahead < ahead_end; ++p, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(weights[static_cast<size_t>(r) * stride + j]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(w, row[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + static_cast<size_t>(r) * out_stride + c + 16 * v, acc[r][v]);
  }
}

template <int R>
void MemoryBlock(const float* qp, const float* m, int keys, int e, float* scores, int stride, float* out,
                 const char* ahead, int ahead_lines) {
  MemoryScores<R>(qp, m, keys, e, scores, stride);
  // Softmax numerators in place (against the chunk's own maximum), with their maximum and total.
  for (int r = 0; r < R; ++r) {
    float* row = scores + static_cast<size_t>(r) * stride;
    const float top = RowMax(row, keys);
    out[static_cast<size_t>(r) * (e + 2) + e] = top;
    out[static_cast<size_t>(r) * (e + 2) + e + 1] = ExpInPlace(row, keys, top);
  }
  MemorySums<R>(scores, stride, m, keys, e, out, e + 2, ahead, ahead_lines);
}

// Pass 2, one unit per memory row and chunk of keys.
void RunMemoryChunks(const void* args, int u0, int u1) {
  const MemoryAttention& a = *static_cast<const MemoryAttention*>(args);
  const int rows = a.queries * a.heads;
  const int stride = (a.chunk + 15) / 16 * 16;
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(kMemoryRows) * stride);
  for (int u = u0; u < u1; ++u) {
    const int group = u / a.chunks, first = (u % a.chunks) * a.chunk;
    const int keys = std::min(a.chunk, a.l - first);
    const float* m = a.m + (static_cast<size_t>(group) * a.l + first) * a.e;
    const float* qp = a.qp + static_cast<size_t>(group) * rows * a.e;
    float* out = a.partial + static_cast<size_t>(u) * rows * (a.e + 2);
    // The next unit's rows of M (most often this thread's next unit), read ahead during this one's sums.
    const char* ahead = nullptr;
    int lines = 0;
    if (u + 1 < a.groups * a.chunks) {
      const int next_group = (u + 1) / a.chunks, next_first = ((u + 1) % a.chunks) * a.chunk;
      ahead = reinterpret_cast<const char*>(a.m + (static_cast<size_t>(next_group) * a.l + next_first) * a.e);
      lines = static_cast<int>((static_cast<size_t>(std::min(a.chunk, a.l - next_first)) * a.e * 4 + 63) / 64);
    }
    for (int r = 0; r < rows; r += kMemoryRows) {
      const float* q = qp + static_cast<size_t>(r) * a.e;
      float* o = out + static_cast<size_t>(r) * (a.e + 2);
      switch (std::min(kMemoryRows, rows - r)) {
        case 1: MemoryBlock<1>(q, m, keys, a.e, scores.data(), stride, o, ahead, lines); break;
        case 2: MemoryBlock<2>(q, m, keys, a.e, scores.data(), stride, o, ahead, lines); break;
        case 3: MemoryBlock<3>(q, m, keys, a.e, scores.data(), stride, o, ahead, lines); break;
        case 4: MemoryBlock<4>(q, m, keys, a.e, scores.data(), stride, o, ahead, lines); break;
        case 5: MemoryBlock<5>(q, m, keys, a.e, scores.data(), stride, o, ahead, lines); break;
        default: MemoryBlock<6>(q, m, keys, a.e, scores.data(), stride, o, ahead, lines); break;
      }
    }
  }
}

// out[D = 16 DV] = u[e] @ w (row stride `stride`) + bias.
template <int DV>
void MemoryProject(const float* u, int e, const float* w, size_t stride, const float* bias, float* out) {
  __m512 acc[DV];
  for (int v = 0; v < DV; ++v) acc[v] = _mm512_loadu_ps(bias + 16 * v);
  for (int c = 0; c < e; ++c) {
    const __m512 x = _mm512_set1_ps(u[c]);
    for (int v = 0; v < DV; ++v) acc[v] = _mm512_fmadd_ps(x, _mm512_loadu_ps(w + c * stride + 16 * v), acc[v]);
  }
  for (int v = 0; v < DV; ++v) _mm512_storeu_ps(out + 16 * v, acc[v]);
}

// Pass 3, one unit per head and query row (head-major, so that consecutive units share the head's Wv).
void RunMemoryOutputs(const void* args, int u0, int u1) {
  const MemoryAttention& a = *static_cast<const MemoryAttention*>(args);
  const int rows = a.queries * a.heads, per_head = a.groups * a.queries, hd = a.heads * a.d;
  thread_local std::vector<float> u;
  u.resize(a.e);
  for (int unit = u0; unit < u1; ++unit) {
    const int head = unit / per_head, group = unit % per_head / a.queries, query = unit % a.queries;
    const int row = query * a.heads + head;
    const size_t width = a.e + 2;
    const float* p = a.partial + (static_cast<size_t>(group) * a.chunks * rows + row) * width;
    const size_t chunk_stride = static_cast<size_t>(rows) * width;
    float top = -INFINITY;
    for (int c = 0; c < a.chunks; ++c) top = std::max(top, p[c * chunk_stride + a.e]);
    float total = 0.0f;
    std::fill(u.begin(), u.end(), 0.0f);
    for (int c = 0; c < a.chunks; ++c) {
      const float* part = p + c * chunk_stride;
      const float weight = std::exp(part[a.e] - top);
      total += weight * part[a.e + 1];
      const __m512 w = _mm512_set1_ps(weight);
      for (int k = 0; k < a.e; k += 16) {
        _mm512_storeu_ps(u.data() + k, _mm512_fmadd_ps(w, _mm512_loadu_ps(part + k), _mm512_loadu_ps(u.data() + k)));
      }
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / total);
    for (int k = 0; k < a.e; k += 16) _mm512_storeu_ps(u.data() + k, _mm512_mul_ps(_mm512_loadu_ps(u.data() + k), inverse));
    const float* w = a.wkv + hd + static_cast<size_t>(head) * a.d;
    const float* bias = a.bkv + hd + static_cast<size_t>(head) * a.d;
    float* out = a.out + (static_cast<size_t>(group) * a.queries + query) * hd + static_cast<size_t>(head) * a.d;
    switch (a.d / 16) {
      case 1: MemoryProject<1>(u.data(), a.e, w, 2 * hd, bias, out); break;
      case 2: MemoryProject<2>(u.data(), a.e, w, 2 * hd, bias, out); break;
      case 4: MemoryProject<4>(u.data(), a.e, w, 2 * hd, bias, out); break;
      case 8: MemoryProject<8>(u.data(), a.e, w, 2 * hd, bias, out); break;
      default: std::abort();  // xlagen only emits D = 16, 32, 64 or 128
    }
  }
}

constexpr int kMemoryChunkFloats = 1 << 16;  // a chunk of M up to 256 KB: it and the next stay in L2

// The backend config is "groups,queries,heads,d,l,e,scale" (scale printed with 9 significant digits); the
// operands q, m, wkt, wkv, bkv (see MemoryAttention).
extern "C" void xlagen_f32_memory_attention(void* out, const void** in, const char* opaque, size_t opaque_len,
                                            XlaCustomCallStatus_* /*status*/) {
  MemoryAttention a{static_cast<const float*>(in[0]), static_cast<const float*>(in[1]),
                    static_cast<const float*>(in[2]), static_cast<const float*>(in[3]),
                    static_cast<const float*>(in[4]), static_cast<float*>(out), nullptr, nullptr,
                    0, 0, 0, 0, 0, 0, 0, 0, 0.0f};
  const BackendConfig config(opaque, opaque_len);
  if (std::sscanf(config.text, "%d,%d,%d,%d,%d,%d,%f", &a.groups, &a.queries, &a.heads, &a.d, &a.l, &a.e,
                  &a.scale) != 7 || a.groups < 1 || a.queries < 1 || a.l < 1 || a.e % 64 != 0 || a.d % 16 != 0) {
    std::abort();
  }
  Pool& pool = GetPool();
  // Chunks of at most kMemoryChunkFloats, and at least two per thread over all memory rows.
  const int longest = std::max(4, kMemoryChunkFloats / a.e / 4 * 4);
  int chunks = std::max((a.l + longest - 1) / longest, (2 * pool.threads() + a.groups - 1) / a.groups);
  chunks = std::min(chunks, (a.l + 15) / 16);
  a.chunk = (a.l + chunks - 1) / chunks;
  a.chunks = (a.l + a.chunk - 1) / a.chunk;
  const int rows = a.queries * a.heads;
  thread_local std::vector<float> qp, partial;
  qp.resize(static_cast<size_t>(a.groups) * rows * a.e);
  partial.resize(static_cast<size_t>(a.groups) * a.chunks * rows * (a.e + 2));
  a.qp = qp.data();
  a.partial = partial.data();
  pool.Run(Task{&a, RunMemoryQueries, a.groups * rows});
  pool.Run(Task{&a, RunMemoryChunks, a.groups * a.chunks});
  pool.Run(Task{&a, RunMemoryOutputs, a.groups * rows});
}

// The backend config is "rows,n".
extern "C" void xlagen_f32_argmax(void* out, const void** in, const char* opaque, size_t opaque_len,
                                  XlaCustomCallStatus_* /*status*/) {
  const BackendConfig config(opaque, opaque_len);
  int rows = 0;
  Argmax a{static_cast<const float*>(in[0]), static_cast<int32_t*>(out), 0};
  if (std::sscanf(config.text, "%d,%d", &rows, &a.n) != 2 || rows < 0 || a.n < 1) std::abort();
  if (rows < 2) {
    RunArgmax(&a, 0, rows);
  } else {
    GetPool().Run(Task{&a, RunArgmax, rows});
  }
}

// Sets how many KiB of the product expected next each idle worker prefetches (0: none), for the calls from
// now on; the environment's XLAGEN_NATIVE_LOOKAHEAD_KB (default kDefaultLookaheadKB) until then.
extern "C" void xlagen_set_lookahead(long kib) {
  GetPool().set_lookahead(kib < 0 ? 0 : static_cast<size_t>(kib) * 1024);
}
extern "C" long xlagen_lookahead() { return static_cast<long>(GetPool().lookahead() / 1024); }

// [float32 product calls, calls that were the product predicted after the previous one, bytes read ahead]
extern "C" void xlagen_lookahead_counts(long* out) {
  GetSuccessors().Count(out);
  out[2] = g_read_ahead.load(std::memory_order_relaxed);
}

// Registers the target with XLA's registry of custom-call targets (xla::CustomCallTargetRegistry, in
// libtensorflow_cc, which TensorFlow has loaded by the time xlagen calls this). The registry is looked up
// by its exported symbols rather than linked: linking against the 1 GB library takes longer than
// compiling this file. Returns 0 on success, or a negative code saying which lookup failed.
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
  add(global(), std::string("xlagen_bf16_matmul"), reinterpret_cast<void*>(&xlagen_bf16_matmul), std::string("Host"));
  add(global(), std::string("xlagen_f32_matmul"), reinterpret_cast<void*>(&xlagen_f32_matmul), std::string("Host"));
  add(global(), std::string("xlagen_int8_matmul"), reinterpret_cast<void*>(&xlagen_int8_matmul), std::string("Host"));
  add(global(), std::string("xlagen_f32_attention"), reinterpret_cast<void*>(&xlagen_f32_attention),
      std::string("Host"));
  add(global(), std::string("xlagen_f32_step_attention"), reinterpret_cast<void*>(&xlagen_f32_step_attention),
      std::string("Host"));
  add(global(), std::string("xlagen_f32_argmax"), reinterpret_cast<void*>(&xlagen_f32_argmax), std::string("Host"));
  add(global(), std::string("xlagen_f32_memory_attention"), reinterpret_cast<void*>(&xlagen_f32_memory_attention),
      std::string("Host"));
  return 0;
}
