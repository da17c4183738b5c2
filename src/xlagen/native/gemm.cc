// The many-row product: y[M, N] = x[M, K] @ W for a prompt's or an encoder's products, where the work is the
// arithmetic (M x K x N multiply-adds against K x N weights read), not the weights' bytes. The streaming
// products (f32_product.cc, packed_product.cc) keep a few rows' sums in registers over the whole of K; here
// the weights are widened to float32 once per block and reused by every row.
//
// Layout of the work: each unit is a block of at most kBlockColumns output columns (the columns split evenly,
// see Blocks) of a part of the rows (one part per thread, RowParts). For each run of kDepth weight
// rows, the unit copies its block of W into a float32 buffer strip by strip (a strip: kStrip = 2 vectors of
// columns, kDepth rows, contiguous: the 2 vectors of a weight row are one 64- or 128-byte load), widening
// bfloat16 or int8 weights (their scale applied) on the way; then a register tile of kTileRows rows of x by
// one strip runs over the kDepth rows, broadcasting x and multiplying by the strip's 2 vectors (AVX2: 12
// sums, 2 weight vectors and a broadcast in 16 registers). The buffer (kDepth x kBlockColumns floats) stays
// in the core's L2 cache while the part's rows pass over it; a tile's rows of x over kDepth stay in L1.
// With AVX-512 and several blocks of columns (PackRowsFor), each thread first packs its part's rows of x for
// the tiles (PackRows): a tile's 14 broadcasts then read one contiguous run of floats rather than 14 rows K
// floats apart (14 pointers, which GCC keeps on the stack, and rows that share a set of the L1 cache when K is
// a multiple of 1024).
// Sums over successive runs of K are added into y; after the last, the float32 product's epilogue (a bias, an
// activation, a residual) is applied to the tile's rows as they are stored (a linear one in registers) or
// while they are in L1.

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "simd.h"

