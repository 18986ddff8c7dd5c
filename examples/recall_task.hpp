#pragma once
// The associative-recall task and the Adam step shared by examples/train_recall.cpp and
// examples/train_recall_rules.cpp (see the first for the task's description).

#include <linattn/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace recall {

using linattn::Index;
using Matrix = linattn::RowMatrix<float>;

constexpr Index kPairs = 8;                        // N key/value pairs per sequence
constexpr Index kKeyDim = 16, kValueDim = 8;       // key and value sizes in the input
constexpr Index kInput = kKeyDim + kValueDim + 1;  // [key, value, is_query]
constexpr Index kHead = 16;                        // dk of the layers (r of every map)
constexpr Index kBatch = 32;
constexpr int kEvalEvery = 50;
constexpr Index kEvalSequences = 256;

struct Sequence {
  Matrix X;                  // 2N x kInput
  Matrix values;             // N x kValueDim, the pairs' values in order
  std::vector<Index> asked;  // the pair each query asks for
};

// N fresh pairs (keys random unit vectors, values N(0, 1 / kValueDim)), then the N keys again
// in a random order.
inline Sequence make_sequence(std::mt19937_64& gen) {
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

// A weight matrix with its Adam moments, drawn N(0, scale^2) (zero for scale 0).
struct Parameter {
  Matrix W, grad, m, v;
  Parameter(Index rows, Index cols, std::mt19937_64& gen, float scale)
      : W(Matrix::Zero(rows, cols)), grad(Matrix::Zero(rows, cols)), m(Matrix::Zero(rows, cols)),
        v(Matrix::Zero(rows, cols)) {
    if (scale == 0) return;
    std::normal_distribution<float> normal(0.0f, scale);
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

// Adds sequence s's share (`weight` per query) of the loss, mean |y - v|^2 over the queries,
// and of the recall accuracy (is y nearest the right value among the sequence's?) to `score`,
// and writes the loss's gradient into the query rows of dY (zero elsewhere).
inline void score_queries(const Matrix& Y, const Sequence& s, float weight, Score& score,
                          Matrix& dY) {
  dY = Matrix::Zero(Y.rows(), Y.cols());
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
}

}  // namespace recall
