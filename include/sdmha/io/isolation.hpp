// sdmha/io/isolation.hpp — IsolationLimits: what a reader run in a child process may use
// (io/keras_isolated.hpp).
#pragma once

#include <cmath>
#include <cstddef>

namespace sdmha::io {

// Address space (RLIMIT_AS; an allocation beyond it fails in the child, which then ends with an
// IoError) and wall-clock time (then SIGKILL, and an IoError). The time limit of a file reader is
// the smaller of `seconds` and small_file_seconds + seconds_per_gigabyte · (the file's size in
// GiB): libhdf5 loops forever on some damaged files, and a whole file of a few MB loads in
// milliseconds, so a small file's hang is stopped in seconds while a large one keeps the time its
// reading needs. small_file_seconds 0 leaves `seconds` alone.
struct IsolationLimits {
  std::size_t memory_bytes = std::size_t(4) << 30;
  double seconds = 60.0;
  double small_file_seconds = 5.0;
  double seconds_per_gigabyte = 30.0;
};

// The time limit of a reader of `file_bytes` bytes under `limits` (see IsolationLimits).
inline double reader_seconds(const IsolationLimits& limits, double file_bytes) {
  if (!(limits.small_file_seconds > 0.0)) return limits.seconds;
  // The file's share in whole tenths of a second, so that messages read "5 s", not "5.00091 s".
  const double share = limits.seconds_per_gigabyte * file_bytes / double(std::size_t(1) << 30);
  const double scaled = limits.small_file_seconds + std::round(share * 10.0) / 10.0;
  return scaled < limits.seconds ? scaled : limits.seconds;
}

}  // namespace sdmha::io
