// train_toy.cpp — training the layer from scratch: SparseDenseMHA::backward and a few lines of
// Adam.
//
// The task is retrieval. Each example holds 8 slots; a slot's key is an object described by two
// attributes, a colour and a shape (two-hot over 8 + 8 features, the pairs distinct within an
// example, though colours and shapes repeat), and its value is a class (one-hot over 8). A query
// is sparse and multi-hot: the colour and the shape of one slot's object plus two distractor
// features with random values, 4 stored values over 32 features. The answer is the class in the
// slot whose colour and shape both match (a slot matching one attribute is a trap); the output's
// 8 logits go through a softmax cross-entropy. To solve it the layer must learn Wq and Wk so that
// the full match scores well above any half match while the distractors add nothing, and Wv, Wo
// so that the attended value maps back to its class.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <memory>
#include <random>
#include <sdmha/sdmha.hpp>
#include <vector>

namespace {

using Index = Eigen::Index;
using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using CooIndices = Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor>;

constexpr Index kColours = 8, kShapes = 8, kDistractors = 16, kClasses = 8;
constexpr Index kSlots = 8, kQueriesPerExample = 2;
constexpr Index kKeyFeatures = kColours + kShapes;  // colour c → c, shape s → kColours + s
constexpr Index kQueryFeatures = kKeyFeatures + kDistractors;  // the same, then the distractors

// A batch of examples: the sparse query, the dense keys and values, and the answers.
struct Batch {
  sdmha::SparseQuery<float> query;
  Tensor3 key, value;
  std::vector<Index> answers;  // B·T classes
};

Batch make_batch(Index batch, std::mt19937_64& generator) {
  Batch data;
  data.key.resize(batch, kSlots, kKeyFeatures);
  data.value.resize(batch, kSlots, kClasses);
  data.key.setZero();
  data.value.setZero();
  CooIndices indices(batch * kQueriesPerExample * 4, 3);
  Eigen::VectorXf values(indices.rows());
  std::uniform_int_distribution<Index> pick_class(0, kClasses - 1), pick_slot(0, kSlots - 1),
      pick_distractor(0, kDistractors - 1);
  std::uniform_real_distribution<float> noise(-1.0f, 1.0f);
  std::vector<Index> objects(kColours * kShapes), slot_class(kSlots);
  std::iota(objects.begin(), objects.end(), 0);
  Index entry = 0;
  for (Index b = 0; b < batch; ++b) {
    std::shuffle(objects.begin(), objects.end(), generator);  // slot s holds object objects[s]
    for (Index s = 0; s < kSlots; ++s) {
      slot_class[s] = pick_class(generator);
      data.key(b, s, objects[s] / kShapes) = 1.0f;
      data.key(b, s, kColours + objects[s] % kShapes) = 1.0f;
      data.value(b, s, slot_class[s]) = 1.0f;
    }
    for (Index t = 0; t < kQueriesPerExample; ++t) {
      const Index slot = pick_slot(generator);
      data.answers.push_back(slot_class[slot]);
      indices.row(entry) << b, t, objects[slot] / kShapes;
      values[entry++] = 1.0f;
      indices.row(entry) << b, t, kColours + objects[slot] % kShapes;
      values[entry++] = 1.0f;
      // Two distractors (they may coincide: from_coo sums duplicates).
      for (int d = 0; d < 2; ++d) {
        indices.row(entry) << b, t, kKeyFeatures + pick_distractor(generator);
        values[entry++] = noise(generator);
      }
    }
  }
  data.query = sdmha::SparseQuery<float>::from_coo(batch, kQueriesPerExample, kQueryFeatures,
                                                   indices, values);
  return data;
}

// Softmax cross-entropy of the logits (B, T, C) against the answers: the mean loss, the number of
// correct arg-maxes, and ∂loss/∂logits in `d_logits` when it is non-null.
double cross_entropy(const Tensor3& logits, const std::vector<Index>& answers, Index& correct,
                     Tensor3* d_logits) {
  const Index rows = logits.dimension(0) * logits.dimension(1), classes = logits.dimension(2);
  Eigen::Map<const sdmha::RowMatrix<float>> z(logits.data(), rows, classes);
  if (d_logits != nullptr) d_logits->resize(logits.dimension(0), logits.dimension(1), classes);
  double total = 0.0;
  correct = 0;
  for (Index r = 0; r < rows; ++r) {
    Index best = 0;
    z.row(r).maxCoeff(&best);
    correct += best == answers[std::size_t(r)];
    const Eigen::ArrayXd shifted =
        (z.row(r).cast<double>().array() - double(z.row(r).maxCoeff())).transpose();
    const double log_sum = std::log(shifted.exp().sum());
    total += log_sum - shifted[answers[std::size_t(r)]];
    if (d_logits != nullptr) {
      Eigen::Map<sdmha::RowMatrix<float>> d(d_logits->data(), rows, classes);
      d.row(r) = ((shifted - log_sum).exp() / double(rows)).cast<float>().transpose();
      d(r, answers[std::size_t(r)]) -= 1.0f / float(rows);
    }
  }
  return total / double(rows);
}

// Adam (Kingma & Ba) on one parameter array, with its own first and second moments.
struct Adam {
  float rate = 0.005f, beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f;
  struct Moments {
    Eigen::ArrayXf first, second;
  };
  std::vector<Moments> moments;
  int step = 0;