namespace xlagen {
namespace {

constexpr int kStrip = 2 * kLanes;               // output columns of a strip (2 vectors)
constexpr int kTileRows = kAvx512 ? 14 : 6;      // rows of x per register tile (2 kTileRows sums)
constexpr int kDepth = 256;                      // weight rows per run
constexpr int kBlockColumns = 8 * kStrip;        // output columns per unit (AVX2: 128, 128 KB of buffer)

enum class Weights { kFloat32, kBfloat16, kInt8 };

struct Gemm {
  const float* x;
  const void* w;
  float* y;
  int m, k, n;
  Weights kind;
  int blocks, parts;  // blocks of columns (Blocks) and parts of the rows (RowParts); unit u: part u / blocks,
                      // block u % blocks
  unsigned long call;  // this call's number (PackedRows: which call a thread's packed rows belong to)
  bool pack_rows;      // whether the threads pack their parts' rows (PackRows)
  const float* bias;      // [n], added to y after its last run of K (y + b, the float32 add of a separate one); or null
  int activation;         // then applied (Activation, simd.h)
  const float* residual;  // [m, n], then added (Epilogue8); or null
};

constexpr int kPanelStrips = kInt8Panel / kStrip;  // a block's strips start at int8 panel boundaries

constexpr int kBlockStrips = kBlockColumns / kStrip;

// Blocks of at most kBlockStrips strips, as even as whole panels allow: of equal strips where a width of at
// least half a block divides them (384 columns: 2 of 192, not 256 and 128, which left a thread idle for a
// quarter of the product; 1152: 6 of 192), else the fewest that hold the panels, which BlockStrip shares
// out evenly.
int Blocks(int n) {
  const int strips = (n + kStrip - 1) / kStrip, panels = (strips + kPanelStrips - 1) / kPanelStrips;
  for (int width = kBlockStrips; 2 * width >= kBlockStrips; width -= kPanelStrips) {
    if (strips % width == 0) return strips / width;
  }
  constexpr int kBlockPanels = kBlockStrips / kPanelStrips;
  return (panels + kBlockPanels - 1) / kBlockPanels;
}

// The first strip of block b of `blocks` (b = blocks: the end, `strips`): block b starts at panel
// b * panels / blocks, so no block has more than kBlockStrips strips (RunProduct checks; tests/native: every n
// up to 3,000).
int BlockStrip(int b, int blocks, int strips) {
  const int panels = (strips + kPanelStrips - 1) / kPanelStrips;
  return b == blocks ? strips : std::min(strips, b * panels / blocks * kPanelStrips);
}

// Units of a block of columns by a part of the rows, in the order of the parts: one part per thread (fewer
// for fewer tiles of rows). The caller takes units from the front and the workers from the back, so each
// thread writes rows of its own, as XLA's next operation then reads them per thread (with units of all the
// rows by blocks of columns, Whisper-tiny's float32 encoder ran 0.96x as fast as on XLA's dot; so, 1.00x).
int RowParts(int m, int threads) { return std::max(1, std::min(threads, (m + kTileRows - 1) / kTileRows)); }

// The first row of part p of `parts` (p = parts: m). The parts have the same number of rows, give or take
// one, and each ends in a tile of the rows left over, rather than whole tiles split between the parts: 512
// rows in tiles of 14 made parts of 252 and 260 rows, and the thread of the first waited for the other at
// the end of each product (GPT-2-small's float32 first token from 512 tokens took 1.02x as long, T5-small's
// 1.03x, alternating processes).
int PartRow(int p, int parts, int m) { return static_cast<int>(static_cast<long>(p) * m / parts); }

// strip[kk][0..kStrip) = W[k0 + kk, c0 .. c0 + kStrip) as float32 for kk < depth (columns past n: 0).
void PackStrip(const Gemm& a, int k0, int depth, int c0, float* strip) {
  if (a.kind == Weights::kFloat32) {
    const float* w = static_cast<const float*>(a.w);
    const int left = a.n - c0;
    if (left >= kStrip) {
      for (int kk = 0; kk < depth; ++kk) {
        const float* row = w + static_cast<size_t>(k0 + kk) * a.n + c0;
        Store(strip + kk * kStrip, Load(row));
        Store(strip + kk * kStrip + kLanes, Load(row + kLanes));
      }
    } else {
      const Mask first = FirstLanes(std::min(left, kLanes)), second = FirstLanes(std::max(left - kLanes, 0));
      for (int kk = 0; kk < depth; ++kk) {
        const float* row = w + static_cast<size_t>(k0 + kk) * a.n + c0;
        Store(strip + kk * kStrip, LoadMasked(first, row));
        Store(strip + kk * kStrip + kLanes, left > kLanes ? LoadMasked(second, row + kLanes) : Zero());
      }
    }
  } else if (a.kind == Weights::kBfloat16) {
    // Panel p = c0 / kPanel, words[p][k][j]: column 32p + j in the low half, 32p + 16 + j in the high half.
    const uint32_t* panel = static_cast<const uint32_t*>(a.w) + static_cast<size_t>(c0 / kPanel) * a.k * 16;
    for (int kk = 0; kk < depth; ++kk) {
      const uint32_t* row = panel + static_cast<size_t>(k0 + kk) * 16;
      if constexpr (kAvx512) {  // the strip is the whole panel
        const Words words = LoadWords(row);
        Store(strip + kk * kStrip, LowHalves(words));
        Store(strip + kk * kStrip + kLanes, HighHalves(words));
      } else {  // the strip is the panel's low (c0 % 32 == 0) or high halves
        const Words first = LoadWords(row), second = LoadWords(row + kLanes);
        const bool high = c0 % kPanel != 0;
        Store(strip + kk * kStrip, high ? HighHalves(first) : LowHalves(first));
        Store(strip + kk * kStrip + kLanes, high ? HighHalves(second) : LowHalves(second));
      }
    }
  } else {
    // Panel p = c0 / kInt8Panel: rows of 64 int8 weights, then the 64 columns' float32 scales.
    const int8_t* panel =
        static_cast<const int8_t*>(a.w) + static_cast<size_t>(c0 / kInt8Panel) * (a.k + 4) * kInt8Panel;
    const int offset = c0 % kInt8Panel;
    const float* scales = reinterpret_cast<const float*>(panel + static_cast<size_t>(a.k) * kInt8Panel) + offset;
    const Vec s0 = Load(scales), s1 = Load(scales + kLanes);
    for (int kk = 0; kk < depth; ++kk) {
      const int8_t* row = panel + static_cast<size_t>(k0 + kk) * kInt8Panel + offset;
      Store(strip + kk * kStrip, Mul(LoadInt8(row), s0));
      Store(strip + kk * kStrip + kLanes, Mul(LoadInt8(row + kLanes), s1));
    }
  }
}

// y[0 .. columns) of one row (at most kStrip), in place: the epilogue (bias and residual at the row's first
// column, or null).
inline void Epilogue(float* y, const float* bias, int activation, const float* residual, int columns) {
  for (int j = 0; j < columns; j += 8) {
    const int count = std::min(8, columns - j);
    StoreFirst8(y + j, Epilogue8(LoadFirst8(y + j, count), bias ? bias + j : nullptr, count, activation,
                                 residual ? residual + j : nullptr), count);
  }
}

// y[m0 .. m0 + R, c0 .. c0 + columns) (+)= x[m0 .., k0 .. k0 + depth) @ strip, then the epilogue if the run is
// K's last; R a compile-time count so that the 2 R sums stay in registers. x points at x[m0, k0]: in x itself
// (the tile's rows K floats apart), or with kPacked in the part's packed rows (PackRows: the tile's R values
// of each k side by side, kTileRows floats per k).
template <int R, bool kPacked>
inline void Tile(const Gemm& a, const float* strip, const float* x, int m0, int k0, int depth, int c0, int columns,
                 bool add) {
  Vec lo[R], hi[R];
  const size_t row = kPacked ? 1 : a.k, step = kPacked ? kTileRows : 1;
  const bool last = k0 + depth == a.k;
  // Row i of the residual at the tile's first column, after K's last run; else null.
  const auto residual_row = [&](int i) -> const float* {
    return a.residual != nullptr && last ? a.residual + static_cast<size_t>(m0 + i) * a.n + c0 : nullptr;
  };
  if (a.residual != nullptr && last) {
    // The epilogue's residual rows, fetched while the sums run: read when the epilogue needs them, R rows a
    // row of y apart each missed the cache in turn (GPT-2-small's float32 first token from 512 tokens took
    // 1.02x as long as with XLA's add after the product; with the rows fetched ahead, 0.995x).
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(residual_row(i)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(residual_row(i) + kStrip - 1), _MM_HINT_T0);
    }
  }
  {  // the first weight row's products start the sums (the same floats as adding them to zeros)
    const Vec w0 = Load(strip), w1 = Load(strip + kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec xv = Set(x[i * row]);
      lo[i] = Mul(xv, w0);
      hi[i] = Mul(xv, w1);
    }
  }
#pragma GCC unroll 2
  for (int kk = 1; kk < depth; ++kk) {
    const Vec w0 = Load(strip + kk * kStrip), w1 = Load(strip + kk * kStrip + kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec xv = Set(x[i * row + kk * step]);
      lo[i] = Fma(xv, w0, lo[i]);
      hi[i] = Fma(xv, w1, hi[i]);
    }
  }
  // After K's last run, the epilogue of whole strips is applied in registers, as y is stored: the same float32
  // operations in the same order as Epilogue's, a vector at a time, without reading y back (with GELU's
  // epilogue on 8 lanes after the store, GPT-2-small's feed-forward input projections spent 6 % of their
  // tiles' time in it).
  for (int i = 0; i < R; ++i) {
    float* y = a.y + static_cast<size_t>(m0 + i) * a.n + c0;
    if (columns >= kStrip) {
      Vec v0 = add ? Add(lo[i], Load(y)) : lo[i], v1 = add ? Add(hi[i], Load(y + kLanes)) : hi[i];
      if (last && a.bias != nullptr) {
        v0 = Add(v0, Load(a.bias + c0));
        v1 = Add(v1, Load(a.bias + c0 + kLanes));
      }
      if (last && a.activation != kLinear) {
        v0 = Activate(v0, a.activation);
        v1 = Activate(v1, a.activation);
      }
      if (last && a.residual != nullptr) {
        v0 = Add(v0, Load(residual_row(i)));
        v1 = Add(v1, Load(residual_row(i) + kLanes));
      }
      Store(y, v0);
      Store(y + kLanes, v1);
      continue;
    }
    // A partial strip: its lanes stored, then the epilogue over them in place.
    const int first = std::min(columns, kLanes), second = columns - first;
    StoreFirst(y, add ? Add(lo[i], LoadMasked(FirstLanes(first), y)) : lo[i], first);
    if (second > 0) {
      StoreFirst(y + kLanes, add ? Add(hi[i], LoadMasked(FirstLanes(second), y + kLanes)) : hi[i], second);
    }
    if ((a.bias != nullptr || a.activation != kLinear || a.residual != nullptr) && last) {
      Epilogue(y, a.bias ? a.bias + c0 : nullptr, a.activation, residual_row(i), columns);
    }
  }
}

// The rows of x a thread packed last (PackRows): call `call`'s part `part`, or none (part -1).
struct PackedRows {
  unsigned long call = 0;
  int part = -1;
  std::vector<float> rows;
};

// Packing copies each row of x once per call and thread, and saves the strided reads of every block after.
// Measured (2 threads, AVX-512): with three blocks of columns or more a gain for any rows up to 16 MB per thread
// (GPT-2-small's products 1.04-1.09x as fast); with two, a gain for rows up to 4 MB (T5-small's 2048 x 512
// product 1.08x) and a loss above (Whisper-tiny's 1536 x 384, 4.6 MB of rows per thread: 0.94x); with one
// block, nothing to save.
bool PackRowsFor(int blocks, size_t part_floats) {
  return kAvx512 && (blocks >= 3 ? part_floats <= (size_t{1} << 22) : blocks == 2 && part_floats <= (size_t{1} << 20));
}

#if defined(__AVX512F__)
// Transposes the 16 x 16 floats of r: lane i of r[j] becomes lane j of r[i].
inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved: 2 x 2 blocks
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 4 x 4 blocks within each 128-bit lane
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // the 128-bit lanes of the 4 groups of 4 rows
    const __m512 d0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), d1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 d2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44),
                 d3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_f32x4(d0, d2, 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(d0, d2, 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(d1, d3, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(d1, d3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// packed[(t * K + k) * kTileRows + i] = x[r0 + t * kTileRows + i, k] for the tiles t of rows [r0, r1) (a last
// tile's missing rows: 0), 16 values of k of each row at a time.
void PackRows(const Gemm& a, int r0, int r1, float* packed) {
  static_assert(kTileRows <= 16, "a tile's rows are lanes of one vector");
  for (int t0 = r0; t0 < r1; t0 += kTileRows) {
    const int rows = std::min(kTileRows, r1 - t0);
    float* tile = packed + static_cast<size_t>(t0 - r0) * a.k;
    for (int k0 = 0; k0 < a.k; k0 += 16) {
      const int depth = std::min(16, a.k - k0);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < rows ? LoadMasked(FirstLanes(depth), a.x + static_cast<size_t>(t0 + i) * a.k + k0) : Zero();
      }
      Transpose16(r);
      for (int j = 0; j < depth; ++j) StoreFirst(tile + static_cast<size_t>(k0 + j) * kTileRows, r[j], kTileRows);
    }
  }
}
#else
void PackRows(const Gemm&, int, int, float*) {}  // not used: kAvx512 only
#endif

void RunGemm(const void* args, int u0, int u1) {
  const Gemm& a = *static_cast<const Gemm*>(args);
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(kDepth) * kBlockColumns + 64);
  float* strips = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float) % 16) % 16;
  thread_local PackedRows packed;
  const int all_strips = (a.n + kStrip - 1) / kStrip;
  for (int u = u0; u < u1; ++u) {
    const int block = u % a.blocks;
    const int b0 = BlockStrip(block, a.blocks, all_strips) * kStrip;
    const int b1 = std::min(a.n, BlockStrip(block + 1, a.blocks, all_strips) * kStrip);
    const int part = u / a.blocks;
    const int r0 = PartRow(part, a.parts, a.m), r1 = PartRow(part + 1, a.parts, a.m);
    const int count = (b1 - b0 + kStrip - 1) / kStrip;
    // The thread packs the rows of the part of its first unit of the call; a unit of another part (where the
    // threads meet, at the end of the call) reads its rows in x.
    if (a.pack_rows && packed.call != a.call) {
      packed.call = a.call;
      packed.part = part;
      // Grown, never shrunk: resize zeros what it adds, and a model's products alternate between two K's
      // (GPT-2-small's 768 and 3072), so each growth zeroed megabytes that PackRows then wrote.
      const size_t floats = static_cast<size_t>(r1 - r0 + kTileRows) * a.k;
      if (packed.rows.size() < floats) packed.rows.resize(floats);
      PackRows(a, r0, r1, packed.rows.data());
    }
    const bool packed_rows = a.pack_rows && packed.part == part;
    for (int k0 = 0; k0 < a.k; k0 += kDepth) {
      const int depth = std::min(kDepth, a.k - k0);
      if (a.kind == Weights::kFloat32 && (b1 - b0) % kStrip == 0) {
        // A block of whole strips of float32 rows: each row's floats of the block are contiguous, read in order.
        const float* w = static_cast<const float*>(a.w) + b0;
        for (int kk = 0; kk < depth; ++kk) {
          const float* row = w + static_cast<size_t>(k0 + kk) * a.n;
          for (int s = 0; s < count; ++s) {
            float* strip = strips + static_cast<size_t>(s) * kDepth * kStrip + kk * kStrip;
            Store(strip, Load(row + s * kStrip));
            Store(strip + kLanes, Load(row + s * kStrip + kLanes));
          }
        }
      } else {
        for (int s = 0; s < count; ++s) {
          PackStrip(a, k0, depth, b0 + s * kStrip, strips + static_cast<size_t>(s) * kDepth * kStrip);
        }
      }
      const bool add = k0 > 0;
      const auto run_tiles = [&](auto packed_constant) {  // the part's tiles of rows by the block's strips
        constexpr bool kPacked = decltype(packed_constant)::value;
        const auto x_at = [&](int m0) {
          return kPacked ? packed.rows.data() + static_cast<size_t>(m0 - r0) * a.k + static_cast<size_t>(k0) * kTileRows
                         : a.x + static_cast<size_t>(m0) * a.k + k0;
        };
        int m0 = r0;
        for (; m0 + kTileRows <= r1; m0 += kTileRows) {
          for (int s = 0; s < count; ++s) {
            const int c0 = b0 + s * kStrip;
            Tile<kTileRows, kPacked>(a, strips + static_cast<size_t>(s) * kDepth * kStrip, x_at(m0), m0, k0, depth,
                                     c0, b1 - c0, add);
          }
        }
        if (m0 < r1) {
          ForRows<kTileRows - 1>(r1 - m0, [&](auto rows) {
            for (int s = 0; s < count; ++s) {
              const int c0 = b0 + s * kStrip;
              Tile<decltype(rows)::value, kPacked>(a, strips + static_cast<size_t>(s) * kDepth * kStrip, x_at(m0),
                                                   m0, k0, depth, c0, b1 - c0, add);
            }
          });
        }
      };
      if (packed_rows) {
        run_tiles(std::true_type());
      } else {
        run_tiles(std::false_type());
      }
    }
  }
}

