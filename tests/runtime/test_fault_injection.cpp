// Allocation failures in a long-lived process: a first forward and backward on a fresh layer and
// Workspace make some number A of heap allocations; for each n in 1..A in turn, the nth of them
// fails (malloc returns null, operator new throws: tests/support/allocation_counter.hpp), and the
// call must end in std::bad_alloc, leaving the layer and its Workspace usable: the next call on
// the same objects gives the results of an undisturbed run, bit for bit. Under .ci/hardening.sh's
// AddressSanitizer stage, LeakSanitizer checks that no failure leaks what was allocated before it.
//
// Its own executable (sdmha_fault_injection_tests, tests/CMakeLists.txt), as the counter replaces
// operator new and wraps malloc & co. for the whole process. One thread per call (num_threads 1),
// so that the nth allocation is the same one on every run.
#include "allocation_counter.hpp"
#include "test_support.hpp"

#include <cstring>
#include <new>

#include <sdmha/sparse_dense_mha.hpp>

#include "same_bits.hpp"

namespace sdmha_test {
namespace {

using sdmha_bench::AllocationCounter;

// A problem with masks, empty rows and dropout, so that the calls take their longer paths.
Case<double> fault_case(sdmha::ScoreStrategy strategy) {
  Shape s = Shape{}.sized(2, 6, 9).with_heads(2, 4, 3, 5);
  s.query_dim = 20;
  s.random_mask = true;
  s.key_mask = true;
  s.empty_rows = true;
  auto c = make_case<double>(s, 31);
  c.options.num_threads = 1;
  c.options.score_strategy = strategy;
  c.options.return_attention_scores = true;
  c.options.training = true;
  c.options.dropout_rate = 0.25;
  return c;
}

struct Calls {
  sdmha::AttentionResult<double> result;
  sdmha::MhaGradients<double> gradients;
};

void forward_backward(const sdmha::SparseDenseMHA<double>& layer, const Case<double>& c,
                      const sdmha::SparseQuery<double>& query, const Tensor3<double>& d_output,
                      sdmha::Workspace<double>& workspace, Calls& out) {
  layer.forward(query, {c.key, c.value}, c.options, workspace, out.result);
  layer.backward(query, {c.key, c.value}, d_output, c.options, workspace, out.gradients);
}

// Heap allocations of `call`.
template <typename Call>
std::int64_t allocations_of(Call&& call) {
  const std::int64_t before = AllocationCounter::allocations();
  call();
  return AllocationCounter::allocations() - before;
}

TEST(FaultInjection, TheCounterFailsTheNthAllocationOnly) {
  ASSERT_TRUE(AllocationCounter::counts_malloc()) << "malloc is not wrapped: no failure injected";
  AllocationCounter::fail_allocation(2);
  void* first = std::malloc(16);
  void* second = std::malloc(16);
  void* third = std::malloc(16);
  EXPECT_NE(first, nullptr);
  EXPECT_EQ(second, nullptr);
  EXPECT_NE(third, nullptr);
  std::free(first);
  std::free(third);
  AllocationCounter::fail_allocation(1);
  double sum = 0;
  EXPECT_THROW(  // Eigen, through malloc
      {
        sdmha::RowMatrix<double> matrix = sdmha::RowMatrix<double>::Constant(8, 8, 1.0);
        sum = matrix.sum();
      },
      std::bad_alloc);
  EXPECT_EQ(sum, 0.0);
  AllocationCounter::fail_allocation(0);
}

TEST(FaultInjection, EachAllocationOfAFirstForwardAndBackwardFailingLeavesLayerAndWorkspaceUsable) {
  for (const auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    const auto c = fault_case(strategy);
    const auto query = c.query();
    Tensor3<double> d_output(c.shape.batch, c.shape.steps, c.problem.output_dim);
    d_output.setConstant(0.5);
    Calls expected;
    std::int64_t first_call = 0;
    {
      const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
      sdmha::Workspace<double> workspace;
      first_call =
          allocations_of([&] { forward_backward(layer, c, query, d_output, workspace, expected); });
    }
    ASSERT_GT(first_call, 3) << "the first calls allocate their workspace and results";
    RecordProperty("allocations_of_a_first_call", int(first_call));
    int throws = 0, wrong = 0;
    for (std::int64_t n = 1; n <= first_call; ++n) {
      const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
      sdmha::Workspace<double> workspace;
      Calls calls;
      AllocationCounter::fail_allocation(n);
      try {
        forward_backward(layer, c, query, d_output, workspace, calls);
      } catch (const std::bad_alloc&) {
        ++throws;
      }
      AllocationCounter::fail_allocation(0);
      forward_backward(layer, c, query, d_output, workspace, calls);  // the same objects again
      const bool same =
          same_bits(calls.result.output, expected.result.output) &&
          same_bits(calls.result.attention_scores, expected.result.attention_scores) &&
          same_gradients(calls.gradients, expected.gradients);
      if (!same)
        ADD_FAILURE() << "allocation " << n << " of " << first_call << ": the next call "
                      << "differs from an undisturbed one";
      wrong += !same;
    }
    EXPECT_EQ(throws, first_call) << "each failed allocation must end the call in bad_alloc";
    EXPECT_EQ(wrong, 0);
  }
}

#undef SDMHA_SAME

}  // namespace
}  // namespace sdmha_test
