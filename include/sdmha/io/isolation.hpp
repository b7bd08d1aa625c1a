// sdmha/io/isolation.hpp — IsolationLimits: what a reader run in a child process may use
// (io/keras_isolated.hpp).
#pragma once

#include <cstddef>

namespace sdmha::io {

// Address space (RLIMIT_AS; an allocation beyond it fails in the child, which then ends with an
// IoError) and wall-clock time (then SIGKILL, and an IoError).
struct IsolationLimits {
  std::size_t memory_bytes = std::size_t(4) << 30;
  double seconds = 60.0;
};

}  // namespace sdmha::io
