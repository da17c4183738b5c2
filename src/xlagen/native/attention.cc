// The attention kernels: the softmax attention of a long encoder, a decoding step's masked self-attention over
// the cache, and a decoding step's cross-attention over an encoder output with the projections folded in.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "simd.h"
#include "vector_math.h"

namespace xlagen {
namespace {

// "xlagen_f32_attention": softmax(scale * q k^T) v over all keys (no mask), for each of B x H heads, for
// long self-attention (Whisper's encoder: 1500 positions). XLA computes the scores, writes them out
// [T, S], reads them back for the softmax and again for the product with v; here each unit (kAttentionRows
// query rows of one head) keeps its scores in the core's cache: the head's k and v (copied once per thread,
// k in panels of keys, v in panels of columns, as far as the thread's units read them) stay in L2 across its
// units. The scores are scaled after the product, as XLA does; the softmax
// divides once per output row rather than once per weight.
//
// With keys given transposed ([heads, d, s]: a decoder's cross-attention memory, transposed once when it
// is projected), the unit's few query rows read the keys straight from memory, one contiguous row of s
// keys per head dimension, rather than through a copy: each key and value is read once per unit, at the
// rate memory streams (XLA's dots over Whisper's memory read it at a third of that).
constexpr int kAttentionRows = kAvx512 ? 8 : 12;  // query rows per unit
// Sums a register tile keeps: 16 of AVX-512's 32 registers, 12 of AVX2's 16 (the rest hold the values or keys
// loaded and the broadcast weights). With fewer than 12, AVX2 tiles load about as often as they multiply.
constexpr int kTileSums = kAvx512 ? 16 : 12;
// The unit's scores against a head's keys in tiles of kScoreRows query rows x kScoreVectors vectors of keys.
constexpr int kScoreRows = kAvx512 ? 8 : 6;
constexpr int kScoreVectors = 2;
// A head's keys, transposed once per thread and call, in panels of kKeyPanel keys: kt[j / kKeyPanel][c][j %
// kKeyPanel], so that a tile of scores reads its keys' d x kKeyPanel values in one contiguous run.
constexpr int kKeyPanel = kLanes * kScoreVectors;
// Vectors of a head's columns per pass over the weights and values (AttentionOutput, MemoryProject).
constexpr int kMostHeadVectors = 8;

//
// With a mask (a prompt's causal and padding mask, `xlagen_masked_attention`), a unit scores only the keys
// from the first any of its rows may see to the last: under a causal mask that is about half of them, and
// none of the cache's positions after the prompt. Masked keys weigh exactly 0; a row that may see no key
// (a left-padding position) is the mean of all values, as XLA's softmax over equal masked scores gives.
//
// q, k (not transposed), v and out need not be tensors [heads, rows, d] of their own: each is read or written
// where its Layout says, e.g. the heads of a fused projection [B, T, 3 * H * d] in place, and the output as
// [B, T, H * d], the next product's input, with no transposes around the call.
struct Layout {
  // Row r of head h = sequence * heads_per_mask + i starts at offset + sequence * batch + i * head + r * row
  // (floats).
  size_t offset, batch, head, row;
};

// The layout of a tensor [heads, rows, d] of its own.
constexpr Layout Packed(int heads, int rows, int d) {
  return {0, static_cast<size_t>(heads) * rows * d, static_cast<size_t>(rows) * d, static_cast<size_t>(d)};
}

struct Attention {
  const float* q;  // [heads, t, d] (as laid out by lq)
  const float* k;  // [heads, s, d] (lk), or [heads, d, s] when transposed
  const float* v;  // [heads, s, d] (lv)
  float* out;      // [heads, t, d] (lo)
  int heads, t, s, d, blocks;  // blocks: units per head
  float scale;
  uint64_t call;  // which call this is: a thread's transposed k is reused within one call only
  int transposed;
  // Optional (not transposed only): mask[heads / heads_per_mask][row % mask_rows][key], nonzero where the
  // query row may see the key. heads_per_mask is also the heads of one sequence in the layouts.
  const uint8_t* mask = nullptr;
  int mask_rows = 0, heads_per_mask = 1;
  // Optional, with a mask: bias[head % bias_heads][row][key], added to the scaled scores (T5's relative
  // positions, shared by a batch's sequences when bias_heads is the heads of one). With `relative`, a bias
  // that depends only on key - row: bias[head % bias_heads][key - row + t - 1], t + s - 1 of them per head
  // (the dense bias's rows are its windows, one position apart).
  const float* bias = nullptr;
  int bias_heads = 1;
  int relative = 0;
  Layout lq, lk, lv, lo;
};

// Where row `row` of `head` starts in an operand laid out by l.
inline size_t At(const Attention& a, const Layout& l, int head, int row) {
  return l.offset + static_cast<size_t>(head / a.heads_per_mask) * l.batch +
         static_cast<size_t>(head % a.heads_per_mask) * l.head + static_cast<size_t>(row) * l.row;
}

// The mask's row of keys for query row `row` of `head`.
inline const uint8_t* MaskRow(const Attention& a, int head, int row) {
  return a.mask + (static_cast<size_t>(head / a.heads_per_mask) * a.mask_rows + row % a.mask_rows) * a.s;
}

// Bit i set where p[i] is 0, for the 32 bytes p[0..32).
inline unsigned ZeroBytes(const uint8_t* p) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return static_cast<unsigned>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256())));
}

