// Vector helpers shared by the attention kernels (attention.cc): exponentials, row maxima, dot products.

#ifndef XLAGEN_NATIVE_VECTOR_MATH_H_
#define XLAGEN_NATIVE_VECTOR_MATH_H_

#include <immintrin.h>

#include <cmath>

namespace xlagen {

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

// The D = 16 (whole - 1) + tail floats of a head vector: `whole` vectors, the last under `tail`.
inline float DotRow(const float* a, const float* b, int whole, __mmask16 tail) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c + 1 < whole; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * c), _mm512_loadu_ps(b + 16 * c), acc);
  const int c = whole - 1;
  acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + 16 * c), _mm512_maskz_loadu_ps(tail, b + 16 * c), acc);
  return _mm512_reduce_add_ps(acc);
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

}  // namespace xlagen

#endif  // XLAGEN_NATIVE_VECTOR_MATH_H_
