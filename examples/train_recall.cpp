// Training with linattn's gradients: learn the query, key and value projections of one causal
// linear-attention layer on a synthetic associative-recall task, with Adam written out here (no
// framework), and compare ELU + 1 against positive random features of the same width.
//
// The task. Each sequence holds N = 8 fresh key/value pairs followed by the N keys again in a
// random order: token t is x_t = [key, value, 0] for a pair and [key, 0, 1] for a query (keys
// are random unit vectors in R^16, values N(0, 1/8) in R^8, so nothing can be memorized across
// sequences). The layer reads y = LinearAttention(x Wq, x Wk, x Wv) causally, and at each query
// the target is the value written under that key: loss = mean over queries of |y_t - v|^2.
// Predicting 0 scores about 1.0; recall accuracy (is y nearest to the right value among the
// sequence's 8 values?) starts near chance, 1/8.
//
// What it shows: parallel_backward() gives dQ, dK, dV; the projections' gradients are
// X^T dQ, X^T dK, X^T dV; Adam updates them. Every 50 steps both models are evaluated on the
// same 256 held-out sequences; the curves go to stdout and to a CSV (argument 1, default
// train_recall.csv), which scripts/plot_training.py draws into docs/img/train_recall.png.
// Honest limits: one layer, no MLP, no learned feature map (the random projection W is fixed),
// a toy task; the point is that the gradients train, not a benchmark of the maps.
//
// Run: ./build/examples/example_train_recall [out.csv]   (about 10 s in Release on 2 cores)

#include <linattn/gradients.hpp>
#include <linattn/random_features.hpp>

#include "recall_task.hpp"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using linattn::Mask;
using namespace recall;  // the task: its constants, Sequence, Parameter, Score

constexpr int kSteps = 4000;

template <class Phi>
class Model {
 public:
  Model(Phi phi, std::uint64_t seed) : attn_(std::move(phi)), gen_(seed) {}

  // Loss and recall accuracy over `batch`; with `train`, accumulates the gradients.
  Score run(const std::vector<Sequence>& batch, bool train) {
    Score score;
    const float weight = 1.0f / static_cast<float>(batch.size() * kPairs);
    for (const Sequence& s : batch) {
      const Matrix Q = s.X * q_.W, K = s.X * k_.W, V = s.X * v_.W;
      const Matrix Y = attn_.parallel(Q, K, V, Mask::causal);
      Matrix dY;
      recall::score_queries(Y, s, weight, score, dY);
      if (!train) continue;
      const auto g = linattn::parallel_backward(attn_, Q, K, V, Mask::causal, dY);
      q_.grad.noalias() += s.X.transpose() * g.Q;
      k_.grad.noalias() += s.X.transpose() * g.K;
      v_.grad.noalias() += s.X.transpose() * g.V;
    }
    return score;
  }

  void step(float lr, int t) {
    q_.adam(lr, t);
    k_.adam(lr, t);
    v_.adam(lr, t);
  }

 private:
  linattn::LinearAttention<Phi, float> attn_;
  std::mt19937_64 gen_;
  const float scale_ = 1.0f / std::sqrt(static_cast<float>(kInput));
  Parameter q_{kInput, kHead, gen_, scale_}, k_{kInput, kHead, gen_, scale_},
      v_{kInput, kValueDim, gen_, scale_};
};

}  // namespace

int main(int argc, char** argv) {
  const std::string csv_path = argc > 1 ? argv[1] : "train_recall.csv";
  std::mt19937_64 data_gen(2024), eval_gen(7);
  std::vector<Sequence> held_out;
  for (Index i = 0; i < kEvalSequences; ++i) held_out.push_back(make_sequence(eval_gen));

  // Same initial projections (same seed) for both maps; r = 16 features each.
  Model<linattn::EluPlusOne> elu(linattn::EluPlusOne{}, 11);
  Model<linattn::PositiveRandomFeatures<float>> favor(
      linattn::PositiveRandomFeatures<float>(kHead, kHead, 5), 11);

  std::FILE* csv = std::fopen(csv_path.c_str(), "w");
  if (csv == nullptr) {
    std::perror(csv_path.c_str());
    return 1;
  }
  std::fprintf(csv, "step,elu_loss,elu_accuracy,rf_loss,rf_accuracy\n");
  std::printf("associative recall, %ld pairs, r = %ld; held-out loss (predicting 0: ~1.0) and "
              "accuracy (chance: %.3f)\n", static_cast<long>(kPairs), static_cast<long>(kHead),
              1.0 / static_cast<double>(kPairs));
  std::printf("%6s  %10s %9s  %10s %9s\n", "step", "ELU+1 loss", "accuracy", "RF loss",
              "accuracy");
  const float lr = 1e-2f;
  for (int t = 0; t <= kSteps; ++t) {
    if (t % kEvalEvery == 0) {
      const Score a = elu.run(held_out, false), b = favor.run(held_out, false);
      std::printf("%6d  %10.4f %9.3f  %10.4f %9.3f\n", t, a.loss, a.accuracy, b.loss, b.accuracy);
      std::fprintf(csv, "%d,%.6f,%.4f,%.6f,%.4f\n", t, a.loss, a.accuracy, b.loss, b.accuracy);
    }
    if (t == kSteps) break;
    std::vector<Sequence> batch;
    for (Index i = 0; i < kBatch; ++i) batch.push_back(make_sequence(data_gen));
    static_cast<void>(elu.run(batch, true));
    static_cast<void>(favor.run(batch, true));
    elu.step(lr, t + 1);
    favor.step(lr, t + 1);
  }
  std::fclose(csv);
  std::printf("wrote %s\n", csv_path.c_str());
}
