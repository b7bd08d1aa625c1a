// sdmha/detail/cpu_features.hpp — what the CPU running the process can do, where a kernel's
// choice depends on more than what the compiler was allowed to use, and the choice the bfloat16
// mode makes from it.
//
//   math:  none; CPUID leaves 0 (vendor), 7.0 (AMX-BF16: EDX bit 22) and 7.1 (AVX512_BF16: EAX
//          bit 5), read once per process
//   pre:   none (every answer is false on a CPU or compiler without CPUID)
//   cost:  a few CPUID instructions, once; a getenv per set_precision
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

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
  bool amx_bf16 = false;     // AMX tiles with bfloat16 products (the OS must grant tile data)
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
    features.amx_bf16 = (edx >> 22) & 1u;
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

// How Precision::bfloat16 runs its GEMM stages (the key, value and output projections, the
// scores and P·V): `automatic` takes bfloat16 dot products where they beat the float32 engine on
// this CPU; `on` and `off` force them (the environment variable SDMHA_BFLOAT16_GEMMS, for
// measuring either on any machine).
enum class BFloat16Gemms { automatic, on, off };

// The variable's value: unset or empty and "auto" are automatic; anything else but "on" and "off"
// is a ConfigError naming it, before the layer changes.
inline BFloat16Gemms bfloat16_gemms_from_environment(const char* where) {
  const char* text = std::getenv("SDMHA_BFLOAT16_GEMMS");
  const std::string value = text == nullptr ? "" : text;
  if (value.empty() || value == "auto") return BFloat16Gemms::automatic;
  if (value == "on") return BFloat16Gemms::on;
  if (value == "off") return BFloat16Gemms::off;
  fail<ConfigError>(where, "SDMHA_BFLOAT16_GEMMS = '", value, "'; expected auto, on or off");
}

// Whether bfloat16 dot products pay for the GEMM stages. They halve the kernels' memory traffic
// everywhere; what decides is their multiply-add rate against float32 FMA:
//  - AMD Zen 4 and 5 (AVX512_BF16): one vdpbf16ps does 32 multiply-adds at the FMA's issue rate,
//    twice float32's;
//  - Intel's AVX512_BF16 (Cooper Lake, Sapphire Rapids and later cores): the 512-bit vdpbf16ps
//    retires at half the FMA's rate, the same multiply-adds a cycle as float32 plus the rounding
//    of the operands, so float32 wins; AMX, Intel's bfloat16 engine, has no kernel here yet, so
//    these GEMMs stay float32;
//  - no AVX512_BF16 kernels running (`compiled` false: not in the CPU, not in the build, or
//    switched off by SDMHA_KERNELS=portable, sdmha/kernels.hpp's active_kernels()): the portable
//    loop, far slower than the float32 engine.
// Wq's bfloat16 copy (the sparse query projection, bound by its memory traffic) is used in every
// case: it is the query projection's choice, not this one.
inline bool bfloat16_gemms_pay(const CpuFeatures& cpu, bool compiled) {
  return compiled && cpu.avx512_bf16 && cpu.amd;
}

inline bool use_bfloat16_gemms(BFloat16Gemms choice, const CpuFeatures& cpu, bool compiled) {
  if (choice == BFloat16Gemms::automatic) return bfloat16_gemms_pay(cpu, compiled);
  return choice == BFloat16Gemms::on;
}

}  // namespace sdmha::detail
