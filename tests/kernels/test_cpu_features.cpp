// Tests of sdmha/detail/cpu_features.hpp: CPUID read as the kernel reports it (/proc/cpuinfo's
// flags and vendor, where there is one), the request for AMX tile data as this machine answers
// it, and the bfloat16 GEMM engine rule over every kind of CPU, permission and build, so the
// choice is tested on machines that are not of that kind.
#include "test_support.hpp"

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "sdmha/detail/cpu_features.hpp"
#include "sdmha/detail/gemm_onednn.hpp"

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
  EXPECT_EQ(cpu.amx_bf16, info.flags.find(" amx_bf16 ") != std::string::npos &&
                              info.flags.find(" amx_tile ") != std::string::npos);
}

// The bfloat16 GEMMs pay on AMD's AVX512_BF16 (twice float32's multiply-adds a cycle), in a build
// that has the kernels; not on Intel's AVX512_BF16 (half rate), nor without AVX512_BF16.
TEST(CpuFeatures, BFloat16GemmsPayWhereTheDotProductsOutrunFloat32) {
  struct Row {
    CpuFeatures cpu;
    bool compiled, pays;
  };
  const Row rows[] = {
      {{true, false, true}, true, true},     // AMD Zen 4 or 5
      {{true, false, true}, false, false},   // the same, built without AVX512_BF16
      {{true, false, false}, true, false},   // Intel Cooper Lake, or Sapphire Rapids without AMX
      {{true, true, false}, true, false},    // Intel with AMX (oneDNN's, below)
      {{false, false, true}, true, false},   // AMD Zen 3
      {{false, false, false}, true, false},  // anything else
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(::testing::Message()
                 << "avx512_bf16 " << row.cpu.avx512_bf16 << ", amx " << row.cpu.amx_bf16
                 << ", amd " << row.cpu.amd << ", compiled " << row.compiled);
    EXPECT_EQ(sdmha::detail::bfloat16_gemms_pay(row.cpu, row.compiled), row.pays);
  }
}

// The engine over CPU kind × AMX permission × build (AVX512_BF16 kernels, oneDNN) ×
// SDMHA_KERNELS: the AMX tiles exactly where AMX is usable and compiled engines are allowed
// (whatever sdmha's AVX-512 flags: the tiles are inline assembly chosen at run time, with or
// without oneDNN), else the pairs engine where its dot products pay, else float32; forced, the
// machine does not matter.
TEST(CpuFeatures, BFloat16GemmEngineTakesTheAmxTilesWhereUsable) {
  using sdmha::detail::BFloat16GemmEngine;
  using sdmha::detail::BFloat16GemmMachine;
  const CpuFeatures zen4{true, false, true}, sapphire_rapids{true, true, false},
      cooper_lake{true, false, false}, zen3{false, false, true}, other{false, false, false};
  struct Row {
    BFloat16GemmMachine machine;
    BFloat16GemmEngine automatic;
    const char* what;
  };
  // machine: cpu, pairs_compiled, engines_allowed, onednn_built, amx_usable
  const Row rows[] = {
      {{zen4, true, true, true, false}, BFloat16GemmEngine::pairs, "Zen 4, oneDNN built"},
      {{zen4, true, true, false, false}, BFloat16GemmEngine::pairs, "Zen 4"},
      {{zen4, false, false, true, false}, BFloat16GemmEngine::float32, "Zen 4, portable"},
      {{sapphire_rapids, true, true, true, true}, BFloat16GemmEngine::amx, "AMX granted"},
      {{sapphire_rapids, false, true, true, true},
       BFloat16GemmEngine::amx,
       "AMX granted, sdmha built without AVX512_BF16"},
      {{sapphire_rapids, true, true, true, false},
       BFloat16GemmEngine::float32,
       "AMX, tile data refused"},
      {{sapphire_rapids, true, true, false, true}, BFloat16GemmEngine::amx, "AMX, no oneDNN"},
      {{sapphire_rapids, false, false, true, true},
       BFloat16GemmEngine::float32,
       "AMX granted, portable"},
      {{cooper_lake, true, true, true, false}, BFloat16GemmEngine::float32, "Cooper Lake"},
      {{zen3, false, true, true, false}, BFloat16GemmEngine::float32, "Zen 3"},
      {{other, false, true, true, false}, BFloat16GemmEngine::float32, "anything else"},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.what);
    EXPECT_EQ(sdmha::detail::bfloat16_gemm_engine(BFloat16Gemms::automatic, row.machine),
              row.automatic);
    EXPECT_EQ(sdmha::detail::bfloat16_gemm_engine(BFloat16Gemms::on, row.machine),
              BFloat16GemmEngine::pairs);
    EXPECT_EQ(sdmha::detail::bfloat16_gemm_engine(BFloat16Gemms::off, row.machine),
              BFloat16GemmEngine::float32);
    EXPECT_EQ(sdmha::detail::bfloat16_gemm_engine(BFloat16Gemms::onednn, row.machine),
              BFloat16GemmEngine::onednn);
    EXPECT_EQ(sdmha::detail::bfloat16_gemm_engine(BFloat16Gemms::amx, row.machine),
              BFloat16GemmEngine::amx);
    EXPECT_EQ(sdmha::detail::bfloat16_gemm_engine(BFloat16Gemms::amx_emulated, row.machine),
              BFloat16GemmEngine::amx_emulated);
  }
}

// Linux's permission for AMX tile data, asked for on this machine: an answer on every CPU (false
// on one without AMX: no kernel grants a feature the CPU lacks), the same when asked again, and
// the one bfloat16_gemm_machine reports where the tiles are built (x86-64).
TEST(CpuFeatures, AmxTileDataRequestIsAnsweredAndStable) {
  const CpuFeatures& cpu = sdmha::detail::cpu_features();
  const bool granted = sdmha::detail::request_amx_tile_data();
  EXPECT_EQ(sdmha::detail::request_amx_tile_data(), granted);
  if (!cpu.amx_bf16) {
    EXPECT_FALSE(granted);
  }
  EXPECT_EQ(sdmha::detail::amx_bfloat16_usable(), cpu.amx_bf16 && granted);
  // Usable for the engine choice: also built here, and through the tiles' exactness check
  // (AmxGemm.HardwareTilesPassTheExactnessCheck runs it where AMX is usable).
  EXPECT_EQ(sdmha::detail::bfloat16_gemm_machine().amx_usable, sdmha::detail::amx_tiles_verified());
  if (!(sdmha::detail::kHaveAmxTiles && cpu.amx_bf16 && granted)) {
    EXPECT_FALSE(sdmha::detail::amx_tiles_verified());
  }
  std::cout << "[          ] AMX-BF16 " << cpu.amx_bf16 << ", tile data granted " << granted
            << ", oneDNN built " << sdmha::detail::kHaveOneDnnGemm << "\n";
}

}  // namespace
}  // namespace sdmha_test
