// sdmha/detail/cpu_features.hpp — what the CPU running the process can do, where a kernel's
// choice depends on more than what the compiler was allowed to use, and the engine the bfloat16
// mode chooses from it.
//
//   math:  none; CPUID leaves 0 (vendor), 7.0 (AMX-BF16 and AMX-TILE: EDX bits 22 and 24) and
//          7.1 (AVX512_BF16: EAX bit 5), read once per process; Linux's permission for AMX tile
//          data (x86-64: the tile instructions exist in 64-bit mode only), asked for once
//   pre:   none (every answer is false on a CPU or compiler without CPUID, or off Linux)
//   cost:  a few CPUID instructions and at most three arch_prctl calls, once; a getenv per
//          set_precision
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#define SDMHA_HAVE_ARCH_PRCTL 1
#endif

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) || defined(__clang__)
#include <cpuid.h>
#define SDMHA_HAVE_CPUID 1
#endif
#endif

#include "sdmha/errors.hpp"

namespace sdmha::detail {

struct CpuFeatures {
  bool avx512_bf16 = false;  // VDPBF16PS: bfloat16 pair dot products with float32 sums
  bool amx_bf16 = false;     // AMX tiles (AMX-TILE) with bfloat16 products (AMX-BF16); the OS
                             // must grant the tile data
  bool amd = false;          // vendor AuthenticAMD
};

inline CpuFeatures detect_cpu_features() {
  CpuFeatures features;
#ifdef SDMHA_HAVE_CPUID
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return features;
  const unsigned max_leaf = eax;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  features.amd = std::strcmp(vendor, "AuthenticAMD") == 0;
  if (max_leaf >= 7 && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0) {
    features.amx_bf16 = ((edx >> 22) & 1u) && ((edx >> 24) & 1u);
    if (eax >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0)
      features.avx512_bf16 = (eax >> 5) & 1u;
  }
#endif
  return features;
}

// This process's CPU, read on first use.
inline const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect_cpu_features();
  return features;
}

// Linux keeps AMX's tile data (8 KB of register state a thread) out of a process until the
// process asks for it with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) (Linux 5.16 and
// later); a tile instruction without the permission faults. Whether this process has it: already
// granted, or granted now. False where the kernel is older, refuses (no AMX, or a signal stack too
// small for the state), or is not Linux. The permission is the process's, and asking again once
// it is granted changes nothing. Once granted, Linux refuses the process a sigaltstack too small
// for the larger signal frame (ENOMEM): a host program that installs small alternate signal
// stacks should do so before its first bfloat16 set_precision.
inline bool request_amx_tile_data() {
#ifdef SDMHA_HAVE_ARCH_PRCTL
  constexpr long kGetPermission = 0x1022, kRequestPermission = 0x1023;  // ARCH_{GET,REQ}_XCOMP_PERM
  constexpr unsigned long kTileData = 18;  // XFEATURE_XTILEDATA: bit 18 of the feature mask
  std::uint64_t granted = 0;               // the kernel writes a u64
  if (syscall(SYS_arch_prctl, kGetPermission, &granted) != 0) return false;
  if ((granted >> kTileData) & 1u) return true;
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) return false;
  return syscall(SYS_arch_prctl, kGetPermission, &granted) == 0 && ((granted >> kTileData) & 1u);
#else
  return false;
#endif
}

// Whether AMX's bfloat16 tiles can run in this process: the CPU has them and Linux granted the
// tile data, asked for at the first call on a CPU with AMX-BF16 (never elsewhere).
inline bool amx_bfloat16_usable() {
  static const bool usable = cpu_features().amx_bf16 && request_amx_tile_data();
  return usable;
}

// How Precision::bfloat16 runs its GEMM stages (the key, value and output projections, the
// scores and P·V): `automatic` takes the engine that beats float32 on this CPU; the others force
// one (the environment variable SDMHA_BFLOAT16_GEMMS, for measuring any of them on any machine):
// on, off, onednn, amx, amx-emulated.
enum class BFloat16Gemms { automatic, on, off, onednn, amx, amx_emulated };

// The engines the bfloat16 mode can run its GEMM stages on.
enum class BFloat16GemmEngine {
  float32,       // none: every GEMM stage stays float32
  pairs,         // gemm_bfloat16.hpp's (vdpbf16ps, or its portable loop) for the projections, the
                 // scores and P·V
  onednn,        // oneDNN's matmul (gemm_onednn.hpp; AMX tiles where usable) for the projections;
                 // the scores and P·V stay float32
  amx,           // gemm_amx.hpp's tiles for all of them
  amx_emulated,  // the same on its emulated tiles: slow, for tests on any CPU
};

// The engine by the SDMHA_BFLOAT16_GEMMS value that forces it ("off" for float32).
inline const char* to_string(BFloat16GemmEngine engine) {
  switch (engine) {
    case BFloat16GemmEngine::pairs:
      return "on";
    case BFloat16GemmEngine::onednn:
      return "onednn";
    case BFloat16GemmEngine::amx:
      return "amx";
    case BFloat16GemmEngine::amx_emulated:
      return "amx-emulated";
    case BFloat16GemmEngine::float32:
      break;
  }
  return "off";
}

