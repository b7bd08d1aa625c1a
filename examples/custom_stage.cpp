// custom_stage.cpp — swap stages of the layer for your own without touching the others:
// a temperature-scaled softmax and a relative-position bias added to the scores.
//
// A stage is a functor with a nested Arguments struct, a static can_implement(args) and an
// operator()(args); the layer takes it as a template parameter and exposes the instance it
// holds (layer.softmax(), layer.score_kernel(), ...) so that its parameters can be set.
#include <sdmha/sdmha.hpp>

#include <cmath>
#include <cstdio>
#include <limits>

// softmax(S / temperature): a temperature above 1 flattens the attention, below 1 sharpens it.
template <typename Scalar>
struct TemperatureSoftmax {
  using ScalarType = Scalar;
  using Arguments = typename sdmha::MaskedSoftmax<Scalar>::Arguments;
  Scalar temperature = Scalar(1);

  static void can_implement(const Arguments& args) { sdmha::MaskedSoftmax<Scalar>::can_implement(args); }
  void operator()(const Arguments& args) const {
    args.scores /= temperature;  // −∞ (blocked) stays −∞
    sdmha::MaskedSoftmax<Scalar>{}(args);
  }
};

// S[t, s] − slope·|t − s| (an ALiBi-style relative-position bias) on top of the usual scores, in
// both forms of the score kernel; the bias is added after the mask, and −∞ stays −∞.
template <typename Scalar>
struct RelativePositionScores : sdmha::ScoreKernel<Scalar> {
  using Base = sdmha::ScoreKernel<Scalar>;
  Scalar slope = Scalar(0);

  void operator()(const typename Base::Arguments& args) const {
    Base::operator()(args);
    add_bias(args.scores);
  }
  void operator()(const typename Base::SparseArguments& args) const {
    Base::operator()(args);
    add_bias(args.scores);
  }

 private:
  void add_bias(sdmha::MatrixRef<Scalar>& scores) const {
    for (Eigen::Index t = 0; t < scores.rows(); ++t)
      for (Eigen::Index s = 0; s < scores.cols(); ++s)
        scores(t, s) -= slope * Scalar(std::abs(double(t - s)));
  }
};

using CustomLayer = sdmha::SparseDenseMHA<float, sdmha::SparseQueryProjection<float>,
                                          RelativePositionScores<float>, TemperatureSoftmax<float>>;

int main() {
  const Eigen::Index batch = 2, steps = 6, key_steps = 6, features = 1000;
  sdmha::MhaConfig config;
  config.num_heads = 2;
  config.key_dim = 16;
  const auto weights = sdmha::MhaWeights<float>::glorot_uniform(config, features, 32, 32, 1);

  Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor> indices(batch * steps, 3);
  Eigen::VectorXf values = Eigen::VectorXf::Ones(batch * steps);
  for (Eigen::Index row = 0; row < batch * steps; ++row) indices.row(row) << row / steps, row % steps, (row * 37) % features;
  const auto query = sdmha::SparseQuery<float>::from_coo(batch, steps, features, indices, values);
  Eigen::Tensor<float, 3, Eigen::RowMajor> context(batch, key_steps, 32);
  context.setRandom();

  sdmha::AttentionOptions<float> options;
  options.return_attention_scores = true;
  const sdmha::SparseDenseMHA<float> standard(config, weights);
  CustomLayer custom(config, weights);
  const auto expected = standard.forward(query, context, options);

  // With temperature 1 and no bias the custom layer is the standard one.
  const auto same = custom.forward(query, context, options);
  const Eigen::Tensor<float, 0, Eigen::RowMajor> same_difference = (same.output - expected.output).abs().maximum();
  std::printf("temperature 1, slope 0: max |custom - standard| = %.3g\n", double(same_difference()));

  custom.softmax().temperature = 4.0f;
  custom.score_kernel().slope = 0.5f;
  const auto tuned = custom.forward(query, context, options);
  // The relative-position bias makes the diagonal the most likely key for each step.
  const float diagonal = tuned.attention_scores(0, 0, 3, 3), far = tuned.attention_scores(0, 0, 3, 0);
  std::printf("temperature 4, slope 0.5: P[t=3, s=3] = %.4f, P[t=3, s=0] = %.4f\n", diagonal, far);
  const bool ok = same_difference() == 0.0f && diagonal > far;
  std::printf("%s\n", ok ? "custom stages ok" : "custom stages FAILED");
  return ok ? 0 : 1;
}