// The index of the first nonzero byte of p[0..n), or n; 32 bytes at a time.
int FirstNonzero(const uint8_t* p, int n) {
  int j = 0;
  for (; j + 32 <= n; j += 32) {
    const unsigned zeros = ZeroBytes(p + j);
    if (zeros != 0xFFFFFFFFu) return j + __builtin_ctz(~zeros);
  }
  while (j < n && !p[j]) ++j;
  return j;
}

// One past the last nonzero byte of p[0..n), or 0; 32 bytes at a time from the end.
int EndOfNonzero(const uint8_t* p, int n) {
  int j = n;
  for (; j >= 32; j -= 32) {
    const unsigned zeros = ZeroBytes(p + j - 32);
    if (zeros != 0xFFFFFFFFu) return j - __builtin_clz(~zeros);
  }
  while (j > 0 && !p[j - 1]) --j;
  return j;
}

// The keys [*first, *last) any of the unit's rows sees, and which rows see none (bit r of the result).
unsigned VisibleKeys(const Attention& a, int head, int t0, int rows, int* first, int* last) {
  unsigned empty = 0;
  int lo = a.s, hi = 0;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = MaskRow(a, head, t0 + r);
    const int j0 = FirstNonzero(row, a.s);
    const int j1 = j0 + EndOfNonzero(row + j0, a.s - j0);
    if (j0 == j1) {
      empty |= 1u << r;
      continue;
    }
    lo = std::min(lo, j0);
    hi = std::max(hi, j1);
  }
  *first = lo < hi ? lo : 0;
  *last = lo < hi ? hi : 0;
  return empty;
}

std::atomic<uint64_t> g_attention_calls{0};

// Calls body(std::integral_constant<int, DV>) for the vectors of a head's columns per pass: d / kLanes, at
// most kMostHeadVectors (d one of ATTENTION_HEAD_DIMS).
template <typename Body>
__attribute__((always_inline)) inline void ForHeadVectors(int d, const Body& body) {
  switch (std::min(d / kLanes, kMostHeadVectors)) {
    case 1: body(std::integral_constant<int, 1>()); break;
    case 2: body(std::integral_constant<int, 2>()); break;
    case 4: body(std::integral_constant<int, 4>()); break;
    case 8: body(std::integral_constant<int, 8>()); break;
    default: break;  // the entry points take D = 16, 32, 64 or 128 only
  }
}

// out[rows of the unit] = weights[:, first:last] @ v[first:last] / sums, DV vectors of columns at a time (the
// whole head vector, except for D = 128 with AVX2), R rows of weights at a time (kTileSums sums).
// Value j's columns [c0, c0 + kLanes * DV) are at v + j * row_stride + c0 / (kLanes * DV) * block_stride: v
// itself (row_stride d, block_stride kLanes * DV), or a copy in column panels (row_stride kLanes * DV,
// block_stride s * kLanes * DV) whose runs of values a pass reads in order. The unit's output rows are out_row
// floats apart.
template <int DV>
void AttentionOutput(const Attention& a, const float* weights, int padded, const float* sums, const float* v,
                     size_t row_stride, size_t block_stride, float* out, size_t out_row, int rows, int first,
                     int last) {
  constexpr int R = kTileSums / DV < 1 ? 1 : (kTileSums / DV > kAttentionRows ? kAttentionRows : kTileSums / DV);
  for (int c0 = 0; c0 < a.d; c0 += kLanes * DV) {
    const float* block = v + static_cast<size_t>(c0 / (kLanes * DV)) * block_stride;
    for (int r0 = 0; r0 < rows; r0 += R) {
      Vec acc[R][DV];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < DV; ++c) acc[r][c] = Zero();
      for (int j = first; j < last; ++j) {
        Vec vv[DV];
        for (int c = 0; c < DV; ++c) vv[c] = Load(block + static_cast<size_t>(j) * row_stride + kLanes * c);
        for (int r = 0; r < R; ++r) {
          const Vec w = Set(weights[static_cast<size_t>(r0 + r) * padded + j]);
          for (int c = 0; c < DV; ++c) acc[r][c] = Fma(w, vv[c], acc[r][c]);
        }
      }
      for (int r = 0; r < R && r0 + r < rows; ++r) {
        const Vec inverse = Set(1.0f / sums[r0 + r]);
        for (int c = 0; c < DV; ++c) {
          Store(out + static_cast<size_t>(r0 + r) * out_row + c0 + kLanes * c, Mul(acc[r][c], inverse));
        }
      }
    }
  }
}