  template <typename Parameter, typename Gradient>
  void update(std::size_t slot, Parameter& parameter, const Gradient& gradient) {
    if (moments.size() <= slot) moments.resize(slot + 1);
    Moments& m = moments[slot];
    Eigen::Map<Eigen::ArrayXf> p(parameter.data(), parameter.size());
    Eigen::Map<const Eigen::ArrayXf> g(gradient.data(), gradient.size());
    if (m.first.size() != p.size()) {
      m.first = Eigen::ArrayXf::Zero(p.size());
      m.second = Eigen::ArrayXf::Zero(p.size());
    }
    m.first = beta1 * m.first + (1 - beta1) * g;
    m.second = beta2 * m.second + (1 - beta2) * g.square();
    const float correction1 = 1 - std::pow(beta1, float(step)),
                correction2 = 1 - std::pow(beta2, float(step));
    p -= rate * (m.first / correction1) / ((m.second / correction2).sqrt() + epsilon);
  }
};

}  // namespace

int main() {
  sdmha::MhaConfig config;
  config.num_heads = 2;
  config.key_dim = 8;
  config.output_dim = kClasses;
  // The layer is made once and shares its weights with the loop, which updates them in place.
  auto weights = std::make_shared<sdmha::MhaWeights<float>>(
      sdmha::MhaWeights<float>::glorot_uniform(config, kQueryFeatures, kKeyFeatures, kClasses, 7));
  sdmha::SparseDenseMHA<float> layer(config, weights);

  sdmha::AttentionOptions<float> options;
  options.num_threads = 1;
  std::mt19937_64 generator(2024);
  Adam adam;
  constexpr int kSteps = 400;
  constexpr Index kBatch = 32;
  double running_loss = 0.0;
  // Kept across steps: after the first one, forward and backward take no working memory from the
  // heap and start no threads.
  sdmha::Workspace<float> workspace;
  sdmha::AttentionResult<float> forward_result;
  sdmha::MhaGradients<float> gradients;
  for (int step = 1; step <= kSteps; ++step) {
    const Batch batch = make_batch(kBatch, generator);
    // K and V are projected once, for the forward and the backward both.
    const auto context = layer.project_context(batch.key, batch.value, options.num_threads);
    layer.forward(batch.query, context, options, workspace, forward_result);
    Tensor3 d_logits;
    Index correct = 0;
    running_loss += cross_entropy(forward_result.output, batch.answers, correct, &d_logits);
    layer.backward(batch.query, {batch.key, batch.value, context}, d_logits, options, workspace,
                   gradients);
    // In place, through the shared handle: the next forward sees the new weights.
    ++adam.step;
    adam.update(0, weights->query_kernel, gradients.query_kernel);
    adam.update(1, weights->query_bias, gradients.query_bias);
    adam.update(2, weights->key_kernel, gradients.key_kernel);
    adam.update(3, weights->key_bias, gradients.key_bias);
    adam.update(4, weights->value_kernel, gradients.value_kernel);
    adam.update(5, weights->value_bias, gradients.value_bias);
    adam.update(6, weights->output_kernel, gradients.output_kernel);
    adam.update(7, weights->output_bias, gradients.output_bias);
    if (step % 50 == 0) {
      std::printf("step %3d  loss %.4f\n", step, running_loss / 50.0);
      running_loss = 0.0;
    }
  }

  // Held-out examples, never trained on.
  std::mt19937_64 held_out_generator(99);
  const Batch test = make_batch(1000, held_out_generator);
  const auto logits = layer.forward(test.query, {test.key, test.value}, options).output;
  Index correct = 0;
  const double test_loss = cross_entropy(logits, test.answers, correct, nullptr);
  const double accuracy = double(correct) / double(test.answers.size());
  std::printf("held-out loss %.4f (chance: %.4f)\n", test_loss, std::log(double(kClasses)));
  constexpr double kRequiredAccuracy = 0.95;
  const bool learnt = accuracy >= kRequiredAccuracy;
  std::printf("accuracy %.3f %s %.2f: %s\n", accuracy, learnt ? ">=" : "<", kRequiredAccuracy,
              learnt ? "ok" : "FAILED");
  return learnt ? 0 : 1;
}
