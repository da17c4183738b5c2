// Vector helpers shared by the attention kernels (attention.cc): row maxima, exponentials, dot products.

#ifndef XLAGEN_NATIVE_VECTOR_MATH_H_
#define XLAGEN_NATIVE_VECTOR_MATH_H_

#include <cmath>
#include <cstring>

#include "simd.h"

namespace xlagen {

// The largest of row[0..n).
inline float RowMax(const float* row, int n) {
  const int whole = n / kLanes * kLanes;
  const int left = n - whole;
  const Mask tail = FirstLanes(left);
  Vec high = Set(-INFINITY);
  for (int j = 0; j < whole; j += kLanes) high = Max(high, Load(row + j));
  if (left) high = MaxMasked(high, tail, row + whole);
  return ReduceMax(high);
}

// row[0..n) = exp(row[j] - top) in place, for a row whose largest value is `top`; returns their sum.
inline float ExpInPlace(float* row, int n, float top) {
  const int whole = n / kLanes * kLanes;
  const int left = n - whole;
  const Mask tail = FirstLanes(left);
  const Vec high = Set(top);
  Vec total = Zero();
  for (int j = 0; j < whole; j += kLanes) {
    const Vec e = ExpNonPositive(Sub(Load(row + j), high));
    Store(row + j, e);
    total = Add(total, e);
  }
  if (left) {
    const Vec e = KeepMasked(tail, ExpNonPositive(Sub(LoadMasked(tail, row + whole), high)));
    StoreMasked(row + whole, tail, e);
    total = Add(total, e);
  }
  return ReduceAdd(total);
}

// row[j] = exp(row[j] - top) where seen[j] is nonzero and exactly 0 where it is 0, over j < n, with top the
// largest row[j] seen (a row sees at least one key); returns their sum.
inline float MaskedExpInPlace(float* row, const uint8_t* seen, int n) {
  const int whole = n / kLanes * kLanes;
  const int left = n - whole;
  const Mask tail = FirstLanes(left);
  uint8_t tail_seen[kLanes] = {};  // the last bytes, zeros past n: NonzeroBytes reads kLanes of them
  std::memcpy(tail_seen, seen + whole, left);
  Vec high = Set(-INFINITY);
  for (int j = 0; j < whole; j += kLanes) high = Select(NonzeroBytes(seen + j), Max(high, Load(row + j)), high);
  if (left) high = Select(NonzeroBytes(tail_seen), Max(high, LoadMasked(tail, row + whole)), high);
  const Vec top = Set(ReduceMax(high));
  Vec total = Zero();
  for (int j = 0; j < whole; j += kLanes) {
    const Vec e = Select(NonzeroBytes(seen + j), ExpNonPositive(Sub(Load(row + j), top)), Zero());
    Store(row + j, e);
    total = Add(total, e);
  }
  if (left) {
    const Vec e = Select(NonzeroBytes(tail_seen), ExpNonPositive(Sub(LoadMasked(tail, row + whole), top)), Zero());
    StoreMasked(row + whole, tail, e);
    total = Add(total, e);
  }
  return ReduceAdd(total);
}

// The D = kLanes (whole - 1) + tail floats of a head vector: `whole` vectors, the last under `tail`.
inline float DotRow(const float* a, const float* b, int whole, Mask tail) {
  Vec acc = Zero();
  for (int c = 0; c + 1 < whole; ++c) acc = Fma(Load(a + kLanes * c), Load(b + kLanes * c), acc);
  const int c = whole - 1;
  acc = Fma(LoadMasked(tail, a + kLanes * c), LoadMasked(tail, b + kLanes * c), acc);
  return ReduceAdd(acc);
}

}  // namespace xlagen

#endif  // XLAGEN_NATIVE_VECTOR_MATH_H_
