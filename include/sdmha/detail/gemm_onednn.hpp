// sdmha/detail/gemm_onednn.hpp — C = bf16(A)·W̃ (+ 1·bᵀ) through oneDNN's matmul, on the calling
// thread: the bfloat16 mode's dense projections where AMX is usable (cpu_features.hpp's choice).
//
//   math:  C = bf16(A)·W̃ + 1·bᵀ (b optional), W̃ a BFloat16Kernel's bfloat16 kernel; each product
//          exact, the sums in float32 (gemm_bfloat16.hpp's bound; oneDNN's order of the sums)
//   pre:   a build with oneDNN (SDMHA_WITH_ONEDNN: CMake's sdmha::onednn); A (m × k) float and C
//          (m × n) row-major; scratch of gemm_bfloat16_workspace_size(m, n, k) bytes
//   cost:  m·n·k multiply-adds on oneDNN's brgemm kernels (AMX tiles where usable, else its
//          AVX512_BF16 ones), one rounding copy of A; a primitive per distinct (m, ldc, bias),
//          made at its first call (a JIT compilation), then a lookup and a few small objects
//
// Threads: oneDNN 2.6 as Debian builds it runs on OpenMP (DNNL_CPU_THREADING_RUNTIME is OMP), and
// a matmul fans out to omp_get_max_threads() threads of the calling thread. The layer calls it
// from its own workers, a row block each, so every call runs with the calling thread's OpenMP
// thread count at 1 and restores it after: oneDNN then runs the product inline (its parallel()
// with one thread calls the body directly) and blocks it for one thread (it reads the count when
// it makes a primitive; the count is part of its primitive cache's key). The OpenMP functions are
// those of the runtime oneDNN itself is linked with, looked up through oneDNN's library: the
// program may link another runtime, or none. A sequential oneDNN needs nothing; one built on TBB
// or on a threadpool is refused at compile time.
//
// AMX: oneDNN 2.6 uses AMX by default where the CPU has it (its ISA limit, ONEDNN_MAX_CPU_ISA,
// defaults to everything) and asks Linux for the tile data itself (arch_prctl, as
// cpu_features.hpp's request_amx_tile_data does); its matmul list puts the AMX brgemm before the
// AVX512_BF16 one, which it also refuses for small shapes (M ≤ 32 with M·N ≤ 256, or K ≤ 16).
//
// W̃ is handed over once in the layout the matmul asks for `typical_rows` rows (blocked in pairs
// of rows for its kernels); every primitive is made for that layout. Only brgemm primitives are
// taken: the last of oneDNN's list, its reference matmul, takes any layout at a fraction of the
// speed (its brgemm implementations are named "brg:" and the ISA). A shape that none serves is left
// to gemm_bfloat16.hpp's engine (run returns false). A is rounded as that engine's packing rounds
// it (vcvtneps2bf16 where it uses it, Eigen's ties to even elsewhere), W̃ is the BFloat16Kernel's
// bits: only the order of the sums differs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sdmha/config.hpp"
#include "sdmha/detail/cpu_features.hpp"
#include "sdmha/detail/gemm_amx.hpp"
#include "sdmha/detail/gemm_bfloat16.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/kernels.hpp"
#include "sdmha/stage.hpp"

#if defined(SDMHA_WITH_ONEDNN)
#include <dlfcn.h>

#include <oneapi/dnnl/dnnl.hpp>

#if DNNL_CPU_THREADING_RUNTIME != DNNL_RUNTIME_OMP && DNNL_CPU_THREADING_RUNTIME != DNNL_RUNTIME_SEQ
#error "sdmha's oneDNN engine needs oneDNN built with CPU runtime OMP or SEQ"
#endif
#endif

namespace sdmha::detail {

#if defined(SDMHA_WITH_ONEDNN)
inline constexpr bool kHaveOneDnnGemm = true;
#else
inline constexpr bool kHaveOneDnnGemm = false;
#endif

// What the bfloat16 engine choice sees of this process (cpu_features.hpp's
// bfloat16_gemm_engine); the tile data is asked for, and the tiles checked, on a CPU with
// AMX-BF16 alone (gemm_amx.hpp's amx_tiles_verified).
inline BFloat16GemmMachine bfloat16_gemm_machine() {
  BFloat16GemmMachine machine;
  machine.cpu = cpu_features();
  machine.pairs_compiled = active_kernels().avx512_bfloat16_gemm;
  machine.engines_allowed = avx512_kernels_allowed();
  machine.onednn_built = kHaveOneDnnGemm;
  machine.amx_usable = amx_tiles_verified();
  return machine;
}

#if defined(SDMHA_WITH_ONEDNN)

namespace onednn {

inline const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
// omp_get_max_threads and omp_set_num_threads of the OpenMP runtime oneDNN is linked with: a
// lookup through oneDNN's library searches it and its dependencies.
struct OpenMpThreads {
  int (*max_threads)() = nullptr;
  void (*set_threads)(int) = nullptr;
};
inline OpenMpThreads find_openmp_threads() {
  OpenMpThreads found;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&dnnl_version), &info) == 0 || info.dli_fname == nullptr)
    return found;
  void* library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (library == nullptr) return found;
  found.max_threads = reinterpret_cast<int (*)()>(dlsym(library, "omp_get_max_threads"));
  found.set_threads = reinterpret_cast<void (*)(int)>(dlsym(library, "omp_set_num_threads"));
  dlclose(library);  // the reference RTLD_NOLOAD took; the library stays, linked in
  return found;
}
inline const OpenMpThreads& openmp_threads() {
  static const OpenMpThreads threads = find_openmp_threads();
  return threads;
}
#endif