// The scaled scores [rows, padded] of a unit's query rows q [rows, d] against a head's transposed keys
// kt [d, s], accumulated one head dimension at a time: each kt row is read once, in order, and the rows'
// scores stay in L1. Columns from s to padded are left as they are (the softmax ignores them).
void TransposedScores(const Attention& a, const float* kt, const float* q, int rows, float* scores, int padded) {
  const int whole = a.s / kLanes * kLanes;
  const bool partial = whole < a.s;
  const Mask tail = FirstLanes(a.s - whole);
  for (int r = 0; r < rows; ++r) std::memset(scores + static_cast<size_t>(r) * padded, 0, sizeof(float) * a.s);
  for (int c = 0; c < a.d; ++c) {
    const float* row = kt + static_cast<size_t>(c) * a.s;
    for (int r = 0; r < rows; ++r) {
      const Vec x = Set(q[static_cast<size_t>(r) * a.d + c]);
      float* out = scores + static_cast<size_t>(r) * padded;
      for (int j = 0; j < whole; j += kLanes) Store(out + j, Fma(x, Load(row + j), Load(out + j)));
      if (partial) {
        const Vec k = LoadMasked(tail, row + whole);
        StoreMasked(out + whole, tail, Fma(x, k, LoadMasked(tail, out + whole)));
      }
    }
  }
  const Vec scale = Set(a.scale);
  for (int r = 0; r < rows; ++r) {
    float* out = scores + static_cast<size_t>(r) * padded;
    for (int j = 0; j < whole; j += kLanes) Store(out + j, Mul(Load(out + j), scale));
    if (partial) StoreMasked(out + whole, tail, Mul(LoadMasked(tail, out + whole), scale));
  }
}

