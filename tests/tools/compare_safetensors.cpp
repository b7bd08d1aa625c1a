// sdmha_compare_safetensors — compares tensors of two safetensors files elementwise, for the
// sdmha-run tests (no Python or numpy needed on the machine that runs them).
//
//   sdmha_compare_safetensors RESULT REFERENCE [--tolerance T] [--absent NAME]... GOT=EXPECTED...
//
// Each GOT=EXPECTED pair names a tensor of RESULT and one of REFERENCE. They must have the same
// shape and dtype, and every element must satisfy |got - expected| <= T·(1 + |expected|), the
// goldens' criterion; T defaults to 1e-10 for F64 and 2e-5 for F32 (tests/data/goldens/README.md).
// --absent NAME fails if RESULT holds NAME. Exit status: 0 pass, 1 mismatch, 2 bad usage or file.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <sdmha/io/safetensors.hpp>
#include <string>
#include <vector>

namespace {

struct Pair {
  std::string got;
  std::string expected;
};

double default_tolerance(sdmha::io::DType dtype) {
  return dtype == sdmha::io::DType::F64 ? 1e-10 : 2e-5;
}

// Whether every element meets the criterion; prints the largest errors either way.
bool compare(const sdmha::io::SafetensorsFile& result, const sdmha::io::SafetensorsFile& reference,
             const Pair& pair, std::optional<double> tolerance_option) {
  const auto& got_info = result.info(pair.got);
  const auto& expected_info = reference.info(pair.expected);
  if (got_info.shape != expected_info.shape) {
    std::cout << pair.got << ": shape " << sdmha::detail::format_shape(got_info.shape)
              << " differs from " << pair.expected << "'s "
              << sdmha::detail::format_shape(expected_info.shape) << '\n';
    return false;
  }
  if (got_info.dtype != expected_info.dtype) {
    std::cout << pair.got << ": dtype " << sdmha::io::dtype_name(got_info.dtype) << " differs from "
              << pair.expected << "'s " << sdmha::io::dtype_name(expected_info.dtype) << '\n';
    return false;
  }
  const double tolerance = tolerance_option.value_or(default_tolerance(got_info.dtype));
  const auto got = result.read<double>(pair.got);
  const auto expected = reference.read<double>(pair.expected);
  // A NaN error ranks as infinite, so that the worst element reported is the one that failed.
  constexpr double infinity = std::numeric_limits<double>::infinity();
  double max_absolute = 0, max_scaled = 0;
  std::size_t worst = 0, failures = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    // Equal values pass, infinities and NaN included; any other non-finite difference fails.
    const bool same = got[i] == expected[i] || (std::isnan(got[i]) && std::isnan(expected[i]));
    double absolute = same ? 0.0 : std::fabs(got[i] - expected[i]);
    double scaled = same ? 0.0 : absolute / (1.0 + std::fabs(expected[i]));
    if (std::isnan(absolute)) absolute = infinity;
    if (std::isnan(scaled)) scaled = infinity;
    if (!(scaled <= tolerance)) ++failures;
    if (scaled > max_scaled) {
      max_scaled = scaled;
      worst = i;
    }
    max_absolute = std::max(max_absolute, absolute);
  }
  std::cout << pair.got << " vs " << pair.expected << ": " << got.size() << " elements, max |got - "
            << "expected| = " << max_absolute
            << ", max |got - expected|/(1 + |expected|) = " << max_scaled << ", tolerance "
            << tolerance;
  if (failures > 0) {
    std::cout << ", " << failures << " elements outside (e.g. element " << worst << ": got "
              << got[worst] << ", expected " << expected[worst] << ")\n";
    return false;
  }
  std::cout << ", pass\n";
  return true;
}

int usage(const std::string& problem) {
  std::cerr << "sdmha_compare_safetensors: " << problem
            << "\nusage: sdmha_compare_safetensors RESULT REFERENCE [--tolerance T] "
               "[--absent NAME]... GOT=EXPECTED...\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  std::vector<Pair> pairs;
  std::vector<std::string> absent;
  std::optional<double> tolerance;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--tolerance" || argument == "--absent") {
      if (i + 1 >= argc) return usage(argument + " needs a value");
      const std::string value = argv[++i];
      if (argument == "--absent") {
        absent.push_back(value);
        continue;
      }
      char* end = nullptr;
      tolerance = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(*tolerance >= 0)) {
        return usage("--tolerance '" + value + "' is not a number >= 0");
      }
    } else if (files.size() < 2) {
      files.push_back(argument);
    } else {
      const auto equals = argument.find('=');
      if (equals == std::string::npos) return usage("'" + argument + "' is not GOT=EXPECTED");
      pairs.push_back({argument.substr(0, equals), argument.substr(equals + 1)});
    }
  }
  if (files.size() != 2 || (pairs.empty() && absent.empty())) {
    return usage("expected RESULT, REFERENCE and at least one GOT=EXPECTED or --absent");
  }
  try {
    const auto result = sdmha::io::SafetensorsFile::open(files[0]);
    const auto reference = sdmha::io::SafetensorsFile::open(files[1]);
    bool pass = true;
    for (const auto& pair : pairs) pass = compare(result, reference, pair, tolerance) && pass;
    for (const auto& name : absent) {
      if (result.contains(name)) {
        std::cout << files[0] << " holds '" << name << "'; expected it absent\n";
        pass = false;
      }
    }
    return pass ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << "sdmha_compare_safetensors: " << error.what() << '\n';
    return 2;
  }
}