// While it lives, oneDNN runs on the calling thread alone (see the top of the file). OpenMP's
// thread count is the calling thread's own setting, so workers do not disturb one another.
class CallingThreadOnly {
 public:
  CallingThreadOnly() {
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
    const OpenMpThreads& omp = openmp_threads();
    if (omp.max_threads == nullptr || omp.set_threads == nullptr)
      fail<ConfigError>("oneDNN bfloat16 GEMM",
                        "omp_set_num_threads not found through oneDNN's library; expected the "
                        "OpenMP runtime oneDNN links");
    previous_ = omp.max_threads();
    if (previous_ != 1) omp.set_threads(1);
#endif
  }
  ~CallingThreadOnly() {
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
    if (previous_ != 1) openmp_threads().set_threads(previous_);
#endif
  }
  CallingThreadOnly(const CallingThreadOnly&) = delete;
  CallingThreadOnly& operator=(const CallingThreadOnly&) = delete;

 private:
  int previous_ = 1;
};

// out[i·k + p] = the bfloat16 bits of A(i, p), rounded as gemm_bfloat16.hpp's packing rounds.
inline void round_rows(const ConstMatrixRef<float>& a, std::uint16_t* out) {
  const Index m = a.rows(), k = a.cols();
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (avx512_kernels_allowed()) {
    for (Index i = 0; i < m; ++i)
      for (Index p = 0; p < k; p += 16) {
        const __mmask16 mask = avx512_gemm::lanes(k - p);
        const __m256bh rounded =
            _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, a.data() + i * a.outerStride() + p));
        _mm256_mask_storeu_epi16(out + i * k + p, mask, (__m256i)rounded);
      }
    return;
  }
#endif
  for (Index i = 0; i < m; ++i)
    for (Index p = 0; p < k; ++p) out[i * k + p] = std::uint16_t(bfloat16_bits(a(i, p)));
}

using Dims = dnnl::memory::dims;
using DataType = dnnl::memory::data_type;
using Tag = dnnl::memory::format_tag;

}  // namespace onednn

// A BFloat16Kernel's W̃ in oneDNN's layout, and the matmul primitives made for it.
class OneDnnBFloat16Gemm final : public ExternalBFloat16Gemm {
 public:
  OneDnnBFloat16Gemm(const BFloat16Kernel& kernel, Index typical_rows)
      : k_(kernel.rows()), n_(kernel.cols()) {
    using namespace onednn;
    const CallingThreadOnly calling_thread;
    std::vector<std::uint16_t> plain(std::size_t(k_ * n_));
    for (Index p = 0; p < k_; ++p)
      for (Index j = 0; j < n_; ++j)
        plain[std::size_t(p * n_ + j)] =
            std::uint16_t(kernel.pairs()(p / 2, j) >> (p % 2 == 0 ? 0 : 16) & 0xFFFFu);
    const dnnl::memory::desc any(Dims{k_, n_}, DataType::bf16, Tag::any);
    const dnnl::matmul::primitive_desc chosen(
        dnnl::matmul::desc(source_desc(typical_rows), any, output_desc(typical_rows, n_)),
        cpu_engine());
    weights_ = dnnl::memory(chosen.weights_desc(), cpu_engine());
    dnnl::memory source(dnnl::memory::desc(Dims{k_, n_}, DataType::bf16, Tag::ab), cpu_engine(),
                        plain.data());
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(source, weights_).execute(stream, source, weights_);
    stream.wait();
  }

  // The scratch holds A rounded, then the primitive's scratchpad (with less, memory of its own).
  bool run(const ConstMatrixRef<float>& a, MatrixRef<float> c, const float* column_bias,
           StageScratch scratch) const override {
    using namespace onednn;
    const Index m = c.rows();
    const Primitive made = primitive({m, c.outerStride(), column_bias != nullptr});
    if (!made.matmul) return false;
    const std::size_t scratchpad_bytes = made.scratchpad.get_size();
    const ScratchOrOwn memory(scratch,
                              array_bytes<std::uint16_t>(m * k_) + aligned_bytes(scratchpad_bytes));
    ScratchCarver carver(memory.view());
    std::uint16_t* rounded = carver.take<std::uint16_t>(m * k_);
    std::byte* scratchpad = carver.take<std::byte>(Index(scratchpad_bytes));
    round_rows(a, rounded);
    const CallingThreadOnly calling_thread;
    std::unordered_map<int, dnnl::memory> arguments{
        {DNNL_ARG_SRC, dnnl::memory(source_desc(m), cpu_engine(), rounded)},
        {DNNL_ARG_WEIGHTS, weights_},
        {DNNL_ARG_DST, dnnl::memory(output_desc(m, c.outerStride()), cpu_engine(), c.data())},
        {DNNL_ARG_SCRATCHPAD, dnnl::memory(made.scratchpad, cpu_engine(), scratchpad)}};
    if (column_bias != nullptr)  // read only: oneDNN takes a handle without const
      arguments.emplace(DNNL_ARG_BIAS,
                        dnnl::memory(bias_desc(), cpu_engine(), const_cast<float*>(column_bias)));
    dnnl::stream stream(cpu_engine());
    made.matmul->execute(stream, arguments);
    return true;
  }