// The variable's value: unset or empty and "auto" are automatic; "onednn" only in a build with
// oneDNN (`onednn_built`), "amx" only where AMX is usable (`amx_usable`); anything else but
// "on", "off" and "amx-emulated" is a ConfigError naming it, before the layer changes.
inline BFloat16Gemms bfloat16_gemms_from_environment(const char* where, bool onednn_built,
                                                     bool amx_usable) {
  const char* text = std::getenv("SDMHA_BFLOAT16_GEMMS");
  const std::string value = text == nullptr ? "" : text;
  if (value.empty() || value == "auto") return BFloat16Gemms::automatic;
  if (value == "on") return BFloat16Gemms::on;
  if (value == "off") return BFloat16Gemms::off;
  if (value == "amx-emulated") return BFloat16Gemms::amx_emulated;
  if (value == "onednn" && onednn_built) return BFloat16Gemms::onednn;
  if (value == "amx" && amx_usable) return BFloat16Gemms::amx;
  const std::string expected = std::string("auto, on, off") + (onednn_built ? ", onednn" : "") +
                               (amx_usable ? ", amx" : "") + " or amx-emulated";
  if (value == "onednn")
    fail<ConfigError>(where, "SDMHA_BFLOAT16_GEMMS = 'onednn' but this build has no oneDNN ",
                      "(SDMHA_WITH_ONEDNN); expected ", expected);
  if (value == "amx")
    fail<ConfigError>(where, "SDMHA_BFLOAT16_GEMMS = 'amx' but AMX is not usable here (no ",
                      "AMX-BF16 in the CPU, Linux refused its tile data, or the tiles failed ",
                      "their exactness check); expected ", expected);
  fail<ConfigError>(where, "SDMHA_BFLOAT16_GEMMS = '", value, "'; expected ", expected);
}

// Whether bfloat16 dot products pay for the GEMM stages. They halve the kernels' memory traffic
// everywhere; what decides is their multiply-add rate against float32 FMA:
//  - AMD Zen 4 and 5 (AVX512_BF16): one vdpbf16ps does 32 multiply-adds at the FMA's issue rate,
//    twice float32's;
//  - Intel's AVX512_BF16 (Cooper Lake, Sapphire Rapids and later cores): the 512-bit vdpbf16ps
//    retires at half the FMA's rate, the same multiply-adds a cycle as float32 plus the rounding
//    of the operands, so float32 wins (AMX, Intel's bfloat16 engine, is the oneDNN engine's:
//    bfloat16_gemm_engine below);
//  - no AVX512_BF16 kernels running (`compiled` false: not in the CPU, not in the build, or
//    switched off by SDMHA_KERNELS=portable, sdmha/kernels.hpp's active_kernels()): the portable
//    loop, far slower than the float32 engine.
// Wq's bfloat16 copy (the sparse query projection, bound by its memory traffic) is used in every
// case: it is the query projection's choice, not this one.
inline bool bfloat16_gemms_pay(const CpuFeatures& cpu, bool compiled) {
  return compiled && cpu.avx512_bf16 && cpu.amd;
}

// What the engine choice depends on besides the CPU.
struct BFloat16GemmMachine {
  CpuFeatures cpu;
  bool pairs_compiled = false;   // active_kernels().avx512_bfloat16_gemm
  bool engines_allowed = false;  // SDMHA_KERNELS allows compiled engines (not "portable")
  bool onednn_built = false;     // SDMHA_WITH_ONEDNN (gemm_onednn.hpp)
  bool amx_usable = false;       // gemm_amx.hpp's amx_tiles_verified()
};

// The engine for the bfloat16 mode's GEMM stages. Automatic: the AMX tiles where usable (they
// multiply bfloat16 several times faster than float32 FMA) unless SDMHA_KERNELS=portable; else
// the pairs engine where its dot products pay (bfloat16_gemms_pay); else float32. Forced: `on`
// the pairs engine, `off` float32, `onednn` oneDNN (on a CPU without AMX it runs oneDNN's AVX-512
// kernels), `amx` the tiles, `amx-emulated` their emulation (how the tile engine is tested on a
// CPU without AMX). The scores and P·V are small per-head products of shapes that vary with the
// tile, where oneDNN's cost per call (a primitive per shape, memory objects per call) would weigh
// as much as the product: with oneDNN they stay on the float32 engine; the tiles take them all.
inline BFloat16GemmEngine bfloat16_gemm_engine(BFloat16Gemms choice,
                                               const BFloat16GemmMachine& machine) {
  switch (choice) {
    case BFloat16Gemms::on:
      return BFloat16GemmEngine::pairs;
    case BFloat16Gemms::off:
      return BFloat16GemmEngine::float32;
    case BFloat16Gemms::onednn:
      return BFloat16GemmEngine::onednn;
    case BFloat16Gemms::amx:
      return BFloat16GemmEngine::amx;
    case BFloat16Gemms::amx_emulated:
      return BFloat16GemmEngine::amx_emulated;
    case BFloat16Gemms::automatic:
      break;
  }
  if (machine.engines_allowed && machine.amx_usable) return BFloat16GemmEngine::amx;
  if (bfloat16_gemms_pay(machine.cpu, machine.pairs_compiled)) return BFloat16GemmEngine::pairs;
  return BFloat16GemmEngine::float32;
}

}  // namespace sdmha::detail
