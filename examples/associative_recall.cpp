// Associative recall with overwrites: the articles' "overwriting associations" diagnostic.
//
// Write N key/value pairs, then write the first half of the keys again with new values, then
// read every key: the right answer is the newest value under that key. Keys have unit norm:
// orthonormal (rows of a random orthogonal matrix, only while N <= d) or random unit vectors.
// The read is the unnormalized y = S^T phi(k) for every rule, taken from the final state.
//
// Expected: with orthonormal keys the delta rule with beta = 1 returns the newest value to
// rounding, while the additive rule returns old + new for the rewritten keys. Once N exceeds
// the key dimension d, no fixed d x dv state can hold N independent associations and every
// rule's error grows. Prints the relative recall error |y - v_newest| / |v_newest|, averaged
// over rewritten keys and over kept keys, per rule and N.
//
// Run: ./build/examples/example_associative_recall   (the table in docs/write_rules.md)

#include <linattn/linattn.hpp>

#include <Eigen/QR>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using linattn::ColVector;
using linattn::Index;
using linattn::RowMatrix;
using Matrix = RowMatrix<float>;

constexpr Index d = 64;   // key dimension
constexpr Index dv = 32;  // value dimension

Matrix gaussian(Index rows, Index cols, std::mt19937_64& gen) {
  std::normal_distribution<double> normal(0.0, 1.0);
  Matrix m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<float>(normal(gen));
  return m;
}

// N unit keys: orthonormal rows (needs N <= d) or independent random directions.
Matrix make_keys(Index N, bool orthonormal, std::mt19937_64& gen) {
  if (orthonormal) {
    const Eigen::MatrixXd g = gaussian(d, d, gen).cast<double>();
    const Eigen::MatrixXd q = Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ();
    return q.transpose().topRows(N).cast<float>();
  }
  Matrix k = gaussian(N, d, gen);
  k.rowwise().normalize();
  return k;
}

struct Recall {
  double rewritten = 0, kept = 0;  // mean relative error over each group of keys
  double path_gap = 0;             // max |parallel - recurrent| over the sequence's outputs
};

// Writes the sequence with `attn` (the chunked parallel pass through prefill, and the
// recurrent pass, which must agree), then reads.
template <class Attn, class... In>
Recall run(const Attn& attn, const Matrix& keys, const Matrix& seq_k, const Matrix& seq_v,
           const Matrix& newest, Index rewritten, const In&... inputs) {
  auto state = attn.make_state(d, dv);
  const Matrix y_par = attn.prefill(state, seq_k, seq_k, seq_v, inputs...);
  const Matrix y_rec = attn.recurrent(seq_k, seq_k, seq_v, inputs...);
  Recall r;
  r.path_gap = (y_par - y_rec).cwiseAbs().maxCoeff();
  const Matrix read = keys * state.S();  // y_i = S^T k_i for every key (phi(k) = k here)
  for (Index i = 0; i < keys.rows(); ++i) {
    const double err = (read.row(i) - newest.row(i)).norm() / newest.row(i).norm();
    (i < rewritten ? r.rewritten : r.kept) += err;
  }
  r.rewritten /= static_cast<double>(rewritten);
  r.kept /= static_cast<double>(keys.rows() - rewritten);
  return r;
}

}  // namespace

int main() {
  using namespace linattn;
  const Options raw{Normalization::unnormalized(), 64};
  const RuleAttention<L2Normalize, Additive> additive(L2Normalize{}, Additive{}, raw);
  const RuleAttention<L2Normalize, Decay> decay(L2Normalize{}, Decay(0.99), raw);
  const RuleAttention<L2Normalize, Delta> delta(L2Normalize{}, Delta{}, raw);
  const RuleAttention<L2Normalize, GatedDelta> gated_delta(L2Normalize{}, GatedDelta{}, raw);

  std::printf("Associative recall with overwrites: d = %lld, dv = %lld, float, seed 2026.\n",
              static_cast<long long>(d), static_cast<long long>(dv));
  std::printf("Mean relative recall error |y - v_newest| / |v_newest|; "
              "rewritten keys / kept keys.\n\n");
  std::printf("| N | keys | additive | decay 0.99 | delta beta=1 | delta beta=0.5 | "
              "gated delta beta=1, alpha=0.99 |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  double worst_gap = 0;
  for (Index N : {8, 16, 32, 64, 128, 256}) {
    for (bool orthonormal : {true, false}) {
      if (orthonormal && N > d) continue;  // at most d orthonormal keys exist
      std::mt19937_64 gen(2026 + static_cast<unsigned>(N));
      const Index half = N / 2;
      const Matrix keys = make_keys(N, orthonormal, gen);
      const Matrix v_old = gaussian(N, dv, gen), v_new = gaussian(half, dv, gen);
      // Sequence: all N pairs, then the first half of the keys with new values.
      Matrix seq_k(N + half, d), seq_v(N + half, dv);
      seq_k << keys, keys.topRows(half);
      seq_v << v_old, v_new;
      Matrix newest = v_old;
      newest.topRows(half) = v_new;
      const Index T = N + half;
      const ColVector<float> ones = ColVector<float>::Ones(T);
      const ColVector<float> halves = ColVector<float>::Constant(T, 0.5f);
      const ColVector<float> log_alpha = ColVector<float>::Constant(T, std::log(0.99f));

      const Recall results[] = {
          run(additive, keys, seq_k, seq_v, newest, half),
          run(decay, keys, seq_k, seq_v, newest, half),
          run(delta, keys, seq_k, seq_v, newest, half, ones),
          run(delta, keys, seq_k, seq_v, newest, half, halves),
          run(gated_delta, keys, seq_k, seq_v, newest, half, ones, log_alpha),
      };
      std::printf("| %lld | %s |", static_cast<long long>(N),
                  orthonormal ? "orthonormal" : "random");
      for (const Recall& r : results) {
        std::printf(" %.1e / %.1e |", r.rewritten, r.kept);
        worst_gap = std::max(worst_gap, r.path_gap);
      }
      std::printf("\n");
    }
  }
  std::printf("\nLargest |parallel - recurrent| over all runs: %.1e\n", worst_gap);
}