  // oneDNN's name for the implementation it picks for m rows (no bias, C m × n): which kernels a
  // product runs on: "brg:avx512_core_amx_bf16" for its AMX brgemm, "brg:avx512_core_bf16" for
  // its AVX512_BF16 one; empty where it has none.
  std::string implementation(Index m) const {
    const onednn::CallingThreadOnly calling_thread;
    const auto description = describe({m, n_, false});
    return description ? description->impl_info_str() : "";
  }

 private:
  struct Shape {
    Index rows = 0, ldc = 0;
    bool bias = false;
    bool operator==(const Shape& other) const {
      return rows == other.rows && ldc == other.ldc && bias == other.bias;
    }
  };

  dnnl::memory::desc source_desc(Index m) const {
    return {onednn::Dims{m, k_}, onednn::DataType::bf16, onednn::Tag::ab};
  }
  dnnl::memory::desc output_desc(Index m, Index ldc) const {
    return {onednn::Dims{m, n_}, onednn::DataType::f32, onednn::Dims{ldc, 1}};
  }
  dnnl::memory::desc bias_desc() const {
    return {onednn::Dims{1, n_}, onednn::DataType::f32, onednn::Tag::ab};
  }

  // The matmul's description for `shape` on W̃'s layout, or none where oneDNN has no
  // implementation of it (made with the calling thread's OpenMP count at 1). Its scratchpad is
  // the caller's: oneDNN 2.6's own (its default, without DNNL_ENABLE_CONCURRENT_EXEC, as Debian
  // builds it) is a per-thread buffer sized when a primitive is made, on the thread that makes
  // it, so a primitive run by another worker reads that worker's buffer, which may be too small
  // or in use (measured: wrong products with two workers).
  std::optional<dnnl::matmul::primitive_desc> describe(const Shape& shape) const {
    const dnnl::memory::desc output = output_desc(shape.rows, shape.ldc);
    dnnl::primitive_attr attributes;
    attributes.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    try {
      const auto operation =
          shape.bias ? dnnl::matmul::desc(source_desc(shape.rows), weights_.get_desc(), bias_desc(),
                                          output)
                     : dnnl::matmul::desc(source_desc(shape.rows), weights_.get_desc(), output);
      return dnnl::matmul::primitive_desc(operation, attributes, onednn::cpu_engine());
    } catch (const dnnl::error&) {
      return std::nullopt;
    }
  }

  // A brgemm primitive (a shared handle) and its scratchpad's description; no matmul where
  // oneDNN has none for the shape.
  struct Primitive {
    std::optional<dnnl::matmul> matmul;
    dnnl::memory::desc scratchpad;
  };

  // The primitive for `shape`, made at its first call (under the lock: a JIT compilation once
  // per shape), or none.
  Primitive primitive(const Shape& shape) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, made] : primitives_)
      if (key == shape) return made;
    Primitive made;
    {
      const onednn::CallingThreadOnly calling_thread;
      const auto description = describe(shape);
      if (description && std::string(description->impl_info_str()).rfind("brg:", 0) == 0) {
        made.matmul = dnnl::matmul(*description);
        made.scratchpad = description->scratchpad_desc();
      }
    }
    primitives_.emplace_back(shape, made);
    return made;
  }

  Index k_ = 0, n_ = 0;
  dnnl::memory weights_;  // W̃ in the layout the matmul chose, owned by oneDNN
  mutable std::mutex mutex_;
  mutable std::vector<std::pair<Shape, Primitive>> primitives_;
};

// Hands `kernel` to oneDNN as well: gemm_bfloat16 on it then runs through OneDnnBFloat16Gemm.
// oneDNN's own failure (an engine or a reorder it cannot make) is a ConfigError naming it.
inline void hand_to_onednn(BFloat16Kernel& kernel, Index typical_rows) {
  if (kernel.rows() == 0 || kernel.cols() == 0) return;  // empty products never reach it
  try {
    kernel.set_external(std::make_shared<const OneDnnBFloat16Gemm>(kernel, typical_rows));
  } catch (const dnnl::error& error) {
    fail<ConfigError>("oneDNN bfloat16 GEMM", "oneDNN refused a ", kernel.rows(), " x ",
                      kernel.cols(), " kernel (", error.what(),
                      "); expected SDMHA_BFLOAT16_GEMMS other than onednn");
  }
}

#endif  // SDMHA_WITH_ONEDNN

}  // namespace sdmha::detail
