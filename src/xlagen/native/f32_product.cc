// The float32 product y[M, N] = x[M, K] @ W[K, N], W row-major as XLA stores it (no copy, no packing).
//
// XLA's own dot streams a decoding step's weights more slowly than the cores can read them; this product
// reads, for up to sixteen rows of x (every product xlagen sends it), long runs of eight weight rows side by
// side (RunF32Stream), and for more rows each weight row in 1 KB runs with software prefetching
// (RunF32Units). After each product the pool's idle workers read ahead the weights of the product expected
// next (pool.h), while XLA runs the decoding step's other operations.

#include <cstring>
#include <vector>

#include "f32_product.h"
#include "pool.h"
#include "simd.h"

namespace xlagen {
namespace {

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

// acc[R rows][V vectors] += x[r0.., k0..k0+rows) @ w[k0.., kLanes v0 .. kLanes (v0 + V)) on a full block; y
// holds the running sums (zero when first is set).
template <int R, int V>
__attribute__((always_inline)) inline void F32Tile(const F32Product& a, const float* w, float* out, int r0, int v0,
                                                   int k0, int rows, bool first, const float* next) {
  // Two separate loops, not one with `first ? zero : load` per sum: GCC builds that one through the stack.
  Vec acc[R][V];
  if (first) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = Zero();
  } else {
    for (int r = 0; r < R; ++r) {
      const float* y = out + static_cast<size_t>(r0 + r) * a.n + kLanes * v0;
      for (int v = 0; v < V; ++v) acc[r][v] = Load(y + kLanes * v);
    }
  }
  const float* x = a.x + static_cast<size_t>(r0) * a.k + k0;
  for (int kk = 0; kk < rows; ++kk) {
    const float* row = w + static_cast<size_t>(kk) * a.n + kLanes * v0;
    if (next != nullptr) {  // each 64-byte line once
      const float* ahead = next + static_cast<size_t>(kk) * a.n + kLanes * v0;
      for (int f = 0; f < kLanes * V; f += 16) _mm_prefetch(reinterpret_cast<const char*>(ahead + f), _MM_HINT_T0);
    }
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = Load(row + kLanes * v);
    for (int r = 0; r < R; ++r) {
      const Vec xv = Set(x[static_cast<size_t>(r) * a.k + kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = out + static_cast<size_t>(r0 + r) * a.n + kLanes * v0;
    for (int v = 0; v < V; ++v) Store(y + kLanes * v, acc[r][v]);
  }
}

// Row r's vectors v.. of a narrow block, `whole` of them complete: tiles of V, then V / 2, ..., 1 vectors.
// Returns the first vector left (the partial one, if any).
template <int V>
int F32WholeVectors(const F32Product& a, const float* w, float* out, int r, int v, int whole, int k0, int rows,
                    bool first) {
  for (; whole - v >= V; v += V) F32Tile<1, V>(a, w, out, r, v, k0, rows, first, nullptr);
  if constexpr (V > 1) return F32WholeVectors<V / 2>(a, w, out, r, v, whole, k0, rows, first);
  return v;
}

// A full block's rows of x from *r, R at a time, each in tiles of V vectors; *r is left at the first row not
// done. Only the tiles of rows 0.. ask for the next chunk (`next`).
template <int R, int V>
__attribute__((always_inline)) inline void F32Rows(const F32Product& a, const float* w, float* out, int* r, int k0,
                                                   int rows, bool first, const float* next) {
  for (; *r + R <= a.m; *r += R) {
    for (int v = 0; v < kBlock / kLanes; v += V) {
      F32Tile<R, V>(a, w, out, *r, v, k0, rows, first, *r == 0 ? next : nullptr);
    }
  }
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
        // Eight rows at a time (AVX-512; four with AVX2's 16 registers) read the chunk once per pass, so
        // the next chunk's prefetches are spread over all the multiplications of this one. Each tile keeps
        // 16 sums (AVX-512) or 8 (AVX2) in registers.
        int r = 0;
        if constexpr (kAvx512) {
          F32Rows<8, 2>(a, w, out, &r, k0, rows, first, next);
          F32Rows<4, 4>(a, w, out, &r, k0, rows, first, next);
          F32Rows<2, 8>(a, w, out, &r, k0, rows, first, next);
          F32Rows<1, 16>(a, w, out, &r, k0, rows, first, next);
        } else {
          F32Rows<4, 2>(a, w, out, &r, k0, rows, first, next);
          F32Rows<2, 4>(a, w, out, &r, k0, rows, first, next);
          F32Rows<1, 8>(a, w, out, &r, k0, rows, first, next);
        }
        continue;
      }
      // The last, narrower block (fewer than kBlock columns): whole vectors, then one masked vector.
      const int whole = (a.n - c0) / kLanes;
      for (int r = 0; r < a.m; ++r) {
        const int v = F32WholeVectors<8>(a, w, out, r, 0, whole, k0, rows, first);
        if (v * kLanes < a.n - c0) {
          const Mask mask = FirstLanes(a.n - c0 - v * kLanes);
          float* y = out + static_cast<size_t>(r) * a.n + kLanes * v;
          const float* x = a.x + static_cast<size_t>(r) * a.k + k0;
          Vec acc = first ? Zero() : LoadMasked(mask, y);
          for (int kk = 0; kk < rows; ++kk) {
            acc = Fma(Set(x[kk]), LoadMasked(mask, w + static_cast<size_t>(kk) * a.n + kLanes * v), acc);
          }
          StoreMasked(y, mask, acc);
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
// `benchmarks/kernel_variants.py`). The sums are in the same order: weight row by
// weight row.
// Up to this many rows of x, a pass covers two vectors of columns for every row; from one more, one vector
// for all the rows (up to 16 sums in registers; see kPassRows), so that each weight vector is read once per
// group. At 4 to 16 rows one vector per pass read GPT-2's step 1.06-1.73x faster than two vectors for 8 rows
// at a time (the rows beyond 8 in a second sweep over the same weights), at 1 and 2 rows no faster.
constexpr int kWideM = 3;
// From this many rows of x, the multiply-adds take long enough per weight line that the hardware's own
// prefetching leaves the loads waiting (memory and arithmetic took the sum of their times, not the larger):
// each pass asks for the next group's same columns, kStreamRows rows down. At 8 rows this read GPT-2's
// products 1.14-1.45x faster (two vectors per pass); with one vector per pass, 4 to 7 rows gained too
// (0.99-1.05x).
constexpr int kPrefetchM = 4;
// Up to this many rows of x, x's eight broadcast vectors per row stay in registers; beyond, they would be
// spilled, and x is broadcast from memory instead (one row: 0.96-0.99x as fast from memory). AVX2 has 16
// registers: one row's eight.
constexpr int kVectorM = kAvx512 ? 2 : 1;
// Rows of x per pass over a group's weight vector: every row (AVX-512: up to 16 sums in registers), or up to
// 8 with AVX2, whose 16 registers hold 8 sums, the weight vector and a broadcast; the rows beyond take a
// second pass over the same vector, from L1.
constexpr int kPassRows = kAvx512 ? kMaxStreamM : 8;
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
__attribute__((always_inline)) inline Vec Lane(const Vec* x, int i) { return x[i]; }
__attribute__((always_inline)) inline Vec Lane(const float* x, int i) { return Set(x[i]); }

// Rows R0..R1 (of R) of packed sums, V vectors of columns from j (Masked: one vector under `mask`), `sums` at
// row 0 of those columns: the running sums (zero when first is set) plus the weight rows w[s] times
// x[s * R + r]; with Ahead, each weight line of the next group (`ahead` floats down) is asked for.
template <int R, int R0, int R1, int V, bool Ahead, bool Masked, typename X>
__attribute__((always_inline)) inline void StreamRows(const float* const* w, const X* x, float* sums, int j,
                                                      bool first, Mask mask, size_t ahead) {
  Vec acc[R1 - R0][V];
  for (int r = R0; r < R1; ++r) {
    for (int v = 0; v < V; ++v) {
      acc[r - R0][v] = first ? Zero() : LoadAligned(sums + kPackColumns * r + kLanes * v);
    }
  }
#pragma GCC unroll 8
  for (int s = 0; s < kStreamRows; ++s) {
    Vec wv[V];
    for (int v = 0; v < V; ++v) {
      if constexpr (Ahead) {  // each 64-byte line once
        if (kAvx512 || (j + kLanes * v) % 16 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(w[s] + ahead + j + kLanes * v), _MM_HINT_T0);
        }
      }
      wv[v] = Masked ? LoadMasked(mask, w[s] + j) : Load(w[s] + j + kLanes * v);
    }
    for (int r = R0; r < R1; ++r) {
      const Vec xv = Lane(x, s * R + r);
      for (int v = 0; v < V; ++v) acc[r - R0][v] = Fma(xv, wv[v], acc[r - R0][v]);
    }
  }
  for (int r = R0; r < R1; ++r) {
    for (int v = 0; v < V; ++v) StoreAligned(sums + kPackColumns * r + kLanes * v, acc[r - R0][v]);
  }
}

// All R rows of packed sums for V vectors of columns from j (see StreamRows): one pass over the weight
// vectors for up to kPassRows rows, else two, each over half the rows.
template <int R, int V, bool Ahead, bool Masked, typename X>
__attribute__((always_inline)) inline void StreamVectors(const float* const* w, const X* x, float* sums, int j,
                                                         bool first, Mask mask, size_t ahead) {
  if constexpr (R <= kPassRows) {
    StreamRows<R, 0, R, V, Ahead, Masked>(w, x, sums, j, first, mask, ahead);
  } else {
    StreamRows<R, 0, (R + 1) / 2, V, Ahead, Masked>(w, x, sums, j, first, mask, ahead);
    StreamRows<R, (R + 1) / 2, R, V, false, Masked>(w, x, sums, j, first, mask, ahead);
  }
}

// The unit's group of weight rows over all its columns: passes of V vectors for every row (two, then the
// rest one by one for few rows; one for more), the last vector under `tail` if it is partial.
template <int R, int V, bool Ahead, typename X>
__attribute__((always_inline)) inline void StreamGroup(const float* const* w, const X* x, float* sums, int whole,
                                                       int width, Mask tail, bool first, size_t ahead) {
  auto at = [&](int j) { return PackedAt(sums, R, 0, j); };
  int j = 0;
  for (; j + kLanes * V <= whole; j += kLanes * V) {
    StreamVectors<R, V, Ahead, false>(w, x, at(j), j, first, tail, ahead);
  }
  for (; j < whole; j += kLanes) StreamVectors<R, 1, false, false>(w, x, at(j), j, first, tail, 0);
  if (j < width) StreamVectors<R, 1, false, true>(w, x, at(j), j, first, tail, 0);
}

template <int R>
void StreamUnits(const F32Product& a, int u0, int u1) {
  constexpr int V = R <= kWideM ? 2 : 1;
  for (int u = u0; u < u1; ++u) {
    const Unit unit = UnitOf(a, u, a.span);
    const int width = unit.columns, k_begin = unit.k_begin, k_end = unit.k_end;
    const int whole = width / kLanes * kLanes;
    const Mask tail = FirstLanes(width - whole);
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
        Vec xv[kStreamRows * R];
        for (int i = 0; i < kStreamRows * R; ++i) xv[i] = Set(xs[i]);
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
      for (int j = 0; j < width; j += kLanes) {
        const Vec v = LoadAligned(PackedAt(sums, R, r, j));
        if (j < whole) {
          Store(y + j, v);
        } else {
          StoreMasked(y + j, tail, v);
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
    default: break;  // xlagen_f32_product sends at most kMaxStreamM rows here
  }
}

}  // namespace

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

}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_f32_product(const float* x, const float* w, float* y, int m, int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_f32_product: m, k and n must be at least 1";
  F32Product a{x, w, y, nullptr, m, k, n, 0, 0, 0};
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
  return nullptr;
}
