// Training the write rules with linattn's gradients: the associative-recall task of
// examples/train_recall.cpp learned by three single-head layers side by side, Additive (ELU + 1),
// Gated (ELU + 1, a learned gate per token) and Delta (unit-norm features, a learned beta per
// token), each with its projections learned by Adam written out here (no framework).
//
// The task (as in train_recall.cpp): each sequence holds N = 8 fresh key/value pairs followed
// by the N keys again in a random order; token t is x_t = [key, value, 0] for a pair and
// [key, 0, 1] for a query (keys random unit vectors in R^16, values N(0, 1/8) in R^8). At each
// query the target is the value written under that key: loss = mean over queries of |y_t - v|^2
// (predicting 0 scores about 1.0); recall accuracy: is y nearest to the right value among the 8.
//
// The layers. All three project Q = X Wq, K = X Wk, V = X Wv (r = 16).
//   Additive:  y = attn.parallel(Q, K, V, Mask::causal), ELU + 1, strict normalization.
//   Gated:     log_g_t = log sigmoid(x_t . wg + bg) (one gate per token, learned wg, bg),
//              y = attn.parallel(Q, K, V, log_g, Mask::causal), ELU + 1, strict.
//   Delta:     beta_t = sigmoid(x_t . wb + bb) (learned), y = attn.parallel(Q, K, V, beta,
//              Mask::causal), L2Normalize features, unnormalized read.
// Gradients: parallel_backward() (gradients.hpp, rule_gradients.hpp) gives dQ, dK, dV and the
// per-token inputs' gradients; the projections get X^T dQ etc., the gate and beta weights
// X^T (d log_g .* (1 - g)) and X^T (d beta .* beta (1 - beta)) by the chain rule through
// log sigmoid and sigmoid. Every 50 steps all three are evaluated on the same 256 held-out
// sequences; curves to stdout and to a CSV (argument 1, default train_recall_rules.csv), which
// scripts/plot_training.py draws into docs/img/train_recall_rules.png.
//
// Run: ./build/examples/example_train_recall_rules [out.csv]   (about 30 s in Release)

#include <linattn/gradients.hpp>
#include <linattn/rule_gradients.hpp>

#include "recall_task.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using linattn::Mask;
using namespace recall;  // the task: its constants, Sequence, Parameter, Score
using Vector = linattn::ColVector<float>;

constexpr int kSteps = 3000;

enum class Kind { additive, gated, delta };

float sigmoid(float a) { return 1.0f / (1.0f + std::exp(-a)); }

class Model {
 public:
  Model(Kind kind, std::uint64_t seed) : kind_(kind), gen_(seed) {
    // Gate and beta start near sigmoid(2) = 0.88 (mostly keep / mostly write).
    gate_.W.setZero();
    gate_.W(kInput, 0) = 2.0f;
  }

  Score run(const std::vector<Sequence>& batch, bool train) {
    Score score;
    const float weight = 1.0f / static_cast<float>(batch.size() * kPairs);
    Matrix Xb(2 * kPairs, kInput + 1);
    for (const Sequence& s : batch) {
      Xb << s.X, Matrix::Ones(2 * kPairs, 1);  // a bias column for the gate / beta
      const Matrix Q = s.X * q_.W, K = s.X * k_.W, V = s.X * v_.W;
      const Vector pre = Xb * gate_.W;
      Vector token(pre.size());  // log-gate (Gated) or beta (Delta) per token
      Matrix Y;
      switch (kind_) {
        case Kind::additive: Y = additive_.parallel(Q, K, V, Mask::causal); break;
        case Kind::gated:
          for (Index t = 0; t < pre.size(); ++t)
            token(t) = std::min(0.0f, std::log(sigmoid(pre(t))));
          Y = gated_.parallel(Q, K, V, token, Mask::causal);
          break;
        case Kind::delta:
          for (Index t = 0; t < pre.size(); ++t) token(t) = sigmoid(pre(t));
          Y = delta_.parallel(Q, K, V, token, Mask::causal);
          break;
      }
      Matrix dY;
      recall::score_queries(Y, s, weight, score, dY);
      if (!train) continue;
      Matrix dQ, dK, dV;
      Vector d_pre = Vector::Zero(pre.size());
      if (kind_ == Kind::additive) {
        auto g = linattn::parallel_backward(additive_, Q, K, V, Mask::causal, dY);
        dQ.swap(g.Q), dK.swap(g.K), dV.swap(g.V);
      } else if (kind_ == Kind::gated) {
        auto g = linattn::parallel_backward(gated_, Q, K, V, token, Mask::causal, dY);
        dQ.swap(g.Q), dK.swap(g.K), dV.swap(g.V);
        // d/da log sigmoid(a) = 1 - sigmoid(a)
        for (Index t = 0; t < pre.size(); ++t)
          d_pre(t) = g.inputs.log_gate(t, 0) * (1.0f - sigmoid(pre(t)));
      } else {
        auto g = linattn::parallel_backward(delta_, Q, K, V, token, Mask::causal, dY);
        dQ.swap(g.Q), dK.swap(g.K), dV.swap(g.V);
        for (Index t = 0; t < pre.size(); ++t)
          d_pre(t) = g.inputs.beta(t) * token(t) * (1.0f - token(t));
      }
      q_.grad.noalias() += s.X.transpose() * dQ;
      k_.grad.noalias() += s.X.transpose() * dK;
      v_.grad.noalias() += s.X.transpose() * dV;
      gate_.grad.noalias() += Xb.transpose() * d_pre;
    }
    return score;
  }

