// tests/fuzz/fuzz_support.hpp — what the libFuzzer targets share: integers drawn so that small
// values, boundary values and arbitrary 64-bit values are all likely, and the rule that anything
// other than an sdmha::Error escaping the library is a finding.
//
// The targets are built without NDEBUG: SDMHA_ASSERT and Eigen's assertions abort, and libFuzzer
// reports an abort as a crash, with the input that caused it.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <new>
#include <typeinfo>

#include <sdmha/errors.hpp>

namespace sdmha_fuzz {

// An integer that is, with roughly equal odds, small (the sizes a real caller passes), one of
// the values where checks go wrong (0, −1, the limits of int16, int32 and int64, powers of two
// around them), or any int64 at all.
inline std::int64_t consume_integer(FuzzedDataProvider& provider) {
  switch (provider.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
    case 1:
      return provider.ConsumeIntegralInRange<std::int64_t>(-2, 9);
    case 2: {
      constexpr std::int64_t boundaries[] = {
          0,
          -1,
          std::numeric_limits<std::int16_t>::max(),
          std::int64_t(std::numeric_limits<std::int16_t>::max()) + 1,
          std::numeric_limits<std::int32_t>::max(),
          std::int64_t(std::numeric_limits<std::int32_t>::max()) + 1,
          std::numeric_limits<std::int32_t>::min(),
          std::int64_t(1) << 16,
          std::int64_t(1) << 20,
          std::int64_t(1) << 31,
          std::int64_t(1) << 32,
          std::int64_t(1) << 40,
          std::int64_t(1) << 62,
          std::numeric_limits<std::int64_t>::max(),
          std::numeric_limits<std::int64_t>::min(),
          46341,  // ⌈√2³¹⌉: its square just overflows int32
          65535,
      };
      return provider.PickValueInArray(boundaries);
    }
    default:
      return provider.ConsumeIntegral<std::int64_t>();
  }
}

// A coordinate for an axis of length `bound`: usually inside it, sometimes just outside, and
// sometimes anything.
inline std::int64_t consume_coordinate(FuzzedDataProvider& provider, std::int64_t bound) {
  const int kind = provider.ConsumeIntegralInRange<int>(0, 7);
  if (kind < 6 && bound > 0) {
    return provider.ConsumeIntegralInRange<std::int64_t>(0, bound - 1);
  }
  if (kind == 6) return provider.ConsumeBool() ? bound : -1;
  return consume_integer(provider);
}

// A value that float and double both represent exactly: k / 8 with |k| < 2^15, so that sums of
// a few of them are exact in either precision.
inline double consume_exact_value(FuzzedDataProvider& provider) {
  return double(provider.ConsumeIntegralInRange<int>(-32767, 32767)) / 8.0;
}

// A finding: print what escaped and abort, so that libFuzzer stores the input.
[[noreturn]] inline void report_escape(const char* what) {
  std::fprintf(stderr, "sdmha fuzz: an exception other than sdmha::Error escaped: %s\n", what);
  std::abort();
}

// Runs `body`; an sdmha::Error is an accepted rejection, anything else a finding.
template <typename Body>
bool accepts(Body&& body) {
  try {
    body();
    return true;
  } catch (const sdmha::Error&) {
    return false;
  } catch (const std::bad_alloc&) {
    report_escape("std::bad_alloc");
  } catch (const std::exception& error) {
    report_escape(error.what());
  } catch (...) {
    report_escape("a non-std exception");
  }
}

// Checks an invariant in every build (the targets never rely on assert's NDEBUG handling).
#define SDMHA_FUZZ_CHECK(condition)                                                         \
  do {                                                                                      \
    if (!(condition)) {                                                                     \
      std::fprintf(stderr, "sdmha fuzz: %s:%d: invariant failed: %s\n", __FILE__, __LINE__, \
                   #condition);                                                             \
      std::abort();                                                                         \
    }                                                                                       \
  } while (false)

}  // namespace sdmha_fuzz
