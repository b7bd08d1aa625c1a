// sdmha/kernels.hpp — which of the build's GEMM engines run: the AVX-512 ones that the compiler
// flags put in (float32: detail/gemm_avx512.hpp; bfloat16: detail/gemm_bfloat16.hpp's vdpbf16ps
// form), unless the environment variable SDMHA_KERNELS is "portable".
//
//   math:  none: a switch, read from the environment once per process, then fixed
//   pre:   SDMHA_KERNELS set before the first GEMM or active_kernels() of the process
//   cost:  one getenv at the first call, a load of a static after it
//
// Why a run-time switch at all: a build with -march=native (or -mavx512f) has no other way to
// show what its results are without the AVX-512 engines, e.g. to compare with the portable build
// a wheel falls back to on a CPU without AVX-512, on the same machine and binary. With
// SDMHA_KERNELS=portable every float32 product goes to Eigen's GEMM and every bfloat16 product
// to the portable loop, the paths of a build without those flags; the rest of the code (Eigen's
// vectorised expressions, the softmax's exp) stays as compiled, and the bfloat16 mode does not
// choose the AMX tiles by itself (detail/cpu_features.hpp). Any other value, or none, keeps
// the compiled engines: the Python package, which picks its extension by the same variable,
// refuses values it does not know.
#pragma once

#include <cstdlib>
#include <cstring>

namespace sdmha {

// The engines the GEMMs of this process use.
struct ActiveKernels {
  bool avx512_float_gemm = false;     // detail::gemm<float> on the AVX-512 engine, else Eigen's
  bool avx512_bfloat16_gemm = false;  // the bfloat16 GEMMs on vdpbf16ps, else the portable loop
};

namespace detail {

// Whether `value` (SDMHA_KERNELS, or nullptr when unset) asks for the portable kernels.
inline bool requests_portable_kernels(const char* value) {
  return value != nullptr && std::strcmp(value, "portable") == 0;
}

// Whether the compiled AVX-512 engines may run: read once (a function-local static is
// initialised once, thread-safely) so that every GEMM of a process takes the same path and
// results stay deterministic across calls and threads.
inline bool avx512_kernels_allowed() {
  static const bool allowed = !requests_portable_kernels(std::getenv("SDMHA_KERNELS"));
  return allowed;
}

}  // namespace detail

// The engines in use: compiled in (the build's flags) and allowed (SDMHA_KERNELS).
inline ActiveKernels active_kernels() {
  ActiveKernels kernels;
#if defined(__AVX512F__)
  kernels.avx512_float_gemm = detail::avx512_kernels_allowed();
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  kernels.avx512_bfloat16_gemm = detail::avx512_kernels_allowed();
#endif
  return kernels;
}

}  // namespace sdmha