const char* RunProduct(const float* x, const void* w, float* y, int m, int k, int n, Weights kind,
                       const float* bias = nullptr, int activation = kLinear, const float* residual = nullptr) {
  Pool& pool = GetPool();
  static std::atomic<unsigned long> calls{0};
  const int blocks = Blocks(n), parts = RowParts(m, pool.threads());
  const int part_rows = (m + parts - 1) / parts;  // at most
  const bool pack_rows = PackRowsFor(blocks, static_cast<size_t>(part_rows + kTileRows) * k);
  Gemm a{x, w, y, m, k, n, kind, blocks, parts, ++calls, pack_rows, bias, activation, residual};
  const int strips = (n + kStrip - 1) / kStrip;
  for (int b = 0; b < a.blocks; ++b) {  // each unit's buffer holds kBlockStrips strips
    const int width = BlockStrip(b + 1, a.blocks, strips) - BlockStrip(b, a.blocks, strips);
    if (width < 1 || width > kBlockStrips) return "many-row product: a block of columns does not fit its buffer";
  }
  pool.Run(Task{&a, RunGemm, a.blocks * a.parts});
  return nullptr;
}

static_assert(kPanel % kStrip == 0 || kStrip % kPanel == 0, "a strip is within one bfloat16 panel or is one");
static_assert(kInt8Panel % kStrip == 0, "a strip is within one int8 panel");
static_assert(kBlockColumns % kInt8Panel == 0 && kBlockStrips % kPanelStrips == 0,
              "a unit's strips start at panel boundaries, and a block of whole panels has at most kBlockColumns");

}  // namespace
}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_f32_many_product_epilogue(const float* x, const float* w, const float* bias,
                                                        int activation, const float* residual, float* y, int m, int k,
                                                        int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_f32_many_product: m, k and n must be at least 1";
  if (activation < kLinear || activation > kGeluTanh) return "xlagen_f32_many_product: activation must be 0, 1 or 2";
  return RunProduct(x, w, y, m, k, n, Weights::kFloat32, bias, activation, residual);
}

extern "C" const char* xlagen_f32_many_product(const float* x, const float* w, float* y, int m, int k, int n) {
  return xlagen_f32_many_product_epilogue(x, w, nullptr, kLinear, nullptr, y, m, k, n);
}

extern "C" const char* xlagen_bf16_many_product(const float* x, const uint32_t* w, float* y, int m, int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_bf16_many_product: m, k and n must be at least 1";
  return RunProduct(x, w, y, m, k, n, Weights::kBfloat16);
}

extern "C" const char* xlagen_int8_many_product(const float* x, const int8_t* w, float* y, int m, int k, int n) {
  if (m < 1 || k < 1 || n < 1) return "xlagen_int8_many_product: m, k and n must be at least 1";
  return RunProduct(x, w, y, m, k, n, Weights::kInt8);
}