void RunAttention(const void* args, int u0, int u1) {
  const Attention& a = *static_cast<const Attention*>(args);
  const int padded = (a.s + 31) / 32 * 32;  // score columns, in pairs of vectors
  // Columns of v per pass of AttentionOutput: two vectors, or one for a head that small.
  const int width = a.d >= 2 * kLanes ? 2 * kLanes : kLanes;
  thread_local std::vector<float> kt, vt, scores, q;
  thread_local uint64_t kt_call = 0;
  thread_local int kt_head = -1;
  thread_local int copied = 0;  // keys of kt_head in kt and vt
  scores.resize(static_cast<size_t>(kAttentionRows) * padded);
  q.resize(static_cast<size_t>(kAttentionRows) * a.d);
  for (int u = u0; u < u1; ++u) {
    const int head = u / a.blocks, t0 = (u % a.blocks) * kAttentionRows;
    const int rows = a.t - t0 < kAttentionRows ? a.t - t0 : kAttentionRows;
    int first = 0, last = a.s;
    const unsigned empty = a.mask ? VisibleKeys(a, head, t0, rows, &first, &last) : 0;
    // The unit's query rows, zeros past t (their scores are computed and not used).
    std::fill(q.begin(), q.end(), 0.0f);
    for (int r = 0; r < rows; ++r) {
      std::memcpy(q.data() + static_cast<size_t>(r) * a.d, a.q + At(a, a.lq, head, t0 + r), sizeof(float) * a.d);
    }
    const float* v = a.v + At(a, a.lv, head, 0);
    if (a.transposed) {
      TransposedScores(a, a.k + static_cast<size_t>(head) * a.s * a.d, q.data(), rows, scores.data(), padded);
    } else {
      if (kt_call != a.call || kt_head != head) {
        kt.resize(static_cast<size_t>(a.d) * padded);
        vt.resize(static_cast<size_t>(a.s) * a.d);
        kt_call = a.call;
        kt_head = head;
        copied = 0;
      }
      // The head's keys and values as far as this unit reads them, copied once per thread and head: k [s, d]
      // -> kt in panels of keys (zeros past s), v [s, d] -> vt in panels of the columns AttentionOutput takes
      // per pass, vt[c / w][j][c % w].
      const int upto = std::min((last + kKeyPanel - 1) / kKeyPanel * kKeyPanel, padded);
      if (copied < upto) {
        float* const keys = kt.data();
        float* const values = vt.data();
        const int vectors = width / kLanes;
        for (int j = copied; j < upto; ++j) {
          float* panel = keys + static_cast<size_t>(j / kKeyPanel) * a.d * kKeyPanel + j % kKeyPanel;
          const float* k = j < a.s ? a.k + At(a, a.lk, head, j) : nullptr;
          for (int c = 0; c < a.d; ++c) panel[static_cast<size_t>(c) * kKeyPanel] = k ? k[c] : 0.0f;
          if (j >= a.s) continue;
          const float* from = v + static_cast<size_t>(j) * a.lv.row;
          float* to = values + static_cast<size_t>(j) * width;
          for (int c = 0; c < a.d; c += width, from += width, to += static_cast<size_t>(a.s) * width) {
            for (int i = 0; i < vectors; ++i) Store(to + kLanes * i, Load(from + kLanes * i));
          }
        }
        copied = upto;
      }
      const Vec scale = Set(a.scale);
      constexpr int R = kScoreRows, V = kScoreVectors;
      const int j0 = first / (kLanes * V) * (kLanes * V);
      for (int j = j0; j < last; j += kLanes * V) {  // each panel of keys read from L1 by every tile of rows
        const float* panel = kt.data() + static_cast<size_t>(j / kKeyPanel) * a.d * kKeyPanel;
        for (int r0 = 0; r0 < kAttentionRows; r0 += R) {
          Vec acc[R][V];
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < V; ++v) acc[r][v] = Zero();
          for (int c = 0; c < a.d; ++c) {
            const float* row = panel + static_cast<size_t>(c) * kKeyPanel;
            Vec k[V];
            for (int v = 0; v < V; ++v) k[v] = Load(row + kLanes * v);
            for (int r = 0; r < R; ++r) {
              const Vec x = Set(q[static_cast<size_t>(r0 + r) * a.d + c]);
              for (int v = 0; v < V; ++v) acc[r][v] = Fma(x, k[v], acc[r][v]);
            }
          }
          for (int r = 0; r < R; ++r) {
            float* out = scores.data() + static_cast<size_t>(r0 + r) * padded + j;
            for (int v = 0; v < V; ++v) Store(out + kLanes * v, Mul(acc[r][v], scale));
          }
        }
      }
    }
    // Softmax numerators in place, and their sums (the columns outside [first, last) are never read).
    float sums[kAttentionRows];
    for (int r = 0; r < rows; ++r) {
      float* row = scores.data() + static_cast<size_t>(r) * padded + first;
      const int n = last - first;
      if (empty >> r & 1) {  // its output is replaced below
        std::fill(row, row + n, 0.0f);
        sums[r] = 1.0f;
        continue;
      }
      if (a.bias != nullptr) {  // (a bias comes with a mask)
        const float* bias =
            a.relative ? a.bias + static_cast<size_t>(head % a.bias_heads) * (a.t + a.s - 1) + (a.t - 1 - t0 - r) + first
                       : a.bias + (static_cast<size_t>(head % a.bias_heads) * a.t + t0 + r) * a.s + first;
        for (int j = 0; j < n; ++j) row[j] += bias[j];
      }
      const uint8_t* seen = a.mask ? MaskRow(a, head, t0 + r) + first : nullptr;
      if (seen == nullptr || std::memchr(seen, 0, n) == nullptr) {  // every key of the range visible
        sums[r] = ExpInPlace(row, n, RowMax(row, n));
        continue;
      }
      sums[r] = MaskedExpInPlace(row, seen, n);  // masked keys weigh exactly 0
    }
    float* out = a.out + At(a, a.lo, head, t0);
    // Two vectors of the head's columns per pass, so that a tile of weights has kTileSums / 2 rows: each
    // value is read once per that many rows (with the whole head per pass, once per row).
    // v itself with transposed keys (nothing was copied), else the thread's copy in column panels.
    const float* values = a.transposed ? v : vt.data();
    const size_t row_stride = a.transposed ? a.lv.row : width;
    const size_t block_stride = a.transposed ? width : static_cast<size_t>(width) * a.s;
    if (width == 2 * kLanes) {
      AttentionOutput<2>(a, scores.data(), padded, sums, values, row_stride, block_stride, out, a.lo.row, rows,
                         first, last);
    } else {
      AttentionOutput<1>(a, scores.data(), padded, sums, values, row_stride, block_stride, out, a.lo.row, rows,
                         first, last);
    }
    for (int r = 0; r < rows; ++r) {
      if (!(empty >> r & 1)) continue;
      float* row = out + static_cast<size_t>(r) * a.lo.row;
      std::fill(row, row + a.d, 0.0f);
      for (int j = 0; j < a.s; ++j)
        for (int c = 0; c < a.d; ++c) row[c] += v[static_cast<size_t>(j) * a.lv.row + c];
      for (int c = 0; c < a.d; ++c) row[c] /= static_cast<float>(a.s);
    }
  }
}

