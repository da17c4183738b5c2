// xlagen's stand-in for Abseil's flat_hash_map in the AOT example build.
//
// The tensorflow pip package ships Abseil's headers but not its compiled code. The XLA runtime only
// keeps a name -> kernel map in a flat_hash_map (unused when the program runs through its compiled
// thunk function), so every translation unit of the example sees std::unordered_map instead, and
// none of Abseil's hash-table internals need to be linked. This directory must come before
// TensorFlow's include directory on the compiler's include path, for all sources of the program.
#ifndef XLAGEN_AOT_FLAT_HASH_MAP_H_
#define XLAGEN_AOT_FLAT_HASH_MAP_H_

#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>

#include "absl/base/config.h"

namespace absl {
ABSL_NAMESPACE_BEGIN

template <class Key, class Value, class Hash = std::hash<Key>, class Eq = std::equal_to<Key>,
          class Allocator = std::allocator<std::pair<const Key, Value>>>
using flat_hash_map = std::unordered_map<Key, Value, Hash, Eq, Allocator>;

ABSL_NAMESPACE_END
}  // namespace absl

#endif  // XLAGEN_AOT_FLAT_HASH_MAP_H_
