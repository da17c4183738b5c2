// Greedy decoding's choice of token: the index of each row's largest value, the first on ties, over a
// vocabulary of logits. XLA's argmax is a reduction of (value, index) pairs that its CPU backend
// runs one element at a time (about 0.9 ms per step for Whisper-tiny's 8 x 51,865 logits); here each of 16
// lanes (8 with AVX2) keeps its own largest value and index, and the lanes are compared once at the end. NaN
// is never larger than anything, so it is skipped (the lanes' values are never NaN); a row of only -inf or
// NaN gives 0.

#include <cmath>

#include "kernels.h"
#include "pool.h"
#include "simd.h"

namespace xlagen {
namespace {

struct Argmax {
  const float* x;  // [rows, n]
  int32_t* out;    // [rows]
  int n;
};

#if defined(__AVX512F__)

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

#else  // AVX2: the same with 8 lanes, comparisons giving a vector of all-ones lanes rather than a mask

void RunArgmax(const void* args, int u0, int u1) {
  const Argmax& a = *static_cast<const Argmax*>(args);
  const __m256i step = _mm256_set1_epi32(8);
  const int whole = a.n / 8 * 8;
  const __m256i tail = FirstLanes(a.n - whole);
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  for (int r = u0; r < u1; ++r) {
    const float* row = a.x + static_cast<size_t>(r) * a.n;
    __m256 best = lowest;
    __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i index = where;
    for (int j = 0; j < whole; j += 8) {
      const __m256 x = _mm256_loadu_ps(row + j);
      const __m256 larger = _mm256_cmp_ps(x, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, x, larger);
      where = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(index), larger));
      index = _mm256_add_epi32(index, step);
    }
    if (whole < a.n) {
      const __m256 x = _mm256_blendv_ps(lowest, _mm256_maskload_ps(row + whole, tail), _mm256_castsi256_ps(tail));
      const __m256 larger = _mm256_cmp_ps(x, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, x, larger);
      where = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(index), larger));
    }
    // Each lane holds its first maximum; of the lanes with the row's maximum, the smallest index.
    const __m256 at_top = _mm256_cmp_ps(best, _mm256_set1_ps(ReduceMax(best)), _CMP_EQ_OQ);
    __m256i candidates = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), _mm256_castsi256_ps(where), at_top));
    __m128i m = _mm_min_epi32(_mm256_castsi256_si128(candidates), _mm256_extracti128_si256(candidates, 1));
    m = _mm_min_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    a.out[r] = _mm_cvtsi128_si32(m);
  }
}

#endif

}  // namespace
}  // namespace xlagen

using namespace xlagen;

extern "C" const char* xlagen_argmax(const float* x, int32_t* out, int rows, int n) {
  if (rows < 0 || n < 1) return "xlagen_argmax: rows must be at least 0 and n at least 1";
  Argmax a{x, out, n};
  if (rows < 2) {
    RunArgmax(&a, 0, rows);
  } else {
    GetPool().Run(Task{&a, RunArgmax, rows});
  }
  return nullptr;
}