// One decoding step's self-attention (T = 1 per sequence; a prompt's K beams as K queries over its K slots of
// the cache laid end to end): for query i of group g and head h, the scores of the cache's S keys and of the
// step's own new key, softmax, and the weighted sum of the values and the new value. `bias` [G, bias_heads,
// K, S + 1] is added to the scaled scores; -inf marks a key the query may not see (its score is then
// mask_value, as `xlagen.layers.attention` masks: finite, so no row turns into NaN).
struct StepAttention {
  const float* q;      // [G, H, K, D]
  const float* k;      // [G, H, S, D]: the cache as it was before this step
  const float* v;      // [G, H, S, D]
  const float* new_k;  // [G, H, K, D]
  const float* new_v;  // [G, H, K, D]
  const float* bias;   // [G, bias_heads, K, S + 1]
  float* out;          // [G, H, K, D]
  int heads, queries, s, d, bias_heads;
  float scale, mask_value;
};

// Steps with fewer multiply-adds than this (heads x queries x keys x head dim) run on the calling thread
// alone: waking the workers would stop them reading the next product's weights ahead, for a few us of work.
constexpr long kStepAttentionAlone = 1L << 20;

void RunStepAttention(const void* args, int u0, int u1) {
  const StepAttention& a = *static_cast<const StepAttention*>(args);
  thread_local std::vector<float> scores;
  const int n = a.s + 1;  // the cache's keys, then the new one
  scores.resize(static_cast<size_t>(n));
  const int vectors = (a.d + kLanes - 1) / kLanes;  // of a head vector, the last under `last`
  const Mask last = FirstLanes(a.d - kLanes * (vectors - 1));
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
      float score = a.mask_value;
      if (bias[j] != -INFINITY) {
        const float* key = j < a.s ? k + static_cast<size_t>(j) * a.d : a.new_k + static_cast<size_t>(u) * a.d;
        score = DotRow(q, key, vectors, last) * a.scale + bias[j];
      }
      row[j] = score;
      top = score > top ? score : top;
    }
    const float total = ExpInPlace(row, n, top);
    // The weighted values (a masked key's weight is 0 and is skipped: its value is never read).
    Vec acc[kStepAttentionMaxD / kLanes];
    for (int c = 0; c < vectors; ++c) acc[c] = Zero();
    for (int j = 0; j < n; ++j) {
      if (row[j] == 0.0f) continue;
      const Vec w = Set(row[j]);
      const float* value = j < a.s ? v + static_cast<size_t>(j) * a.d : a.new_v + static_cast<size_t>(u) * a.d;
      for (int c = 0; c + 1 < vectors; ++c) acc[c] = Fma(w, Load(value + kLanes * c), acc[c]);
      acc[vectors - 1] = Fma(w, LoadMasked(last, value + kLanes * (vectors - 1)), acc[vectors - 1]);
    }
    const Vec inverse = Set(1.0f / total);
    float* out = a.out + static_cast<size_t>(u) * a.d;
    for (int c = 0; c + 1 < vectors; ++c) Store(out + kLanes * c, Mul(acc[c], inverse));
    StoreMasked(out + kLanes * (vectors - 1), last, Mul(acc[vectors - 1], inverse));
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
// layer for Whisper-tiny, against reading 2 x 1500 x 384 floats).
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

// Query rows per register block: 6 x 4 sums with AVX-512, 2 x 4 with AVX2's 16 registers (4 keys or 4
// vectors of M's columns and a broadcast beside them).
constexpr int kMemoryRows = kAvx512 ? 6 : 2;
// Columns of M per pass of MemorySums: 4 vectors.
constexpr int kSumColumns = 4 * kLanes;

