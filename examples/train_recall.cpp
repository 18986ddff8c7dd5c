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

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using linattn::Index;
using linattn::Mask;
using Matrix = linattn::RowMatrix<float>;

constexpr Index kPairs = 8;                        // N key/value pairs per sequence
constexpr Index kKeyDim = 16, kValueDim = 8;       // key and value sizes in the input
constexpr Index kInput = kKeyDim + kValueDim + 1;  // [key, value, is_query]
constexpr Index kHead = 16;                        // dk of the layer (and r of both maps)
constexpr Index kBatch = 32;
constexpr int kSteps = 4000;
constexpr int kEvalEvery = 50;
constexpr Index kEvalSequences = 256;

struct Sequence {
  Matrix X;       // 2N x kInput
  Matrix values;  // N x kValueDim, the pairs' values in order
  std::vector<Index> asked;  // the pair each query asks for
};

Sequence make_sequence(std::mt19937_64& gen) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Sequence s{Matrix::Zero(2 * kPairs, kInput), Matrix(kPairs, kValueDim), {}};
  Matrix keys(kPairs, kKeyDim);
  for (Index i = 0; i < keys.size(); ++i) keys.data()[i] = normal(gen);
  keys.rowwise().normalize();
  for (Index i = 0; i < s.values.size(); ++i)
    s.values.data()[i] = normal(gen) / std::sqrt(static_cast<float>(kValueDim));
  for (Index i = 0; i < kPairs; ++i) s.asked.push_back(i);
  std::shuffle(s.asked.begin(), s.asked.end(), gen);
  for (Index i = 0; i < kPairs; ++i) {
    s.X.row(i).head(kKeyDim) = keys.row(i);
    s.X.row(i).segment(kKeyDim, kValueDim) = s.values.row(i);
    const Index q = kPairs + i;
    s.X.row(q).head(kKeyDim) = keys.row(s.asked[static_cast<std::size_t>(i)]);
    s.X(q, kInput - 1) = 1.0f;
  }
  return s;
}

// One projection matrix with its Adam moments.
struct Parameter {
  Matrix W, grad, m, v;
  Parameter(Index rows, Index cols, std::mt19937_64& gen)
      : W(rows, cols), grad(Matrix::Zero(rows, cols)), m(Matrix::Zero(rows, cols)),
        v(Matrix::Zero(rows, cols)) {
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(rows)));
    for (Index i = 0; i < W.size(); ++i) W.data()[i] = normal(gen);
  }
  // Adam (Kingma and Ba 2015) with bias correction; step t counts from 1.
  void adam(float lr, int t) {
    constexpr float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
    m = beta1 * m + (1 - beta1) * grad;
    v = beta2 * v + (1 - beta2) * grad.cwiseAbs2();
    const float c1 = 1 - std::pow(beta1, static_cast<float>(t));
    const float c2 = 1 - std::pow(beta2, static_cast<float>(t));
    W.array() -= lr * (m.array() / c1) / ((v.array() / c2).sqrt() + eps);
    grad.setZero();
  }
};

struct Score {
  double loss = 0, accuracy = 0;
};

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
      Matrix dY = Matrix::Zero(Y.rows(), Y.cols());
      for (Index i = 0; i < kPairs; ++i) {
        const auto y = Y.row(kPairs + i);
        const auto target = s.values.row(s.asked[static_cast<std::size_t>(i)]);
        score.loss += weight * (y - target).squaredNorm();
        dY.row(kPairs + i) = 2 * weight * (y - target);
        Index nearest = 0;
        for (Index j = 1; j < kPairs; ++j)
          if ((y - s.values.row(j)).squaredNorm() < (y - s.values.row(nearest)).squaredNorm())
            nearest = j;
        score.accuracy += nearest == s.asked[static_cast<std::size_t>(i)] ? weight : 0.0;
      }
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
  Parameter q_{kInput, kHead, gen_}, k_{kInput, kHead, gen_}, v_{kInput, kValueDim, gen_};
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
