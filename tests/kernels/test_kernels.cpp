// Tests of sdmha/kernels.hpp: SDMHA_KERNELS=portable switches the compiled AVX-512 GEMM engines
// off at run time. This file runs twice under CTest: in the suite as the environment has it, and
// as kernels.portable_switch with SDMHA_KERNELS=portable (tests/CMakeLists.txt). Each run checks
// that active_kernels() says what the build and the environment allow, and that detail::gemm<float>
// then gives bitwise the product of the engine it names: the AVX-512 engine's, or that of Eigen's
// GEMM driver over the same blocking (which is what detail::gemm runs without the engine).
#include "test_support.hpp"

#include <cstdlib>
#include <cstring>

#include <sdmha/detail/gemm.hpp>
#include <sdmha/kernels.hpp>

namespace sdmha_test {
namespace {

using sdmha::detail::GemmOperand;

TEST(ActiveKernels, OnlyTheValuePortableSwitchesTheEnginesOff) {
  EXPECT_FALSE(sdmha::detail::requests_portable_kernels(nullptr));
  EXPECT_FALSE(sdmha::detail::requests_portable_kernels(""));
  EXPECT_FALSE(sdmha::detail::requests_portable_kernels("auto"));
  EXPECT_FALSE(sdmha::detail::requests_portable_kernels("portables"));
  EXPECT_TRUE(sdmha::detail::requests_portable_kernels("portable"));
}

TEST(ActiveKernels, FollowTheBuildFlagsAndTheEnvironment) {
  const bool allowed = !sdmha::detail::requests_portable_kernels(std::getenv("SDMHA_KERNELS"));
  bool float_engine = false, bfloat16_engine = false;
#if defined(__AVX512F__)
  float_engine = allowed;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  bfloat16_engine = allowed;
#endif
  const sdmha::ActiveKernels active = sdmha::active_kernels();
  EXPECT_EQ(active.avx512_float_gemm, float_engine);
  EXPECT_EQ(active.avx512_bfloat16_gemm, bfloat16_engine);
}

sdmha::RowMatrix<float> random_matrix(Index rows, Index cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  sdmha::RowMatrix<float> x(rows, cols);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = value(rng);
  return x;
}

// Eigen's GEMM driver on row-major operands, with its own block sizes and buffers of our own.
sdmha::RowMatrix<float> eigen_product(const sdmha::RowMatrix<float>& a,
                                      const sdmha::RowMatrix<float>& b) {
  const Index m = a.rows(), n = b.cols(), k = a.cols();
  const auto sizes = sdmha::detail::gemm_block_sizes<float>(m, n, k);
  // Eigen's packing stores whole aligned vectors: its own allocator gives the alignment.
  Eigen::VectorXf block_a(sizes.mc * sizes.kc), block_b(sizes.kc * sizes.nc);
  sdmha::detail::ScratchGemmBlocking<float> blocking(sizes, block_a.data(), block_b.data());
  sdmha::RowMatrix<float> c = sdmha::RowMatrix<float>::Zero(m, n);
  sdmha::detail::gemm_with_blocking<float>(sdmha::detail::as_operand<float>(a),
                                           sdmha::detail::as_operand<float>(b),
                                           sdmha::MatrixRef<float>(c), 1.0f, blocking);
  return c;
}

bool same_bits(const sdmha::RowMatrix<float>& x, const sdmha::RowMatrix<float>& y) {
  return x.rows() == y.rows() && x.cols() == y.cols() &&
         std::memcmp(x.data(), y.data(), sizeof(float) * std::size_t(x.size())) == 0;
}

TEST(ActiveKernels, FloatGemmRunsTheEngineItNames) {
  std::mt19937 rng(35);
  const Index m = 45, n = 70, k = 300;  // past Eigen's coefficient-wise small products
  const sdmha::RowMatrix<float> a = random_matrix(m, k, rng), b = random_matrix(k, n, rng);
  sdmha::RowMatrix<float> c(m, n);
  sdmha::detail::ScratchBuffer scratch;  // StageScratch's alignment, as a Workspace gives it
  scratch.reserve(sdmha::detail::gemm_workspace_size<float>(m, n, k));
  sdmha::detail::gemm<float>(sdmha::detail::as_operand<float>(a),
                             sdmha::detail::as_operand<float>(b), sdmha::MatrixRef<float>(c), 1.0f,
                             false, scratch.view());
  const sdmha::RowMatrix<float> eigen = eigen_product(a, b);
#if defined(__AVX512F__)
  sdmha::RowMatrix<float> engine(m, n);
  sdmha::detail::gemm_avx512(sdmha::detail::as_operand<float>(a),
                             sdmha::detail::as_operand<float>(b), sdmha::MatrixRef<float>(engine),
                             1.0f, false, {});
  // Otherwise this shape could not tell the two engines apart.
  ASSERT_FALSE(same_bits(engine, eigen)) << "the engines agree bitwise on this shape";
  if (sdmha::active_kernels().avx512_float_gemm) {
    EXPECT_TRUE(same_bits(c, engine)) << "expected the AVX-512 engine's product";
    return;
  }
#endif
  EXPECT_TRUE(same_bits(c, eigen)) << "expected Eigen's product";
}

}  // namespace
}  // namespace sdmha_test