// Pass 1, one unit per query row of one memory row: qp[row] = scale * q[row] @ wkt[head rows].
void RunMemoryQueries(const void* args, int u0, int u1) {
  const MemoryAttention& a = *static_cast<const MemoryAttention*>(args);
  for (int u = u0; u < u1; ++u) {
    const int head = u % a.heads;
    const float* q = a.q + static_cast<size_t>(u) * a.d;
    const float* w = a.wkt + static_cast<size_t>(head) * a.d * a.e;
    float* out = a.qp + static_cast<size_t>(u) * a.e;
    constexpr int V = 64 / kLanes;  // 64 columns at a time (e is a multiple of 64)
    for (int c = 0; c < a.e; c += 64) {
      Vec acc[V];
      for (int v = 0; v < V; ++v) acc[v] = Zero();
      for (int k = 0; k < a.d; ++k) {
        const Vec x = Set(q[k] * a.scale);
        const float* row = w + static_cast<size_t>(k) * a.e + c;
        for (int v = 0; v < V; ++v) acc[v] = Fma(x, Load(row + kLanes * v), acc[v]);
      }
      for (int v = 0; v < V; ++v) Store(out + c + kLanes * v, acc[v]);
    }
  }
}

// The scores [R, keys] (row stride `stride`) of R query rows qp [R, e] against rows m [keys, e], four keys
// at a time: each key row is read once for the R rows.
template <int R>
void MemoryScores(const float* qp, const float* m, int keys, int e, float* scores, int stride) {
  int j = 0;
  for (; j + 4 <= keys; j += 4) {
    Vec acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = Zero();
    for (int c = 0; c < e; c += kLanes) {
      Vec key[4];
      for (int k = 0; k < 4; ++k) {
        key[k] = Load(m + static_cast<size_t>(j + k) * e + c);
        if (kAvx512 || c % 16 == 0) {  // each 64-byte line once
          _mm_prefetch(reinterpret_cast<const char*>(m + static_cast<size_t>(j + 8 + k) * e + c), _MM_HINT_T0);
        }
      }
      for (int r = 0; r < R; ++r) {
        const Vec x = Load(qp + static_cast<size_t>(r) * e + c);
        for (int k = 0; k < 4; ++k) acc[r][k] = Fma(x, key[k], acc[r][k]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(scores + static_cast<size_t>(r) * stride + j, FourSums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    }
  }
  for (; j < keys; ++j) {
    Vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Zero();
    for (int c = 0; c < e; c += kLanes) {
      const Vec key = Load(m + static_cast<size_t>(j) * e + c);
      for (int r = 0; r < R; ++r) acc[r] = Fma(Load(qp + static_cast<size_t>(r) * e + c), key, acc[r]);
    }
    for (int r = 0; r < R; ++r) scores[static_cast<size_t>(r) * stride + j] = ReduceAdd(acc[r]);
  }
}

// out[r] = sum over the keys of weights[r, key] * m[key] for R rows (row stride `stride`), kSumColumns columns
// at a time: each pass reads a column strip (a quarter kilobyte, AVX2 half that) of every key row, so m is
// read once overall.
// While it runs (compute on rows already in L2), it brings `ahead` (the next unit's rows, `ahead_lines` cache
// lines) from memory into L2, spread evenly over its iterations.
template <int R>
void MemorySums(const float* weights, int stride, const float* m, int keys, int e, float* out, int out_stride,
                const char* ahead, int ahead_lines) {
  const int iterations = e / kSumColumns * keys;
  const int per_iteration = iterations > 0 ? (ahead_lines + iterations - 1) / iterations : 0;
  const char* const ahead_end = ahead + static_cast<size_t>(ahead_lines) * 64;
  for (int c = 0; c < e; c += kSumColumns) {
    Vec acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = Zero();
    for (int j = 0; j < keys; ++j) {
      Vec row[4];
      for (int v = 0; v < 4; ++v) row[v] = Load(m + static_cast<size_t>(j) * e + c + kLanes * v);
      for (int p = 0; p < per_iteration && ahead < ahead_end; ++p, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        const Vec w = Set(weights[static_cast<size_t>(r) * stride + j]);
        for (int v = 0; v < 4; ++v) acc[r][v] = Fma(w, row[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) Store(out + static_cast<size_t>(r) * out_stride + c + kLanes * v, acc[r][v]);
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

// MemoryBlock<R> for R = count rows (1 to Most).
template <int Most>
void MemoryBlockOf(int count, const float* qp, const float* m, int keys, int e, float* scores, int stride, float* out,
                   const char* ahead, int ahead_lines) {
  if (count == Most) {
    MemoryBlock<Most>(qp, m, keys, e, scores, stride, out, ahead, ahead_lines);
  } else if constexpr (Most > 1) {
    MemoryBlockOf<Most - 1>(count, qp, m, keys, e, scores, stride, out, ahead, ahead_lines);
  }
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
      MemoryBlockOf<kMemoryRows>(std::min(kMemoryRows, rows - r), q, m, keys, a.e, scores.data(), stride, o,
                                 ahead, lines);
    }
  }
}

// out[d] = u[e] @ w (row stride `stride`) + bias, DV vectors of columns at a time.
template <int DV>
void MemoryProject(const float* u, int e, const float* w, size_t stride, const float* bias, float* out, int d) {
  for (int c0 = 0; c0 < d; c0 += kLanes * DV) {
    Vec acc[DV];
    for (int v = 0; v < DV; ++v) acc[v] = Load(bias + c0 + kLanes * v);
    for (int c = 0; c < e; ++c) {
      const Vec x = Set(u[c]);
      for (int v = 0; v < DV; ++v) acc[v] = Fma(x, Load(w + c * stride + c0 + kLanes * v), acc[v]);
    }
    for (int v = 0; v < DV; ++v) Store(out + c0 + kLanes * v, acc[v]);
  }
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
      const Vec w = Set(weight);
      for (int k = 0; k < a.e; k += kLanes) Store(u.data() + k, Fma(w, Load(part + k), Load(u.data() + k)));
    }
    const Vec inverse = Set(1.0f / total);
    for (int k = 0; k < a.e; k += kLanes) Store(u.data() + k, Mul(Load(u.data() + k), inverse));
    const float* w = a.wkv + hd + static_cast<size_t>(head) * a.d;
    const float* bias = a.bkv + hd + static_cast<size_t>(head) * a.d;
    float* out = a.out + (static_cast<size_t>(group) * a.queries + query) * hd + static_cast<size_t>(head) * a.d;
    ForHeadVectors(a.d, [&](auto vectors) {
      MemoryProject<decltype(vectors)::value>(u.data(), a.e, w, 2 * hd, bias, out, a.d);
    });
  }
}

constexpr int kMemoryChunkFloats = 1 << 16;  // a chunk of M up to 256 KB: it and the next stay in L2

}  // namespace
}  // namespace xlagen

using namespace xlagen;

namespace {
bool WholeHeadSize(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }

// Checks what the entry points below share, and runs the attention a describes; the refusal's message is
// static, as every entry point's.
const char* RunAttentionCall(Attention& a) {
  if (a.heads < 1 || a.t < 1 || a.s < 1) return "xlagen attention: heads, t and s must be at least 1";
  if (!WholeHeadSize(a.d)) return "xlagen attention: the head size d must be 16, 32, 64 or 128";
  if (a.heads_per_mask < 1 || a.heads % a.heads_per_mask != 0 || a.mask_rows < 1 || a.t % a.mask_rows != 0) {
    return "xlagen attention: heads_per_mask (heads_per_sequence) must divide heads and mask_rows divide t";
  }
  if (a.bias != nullptr && (a.bias_heads < 1 || a.heads % a.bias_heads != 0)) {
    return "xlagen attention: bias_heads must divide heads";
  }
  if (kAttentionRows > 32) return "xlagen attention: a unit has more rows than its row bits";
  a.blocks = (a.t + kAttentionRows - 1) / kAttentionRows;
  a.call = g_attention_calls.fetch_add(1) + 1;
  GetPool().Run(Task{&a, RunAttention, a.heads * a.blocks});
  return nullptr;
}
}  // namespace

extern "C" const char* xlagen_attention(const float* q, const float* k, const float* v, float* out, int heads, int t,
                                        int s, int d, float scale, int transposed) {
  Attention a{q, k, v, out, heads, t, s, d, 0, scale, 0, transposed != 0, nullptr, 1, heads};
  a.lq = a.lo = Packed(heads, t, d);
  a.lk = a.lv = Packed(heads, s, d);
  return RunAttentionCall(a);
}

extern "C" const char* xlagen_biased_attention(const float* q, const float* k, const float* v, const uint8_t* mask,
                                               const float* bias, float* out, int heads, int t, int s, int d,
                                               float scale, int heads_per_mask, int mask_rows, int bias_heads) {
  Attention a{q, k, v, out, heads, t, s, d, 0, scale, 0, 0, mask, mask_rows, heads_per_mask, bias, bias_heads};
  a.lq = a.lo = Packed(heads_per_mask, t, d);
  a.lk = a.lv = Packed(heads_per_mask, s, d);
  return RunAttentionCall(a);
}

extern "C" const char* xlagen_masked_attention(const float* q, const float* k, const float* v, const uint8_t* mask,
                                               float* out, int heads, int t, int s, int d, float scale,
                                               int heads_per_mask, int mask_rows) {
  return xlagen_biased_attention(q, k, v, mask, nullptr, out, heads, t, s, d, scale, heads_per_mask, mask_rows, 1);
}

extern "C" const char* xlagen_relative_attention_at(const float* q, const float* k, const float* v,
                                                    const uint8_t* mask, const float* bias, int relative, float* out,
                                                    int heads, int t, int s, int d, float scale,
                                                    int heads_per_sequence, int mask_rows, int bias_heads,
                                                    const int* layout) {
  if (layout == nullptr) return "xlagen_attention_at: no layout";
  for (int i = 0; i < 16; ++i) {
    if (layout[i] < 0) return "xlagen_attention_at: the layout's offsets and strides must be at least 0";
  }
  if (relative && (bias == nullptr || mask == nullptr)) return "xlagen_attention_at: a relative bias needs a bias and a mask";
  Attention a{q, k, v, out, heads, t, s, d, 0, scale, 0, 0, mask, mask ? mask_rows : 1, heads_per_sequence,
              bias, bias_heads, relative != 0};
  Layout* layouts[] = {&a.lq, &a.lk, &a.lv, &a.lo};
  for (int i = 0; i < 4; ++i) {
    const int* l = layout + 4 * i;
    *layouts[i] = {static_cast<size_t>(l[0]), static_cast<size_t>(l[1]), static_cast<size_t>(l[2]),
                   static_cast<size_t>(l[3])};
  }
  return RunAttentionCall(a);
}

extern "C" const char* xlagen_attention_at(const float* q, const float* k, const float* v, const uint8_t* mask,
                                           const float* bias, float* out, int heads, int t, int s, int d, float scale,
                                           int heads_per_sequence, int mask_rows, int bias_heads, const int* layout) {
  return xlagen_relative_attention_at(q, k, v, mask, bias, 0, out, heads, t, s, d, scale, heads_per_sequence,
                                      mask_rows, bias_heads, layout);
}

extern "C" const char* xlagen_step_attention(const float* q, const float* k, const float* v, const float* new_k,
                                             const float* new_v, const float* bias, float* out, int groups, int heads,
                                             int queries, int s, int d, int bias_heads, float scale,
                                             float mask_value) {
  if (groups < 1 || heads < 1 || queries < 1 || s < 0) {
    return "xlagen_step_attention: groups, heads and queries must be at least 1, s at least 0";
  }
  if (d < 1 || d > kStepAttentionMaxD) return "xlagen_step_attention: the head size d must be 1 to 256";
  if (bias_heads != 1 && bias_heads != heads) return "xlagen_step_attention: bias_heads must be 1 or heads";
  StepAttention a{q, k, v, new_k, new_v, bias, out, heads, queries, s, d, bias_heads, scale, mask_value};
  const int units = groups * a.heads * a.queries;
  if (static_cast<long>(units) * (a.s + 1) * a.d < kStepAttentionAlone) {
    RunStepAttention(&a, 0, units);
  } else {
    GetPool().Run(Task{&a, RunStepAttention, units});
  }
  return nullptr;
}

extern "C" const char* xlagen_memory_attention(const float* q, const float* m, const float* wkt, const float* wkv,
                                               const float* bkv, float* out, int groups, int queries, int heads,
                                               int d, int l, int e, float scale) {
  if (groups < 1 || queries < 1 || heads < 1 || l < 1 || e < 64 || e % 64 != 0) {
    return "xlagen_memory_attention: groups, queries, heads and l must be at least 1, e a multiple of 64";
  }
  if (!WholeHeadSize(d)) return "xlagen_memory_attention: the head size d must be 16, 32, 64 or 128";
  MemoryAttention a{q, m, wkt, wkv, bkv, out, nullptr, nullptr, groups, queries, heads, d, l, e, 0, 0, scale};
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
  return nullptr;
}
