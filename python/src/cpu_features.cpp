// python/src/cpu_features.cpp — the module sdmha._cpu: the instruction-set extensions that this
// CPU has and its operating system enables, for sdmha/_kernels.py's choice of extension module.
//
// Compiled for the baseline (no -m flags), so that it imports on any CPU of the target. A feature
// counts only when the CPU reports it (cpuid) and, for AVX and AVX-512, when the operating system
// saves the registers it uses across context switches (XCR0, read with xgetbv): a CPU with
// AVX-512 under a kernel or hypervisor that does not enable it would fault on the first zmm
// instruction. Intel's Software Developer's Manual, vol. 2A (CPUID) and vol. 1, 13.3 (XCR0).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace {

using Features = std::map<std::string, bool>;

#if defined(__x86_64__) || defined(__i386__)

struct Registers {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

// cpuid(leaf, subleaf), all zero where the CPU has no such leaf.
Registers cpuid(unsigned leaf, unsigned subleaf) {
  Registers r;
  if (__get_cpuid_max(leaf & 0x80000000u, nullptr) < leaf) return r;
  __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
  return r;
}

std::uint64_t xcr0() {
  unsigned low = 0, high = 0;
  __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
  return (std::uint64_t(high) << 32) | low;
}

bool bit(unsigned word, int index) { return (word >> index) & 1u; }

Features detect() {
  const Registers leaf1 = cpuid(1, 0), leaf7 = cpuid(7, 0), leaf7_1 = cpuid(7, 1);
  const Registers extended = cpuid(0x80000001u, 0);
  const bool os_saves = bit(leaf1.ecx, 27);  // OSXSAVE: xgetbv is available
  const std::uint64_t state = os_saves ? xcr0() : 0;
  const bool avx_state = (state & 0x6) == 0x6;       // SSE and AVX (ymm) state
  const bool avx512_state = (state & 0xE6) == 0xE6;  // and opmask, zmm0-15 upper, zmm16-31
  Features f;
  f["sse3"] = bit(leaf1.ecx, 0);
  f["ssse3"] = bit(leaf1.ecx, 9);
  f["sse4.1"] = bit(leaf1.ecx, 19);
  f["sse4.2"] = bit(leaf1.ecx, 20);
  f["movbe"] = bit(leaf1.ecx, 22);
  f["popcnt"] = bit(leaf1.ecx, 23);
  f["lzcnt"] = bit(extended.ecx, 5);
  f["bmi"] = bit(leaf7.ebx, 3);
  f["bmi2"] = bit(leaf7.ebx, 8);
  f["avx"] = avx_state && bit(leaf1.ecx, 28);
  f["fma"] = avx_state && bit(leaf1.ecx, 12);
  f["f16c"] = avx_state && bit(leaf1.ecx, 29);
  f["avx2"] = avx_state && bit(leaf7.ebx, 5);
  f["avx512f"] = avx512_state && bit(leaf7.ebx, 16);
  f["avx512dq"] = avx512_state && bit(leaf7.ebx, 17);
  f["avx512cd"] = avx512_state && bit(leaf7.ebx, 28);
  f["avx512bw"] = avx512_state && bit(leaf7.ebx, 30);
  f["avx512vl"] = avx512_state && bit(leaf7.ebx, 31);
  f["avx512bf16"] = avx512_state && bit(leaf7_1.eax, 5);
  return f;
}

#else

Features detect() { return {}; }  // no x86 extension modules are built for other targets

#endif

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "The x86 instruction-set extensions this CPU has and its operating system enables";
  m.def("features", &detect,
        "{name: bool} for sse3 ... avx512bf16 (GCC's -m names); empty on other architectures");
}
