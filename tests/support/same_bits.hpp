// tests/support/same_bits.hpp — bitwise equality of results and gradients, for the tests that
// compare a call with another run of the same call (other threads, repeats, injected failures).
#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>

#include <sdmha/gradients.hpp>

namespace sdmha_test {

// `a` and `b` (Eigen matrices, vectors or tensors of one scalar type) hold as many entries, with
// the same bytes: NaNs of the same payload are equal, 0 and -0 are not.
template <typename A, typename B>
bool same_bits(const A& a, const B& b) {
  using Scalar = std::remove_cv_t<std::remove_pointer_t<decltype(a.data())>>;
  static_assert(
      std::is_same_v<Scalar, std::remove_cv_t<std::remove_pointer_t<decltype(b.data())>>>);
  return a.size() == b.size() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), sizeof(Scalar) * std::size_t(a.size())) == 0);
}

// Every gradient of `a` and `b` bitwise the same.
template <typename Scalar>
bool same_gradients(const sdmha::MhaGradients<Scalar>& a, const sdmha::MhaGradients<Scalar>& b) {
  return same_bits(a.query_kernel, b.query_kernel) && same_bits(a.key_kernel, b.key_kernel) &&
         same_bits(a.value_kernel, b.value_kernel) && same_bits(a.output_kernel, b.output_kernel) &&
         same_bits(a.query_bias, b.query_bias) && same_bits(a.key_bias, b.key_bias) &&
         same_bits(a.value_bias, b.value_bias) && same_bits(a.output_bias, b.output_bias) &&
         same_bits(a.query_values, b.query_values) && same_bits(a.key, b.key) &&
         same_bits(a.value, b.value);
}

}  // namespace sdmha_test