  void step(float lr, int t) {
    q_.adam(lr, t);
    k_.adam(lr, t);
    v_.adam(lr, t);
    if (kind_ != Kind::additive) gate_.adam(lr, t);
  }

 private:
  Kind kind_;
  std::mt19937_64 gen_;
  linattn::LinearAttention<linattn::EluPlusOne, float> additive_;
  linattn::RuleAttention<linattn::EluPlusOne, linattn::Gated, float> gated_;
  linattn::RuleAttention<linattn::L2Normalize, linattn::Delta, float> delta_;
  const float scale_ = 1.0f / std::sqrt(static_cast<float>(kInput));
  Parameter q_{kInput, kHead, gen_, scale_}, k_{kInput, kHead, gen_, scale_},
      v_{kInput, kValueDim, gen_, scale_}, gate_{kInput + 1, 1, gen_, 0.0f};
};

}  // namespace

int main(int argc, char** argv) {
  const std::string csv_path = argc > 1 ? argv[1] : "train_recall_rules.csv";
  std::mt19937_64 data_gen(2024), eval_gen(7);
  std::vector<Sequence> held_out;
  for (Index i = 0; i < kEvalSequences; ++i) held_out.push_back(make_sequence(eval_gen));
  // Same initial projections (same seed) for the three layers.
  Model models[] = {Model(Kind::additive, 11), Model(Kind::gated, 11), Model(Kind::delta, 11)};
  const char* names[] = {"additive", "gated", "delta"};

  std::FILE* csv = std::fopen(csv_path.c_str(), "w");
  if (csv == nullptr) {
    std::perror(csv_path.c_str());
    return 1;
  }
  std::fprintf(csv, "step");
  for (const char* n : names) std::fprintf(csv, ",%s_loss,%s_accuracy", n, n);
  std::fprintf(csv, "\n");
  std::printf("associative recall, %ld pairs, r = %ld; held-out loss (predicting 0: ~1.0) and "
              "accuracy (chance: %.3f)\n%6s", static_cast<long>(kPairs), static_cast<long>(kHead),
              1.0 / static_cast<double>(kPairs), "step");
  for (const char* n : names) std::printf("  %9s loss  accuracy", n);
  std::printf("\n");
  const float lr = 1e-2f;
  for (int t = 0; t <= kSteps; ++t) {
    if (t % kEvalEvery == 0) {
      std::printf("%6d", t);
      std::fprintf(csv, "%d", t);
      for (Model& m : models) {
        const Score s = m.run(held_out, false);
        std::printf("  %14.4f %9.3f", s.loss, s.accuracy);
        std::fprintf(csv, ",%.6f,%.4f", s.loss, s.accuracy);
      }
      std::printf("\n");
      std::fprintf(csv, "\n");
    }
    if (t == kSteps) break;
    std::vector<Sequence> batch;
    for (Index i = 0; i < kBatch; ++i) batch.push_back(make_sequence(data_gen));
    for (Model& m : models) {
      static_cast<void>(m.run(batch, true));
      m.step(lr, t + 1);
    }
  }
  std::fclose(csv);
  std::printf("wrote %s\n", csv_path.c_str());
}
