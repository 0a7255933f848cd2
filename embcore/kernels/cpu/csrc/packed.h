// packed.h: a kernel called with its arguments in one array of 8-byte slots.
//
// ctypes converts every argument of a call on its own (about 0.3 us each): ec_sparse_update's 27
// cost more than its work at batch 16. ``ec_<kernel>_packed(slots)`` takes them instead in one
// array of int64 slots, in the kernel's order, that the Python side keeps across calls (the
// fixed arguments written once; kernels/cpu/args.py's ``Kernel.partial``): slot i holds argument
// i, a pointer as its address (0: nullptr), an integer as its value. One conversion a call.

#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace {

template <typename T>
inline T slot_as(int64_t s) {
  static_assert(std::is_pointer_v<T> || std::is_integral_v<T>,
                "a packed kernel takes pointers and integers only");
  if constexpr (std::is_pointer_v<T>)
    return reinterpret_cast<T>(static_cast<uintptr_t>(s));
  else
    return static_cast<T>(s);
}

template <auto F>
struct Packed;

template <typename R, typename... A, R (*F)(A...)>
struct Packed<F> {
  template <std::size_t... I>
  static R call(const int64_t* s, std::index_sequence<I...>) {
    return F(slot_as<A>(s[I])...);
  }
  static R call(const int64_t* s) { return call(s, std::index_sequence_for<A...>{}); }
};

}  // namespace

// ec_<kernel>_packed: the kernel with its arguments in slots (see above).
#define EC_PACKED(kernel) \
  extern "C" auto kernel##_packed(const int64_t* slots) { return Packed<kernel>::call(slots); }

EC_PACKED(ec_concat_dedup)
EC_PACKED(ec_lookup)
EC_PACKED(ec_sparse_update)
