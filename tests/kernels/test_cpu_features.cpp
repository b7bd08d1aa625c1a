// Tests of sdmha/detail/cpu_features.hpp: CPUID read as the kernel reports it (/proc/cpuinfo's
// flags and vendor, where there is one), and the bfloat16 GEMM rule over every kind of CPU, so
// the choice is tested on machines that are not of that kind.
#include "test_support.hpp"

#include <fstream>
#include <sstream>
#include <string>

#include "sdmha/detail/cpu_features.hpp"

namespace sdmha_test {
namespace {

using sdmha::detail::BFloat16Gemms;
using sdmha::detail::CpuFeatures;

// The first "flags" and "vendor_id" lines of /proc/cpuinfo; empty where there is none.
struct CpuInfo {
  std::string vendor, flags;
};
CpuInfo read_cpuinfo() {
  CpuInfo info;
  std::ifstream file("/proc/cpuinfo");
  std::string line;
  while (std::getline(file, line) && (info.vendor.empty() || info.flags.empty())) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_first_of(" \t"));
    if (key == "vendor_id" && info.vendor.empty()) info.vendor = line.substr(colon + 2);
    if (key == "flags" && info.flags.empty()) info.flags = " " + line.substr(colon + 2) + " ";
  }
  return info;
}

TEST(CpuFeatures, AgreeWithTheKernelsView) {
  const CpuInfo info = read_cpuinfo();
  if (info.flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const CpuFeatures& cpu = sdmha::detail::cpu_features();
  EXPECT_EQ(cpu.amd, info.vendor == "AuthenticAMD") << info.vendor;
  EXPECT_EQ(cpu.avx512_bf16, info.flags.find(" avx512_bf16 ") != std::string::npos);
  EXPECT_EQ(cpu.amx_bf16, info.flags.find(" amx_bf16 ") != std::string::npos);
}

// The bfloat16 GEMMs pay on AMD's AVX512_BF16 (twice float32's multiply-adds a cycle), in a build
// that has the kernels; not on Intel's AVX512_BF16 (half rate), with or without AMX (no AMX
// kernel yet), nor without AVX512_BF16.
TEST(CpuFeatures, BFloat16GemmsPayWhereTheDotProductsOutrunFloat32) {
  struct Row {
    CpuFeatures cpu;
    bool compiled, pays;
  };
  const Row rows[] = {
      {{true, false, true}, true, true},     // AMD Zen 4 or 5
      {{true, false, true}, false, false},   // the same, built without AVX512_BF16
      {{true, false, false}, true, false},   // Intel Cooper Lake, or Sapphire Rapids without AMX
      {{true, true, false}, true, false},    // Intel with AMX
      {{false, false, true}, true, false},   // AMD Zen 3
      {{false, false, false}, true, false},  // anything else
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(::testing::Message()
                 << "avx512_bf16 " << row.cpu.avx512_bf16 << ", amx " << row.cpu.amx_bf16
                 << ", amd " << row.cpu.amd << ", compiled " << row.compiled);
    EXPECT_EQ(sdmha::detail::bfloat16_gemms_pay(row.cpu, row.compiled), row.pays);
    EXPECT_EQ(sdmha::detail::use_bfloat16_gemms(BFloat16Gemms::automatic, row.cpu, row.compiled),
              row.pays);
    // Forced either way, the CPU does not matter.
    EXPECT_TRUE(sdmha::detail::use_bfloat16_gemms(BFloat16Gemms::on, row.cpu, row.compiled));
    EXPECT_FALSE(sdmha::detail::use_bfloat16_gemms(BFloat16Gemms::off, row.cpu, row.compiled));
  }
}

}  // namespace
}  // namespace sdmha_test
