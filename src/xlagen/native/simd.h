// The vector operations the kernels use, for the instruction set the library is compiled for: AVX-512
// (-mavx512f: 16 float32 lanes, 32 registers; with -mavx512vnni too, the int8 x int8 product's VNNI form) or
// AVX2 with FMA (-mavx2 -mfma: 8 lanes, 16 registers).
// xlagen/native/build.py compiles every kernel once per instruction set; xlagen/native/library.py loads the
// build the CPU can run. The kernels are written against these functions and `kLanes`; where the register
// count matters (tile sizes), they choose by `kAvx512`.
//
// A Mask selects the first lanes of a vector (FirstLanes); masked loads read nothing outside it (no fault past
// the end of an array) and give 0 in the other lanes; masked stores write nothing outside it.

#ifndef XLAGEN_NATIVE_SIMD_H_
#define XLAGEN_NATIVE_SIMD_H_

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace xlagen {

// exp(x) of 8 lanes (AVX2, both builds), x clamped to [-104, 88] (below -104 it is 0): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-7 polynomial (Cephes' expf coefficients), times 2^n made from its
// exponent bits in two factors 2^floor(n/2) and 2^ceil(n/2) (n >= -150 here, below the smallest normal
// exponent, -126, which one factor would need).
inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact first step
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i low = _mm256_srai_epi32(whole, 1), high = _mm256_sub_epi32(whole, low);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 low_power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(low, bias), 23));
  const __m256 high_power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(high, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, low_power), high_power);
}

#if defined(__AVX512F__)

constexpr bool kAvx512 = true;
constexpr int kLanes = 16;
using Vec = __m512;
using Words = __m512i;  // kLanes uint32 words (packed bfloat16 pairs)
using Mask = __mmask16;

inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadAligned(const float* p) { return _mm512_load_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void StoreAligned(float* p, Vec v) { _mm512_store_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
inline float ReduceAdd(Vec v) { return _mm512_reduce_add_ps(v); }
inline float ReduceMax(Vec v) { return _mm512_reduce_max_ps(v); }

// The first `count` lanes (0 to kLanes).
inline Mask FirstLanes(int count) { return static_cast<Mask>((1u << count) - 1); }
inline Vec LoadMasked(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void StoreMasked(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
// v's first `count` lanes (1 to kLanes) to p.
inline void StoreFirst(float* p, Vec v, int count) { _mm512_mask_storeu_ps(p, FirstLanes(count), v); }
// v in the lanes of m, 0 elsewhere.
inline Vec KeepMasked(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }
// The lanes whose byte of p[0..kLanes) is nonzero, and a in the lanes of m with b in the others.
inline Mask NonzeroBytes(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_test_epi32_mask(x, x);
}
inline Vec Select(Mask m, Vec a, Vec b) { return _mm512_mask_blend_ps(m, b, a); }
// The lanes of m: max(acc, p's), the others acc.
inline Vec MaxMasked(Vec acc, Mask m, const float* p) { return _mm512_mask_max_ps(acc, m, acc, LoadMasked(m, p)); }

// bfloat16 pairs: a word holds the bfloat16 of one column in its low half and of another in its high half.
inline Words LoadWords(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline Vec LowHalves(Words w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline Vec HighHalves(Words w) {
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// kLanes int8 values as float32.
inline Vec LoadInt8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) for x <= 0 (scores minus their row's maximum): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its
// degree-7 polynomial (Cephes' expf coefficients), times 2^n by scalef; below -104 it is 0.
inline Vec ExpNonPositive(Vec x) {
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

// exp(x), x clamped to [-104, 88] as Exp8 clamps it: ExpNonPositive's scalef scales exactly up to 2^127.
inline Vec Exp(Vec x) { return ExpNonPositive(_mm512_min_ps(x, _mm512_set1_ps(88.0f))); }

// The four sums of the lanes of a0..a3, in that order.
inline __m128 FourSums(Vec a0, Vec a1, Vec a2, Vec a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(s);
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr bool kAvx512 = false;
constexpr int kLanes = 8;
using Vec = __m256;
using Words = __m256i;
using Mask = __m256i;  // all ones in the lanes selected

inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadAligned(const float* p) { return _mm256_load_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void StoreAligned(float* p, Vec v) { _mm256_store_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

inline __m128 Halves(Vec v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
inline float ReduceAdd(Vec v) {
  __m128 s = Halves(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float ReduceMax(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline Mask FirstLanes(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec LoadMasked(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }
inline void StoreMasked(float* p, Mask m, Vec v) { _mm256_maskstore_ps(p, m, v); }
// A whole vector with a plain store: a masked store is microcoded on some CPUs.
inline void StoreFirst(float* p, Vec v, int count) {
  if (count == kLanes) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, FirstLanes(count), v);
  }
}
inline Vec KeepMasked(Mask m, Vec v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
inline Mask NonzeroBytes(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cmpgt_epi32(x, _mm256_setzero_si256());
}
inline Vec Select(Mask m, Vec a, Vec b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
inline Vec MaxMasked(Vec acc, Mask m, const float* p) {
  return _mm256_blendv_ps(acc, _mm256_max_ps(acc, LoadMasked(m, p)), _mm256_castsi256_ps(m));
}

inline Words LoadWords(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec LowHalves(Words w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline Vec HighHalves(Words w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline Vec LoadInt8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// As the AVX-512 ExpNonPositive and Exp (Exp8).
inline Vec ExpNonPositive(Vec x) { return Exp8(x); }
inline Vec Exp(Vec x) { return Exp8(x); }

inline __m128 FourSums(Vec a0, Vec a1, Vec a2, Vec a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return Halves(s);
}

#else
#error "xlagen's kernels are compiled with -mavx512f -mfma or -mavx2 -mfma (xlagen/native/build.py)"
#endif

// Integer products (both builds: -mavx512f implies AVX2): 8 int32 lanes of 256 bits. A product's int8
// operands are in -127..127. DotQuads(acc, w, x) adds to each int32 lane i the dot product of the 4 signed
// bytes of w's word i and of x's word i. Without VNNI it is maddubs (unsigned x signed bytes, pairs summed to
// int16) on |w| and x carrying w's sign, then madd with ones (int16 pairs to int32): a pair sums at most
// 2 * 127 * 127 = 32258, below int16's 32767, so maddubs never saturates and the sums are exact.
using Ints = __m256i;

inline Ints ZeroInts() { return _mm256_setzero_si256(); }
inline Ints LoadInts(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline Ints LoadAlignedInts(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
// The 4 bytes at p in every word.
inline Ints BroadcastQuad(const void* p) {
  int32_t quad;
  __builtin_memcpy(&quad, p, 4);
  return _mm256_set1_epi32(quad);
}
// |w| per byte, for DotQuads' `magnitudes` (computed once per weight vector, used for every row of x).
inline Ints Magnitudes(Ints w) { return _mm256_abs_epi8(w); }

// DotUnsigned(acc, x, w) adds to each int32 lane i the dot product of the 4 unsigned bytes of x's word i and
// the 4 signed bytes of w's word i, for x in 0..127 (the many-row integer product's 7-bit activations): 3
// instructions per 32 multiply-adds without VNNI. DotQuads(acc, w, magnitudes, x) is the same for signed x in
// -127..127, as |w| (`magnitudes`) by x carrying w's sign: one instruction more.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline Ints DotUnsigned(Ints acc, Ints x, Ints w) { return _mm256_dpbusd_epi32(acc, x, w); }
#else
inline Ints DotUnsigned(Ints acc, Ints x, Ints w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}
#endif
inline Ints DotQuads(Ints acc, Ints w, Ints magnitudes, Ints x) {
  return DotUnsigned(acc, magnitudes, _mm256_sign_epi8(x, w));
}

// 8 int32 lanes as float32 (rounded to nearest, as numpy's astype(float32)).
inline __m256 IntsToFloats(Ints v) { return _mm256_cvtepi32_ps(v); }
// The first `count` (1 to 8) of 8 float32 lanes to p.
// The first min(count, 8) floats at p, zeros after them (nothing past them is read).
inline __m256 LoadFirst8(const float* p, int count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

inline void StoreFirst8(float* p, __m256 v, int count) {
  if (count >= 8) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                        v);
  }
}

// What the many-row products (the 7-bit int8 product, the bfloat16 tile product, gemm.cc's) do to y as they
// store it (their xlagen_*_epilogue entry points): add a projection's bias, apply an activation, then add a
// residual connection's input.
enum Activation : int { kLinear = 0, kRelu = 1, kGeluTanh = 2 };

// v + bias[0..8) (bias not null; nothing past `count` is read), then the activation: ReLU, max(v, 0); or
// GELU's tanh form (GPT-2's "gelu_new"), 0.5 v (1 + tanh(u)) = v / (1 + exp(-2u)), u = sqrt(2 / pi) (v +
// 0.044715 v^3); then + residual[0..8) (not null: y's own elements of the residual [m, n]). Each add is the
// float32 add XLA would do after the product.
inline __m256 Epilogue8(__m256 v, const float* bias, int count, int activation, const float* residual) {
  if (bias != nullptr) v = _mm256_add_ps(v, LoadFirst8(bias, count));
  if (activation == kRelu) {
    v = _mm256_max_ps(v, _mm256_setzero_ps());
  } else if (activation == kGeluTanh) {
    const __m256 u = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(0.7978845608f)),
                                   _mm256_fmadd_ps(_mm256_mul_ps(v, v), _mm256_set1_ps(0.044715f), _mm256_set1_ps(1.0f)));
    v = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), Exp8(_mm256_mul_ps(u, _mm256_set1_ps(-2.0f)))));
  }
  if (residual != nullptr) v = _mm256_add_ps(v, LoadFirst8(residual, count));
  return v;
}

// Epilogue8's activation of a whole vector: ReLU, or GELU's tanh form by the same operations (so the same
// floats), kLanes at a time.
inline Vec Activate(Vec v, int activation) {
  if (activation == kRelu) return Max(v, Zero());
  if (activation != kGeluTanh) return v;
  const Vec u = Mul(Mul(v, Set(0.7978845608f)), Fma(Mul(v, v), Set(0.044715f), Set(1.0f)));
  return Div(v, Add(Set(1.0f), Exp(Mul(u, Set(-2.0f)))));
}

// Calls body(std::integral_constant<int, R>()) for R = count, 1 to Most: a register tile's row count as a
// compile-time constant, so that its sums stay in registers (with a run-time count GCC kept the sums of rows
// past the first on the stack: GPT-2-small's bfloat16 products took 1.15x as long at 4 rows, 1.22x at 8).
template <int Most, typename Body>
__attribute__((always_inline)) inline void ForRows(int count, const Body& body) {
  if (count == Most) {
    body(std::integral_constant<int, Most>());
  } else if constexpr (Most > 1) {
    ForRows<Most - 1>(count, body);
  }
}

}  // namespace xlagen

#endif  // XLAGEN_NATIVE_SIMD_H_
