// tests/compile_fail/stage_without_backward.cpp — compiled (never run) by the `compile.*` tests of
// tests/CMakeLists.txt, once per macro setting:
//
//   (none)               a score kernel derived from ScoreKernel, and a softmax derived from
//                        MaskedSoftmax, neither with a backward of its own: the forward of a
//                        layer with either compiles                              → must compile
//   SDMHA_CALL_BACKWARD  and the backward of the score kernel's layer → must fail, with the
//                        message "the score kernel stage has no backward of its own" alone
//   SDMHA_CALL_BACKWARD and SDMHA_SOFTMAX_STAGE  the backward of the softmax's layer → must fail:
//                        "the softmax stage has no backward of its own"
//
// In every setting, stages that do declare their derivative (their own backward, or the alias
// `using differentiates = Self;`) compile through the layer's backward.
#include <memory>

#include <sdmha/sdmha.hpp>

namespace {

// Doubles every score: a derived stage that forgot its backward (the inherited one would give
// half the true gradient).
template <typename Scalar>
struct DoubledScores : sdmha::ScoreKernel<Scalar> {
  template <typename Args>
  void operator()(const Args& args) const {
    sdmha::ScoreKernel<Scalar>::operator()(args);
    args.scores *= Scalar(2);
  }
};

// Sharpens the softmax, likewise without a backward.
template <typename Scalar>
struct SharperSoftmax : sdmha::MaskedSoftmax<Scalar> {
  void operator()(const typename sdmha::MaskedSoftmax<Scalar>::Arguments& args) const {
    args.scores *= Scalar(2);
    sdmha::MaskedSoftmax<Scalar>::operator()(args);
  }
};

// An additive constant, for which the inherited backward is right: it says so with the alias.
template <typename Scalar>
struct ConstantBias : sdmha::ScoreKernel<Scalar> {
  using differentiates = ConstantBias;
  template <typename Args>
  void operator()(const Args& args) const {
    sdmha::ScoreKernel<Scalar>::operator()(args);
    args.scores.array() += Scalar(0.5);  // −∞ + 0.5 stays −∞
  }
};

// A stage with a backward of its own (and no alias).
template <typename Scalar>
struct Tripled : sdmha::ScoreKernel<Scalar> {
  template <typename Args>
  void operator()(const Args& args) const {
    sdmha::ScoreKernel<Scalar>::operator()(args);
    args.scores *= Scalar(3);
  }
  void backward(const typename sdmha::ScoreKernel<Scalar>::BackwardArguments& args) const {
    args.d_scores *= Scalar(3);
    sdmha::ScoreKernel<Scalar>::backward(args);
  }
};

using sdmha::detail::IsDifferentiable;
static_assert(IsDifferentiable<sdmha::ScoreKernel<double>>::value,
              "the default score kernel differentiates itself");
static_assert(IsDifferentiable<sdmha::MaskedSoftmax<double>>::value,
              "the default softmax differentiates itself");
static_assert(!IsDifferentiable<DoubledScores<double>>::value,
              "a derived stage does not inherit the claim");
static_assert(!IsDifferentiable<SharperSoftmax<double>>::value,
              "a derived stage does not inherit the claim");
static_assert(IsDifferentiable<ConstantBias<double>>::value, "the alias counts");
static_assert(IsDifferentiable<Tripled<double>>::value, "a backward of its own counts");

// The layer's forward, and its backward when `kBackward` (only then is it instantiated).
template <typename Layer, bool kBackward>
void forward_and_maybe_backward() {
  sdmha::MhaConfig config;
  config.num_heads = 2;
  config.key_dim = 4;
  const Layer layer(config, sdmha::MhaWeights<double>::glorot_uniform(config, 8, 8, 8, 1));
  sdmha::SparseQuery<double>::CooIndices indices(1, 3);
  indices << 0, 0, 1;
  sdmha::Vector<double> values(1);
  values << 1.0;
  const auto query = sdmha::SparseQuery<double>::from_coo(1, 1, 8, indices, values);
  Eigen::Tensor<double, 3, Eigen::RowMajor> context(1, 1, 8);
  context.setConstant(1.0);
  const auto result = layer.forward(query, {context, context});
  if constexpr (kBackward) layer.backward(query, {context, context}, result.output);
}

}  // namespace

int main() {
  using Projection = sdmha::SparseQueryProjection<double>;
  using ScoresWithoutBackward = sdmha::SparseDenseMHA<double, Projection, DoubledScores<double>>;
  using SoftmaxWithoutBackward =
      sdmha::SparseDenseMHA<double, Projection, sdmha::ScoreKernel<double>, SharperSoftmax<double>>;
  forward_and_maybe_backward<sdmha::SparseDenseMHA<double, Projection, ConstantBias<double>>,
                             true>();
  forward_and_maybe_backward<sdmha::SparseDenseMHA<double, Projection, Tripled<double>>, true>();
  forward_and_maybe_backward<ScoresWithoutBackward, false>();
  forward_and_maybe_backward<SoftmaxWithoutBackward, false>();
#if defined(SDMHA_CALL_BACKWARD) && defined(SDMHA_SOFTMAX_STAGE)
  forward_and_maybe_backward<SoftmaxWithoutBackward, true>();
#elif defined(SDMHA_CALL_BACKWARD)
  forward_and_maybe_backward<ScoresWithoutBackward, true>();
#endif
  return 0;
}
