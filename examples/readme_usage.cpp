// The README's usage snippets, compiled and run so the README stays true.

#include <linattn/linattn.hpp>

#include <iostream>
#include <vector>

int main() {
  using namespace linattn;
  const Index T = 128, dk = 16, dv = 8;
  Eigen::MatrixXf Q = Eigen::MatrixXf::Random(T, dk), K = Eigen::MatrixXf::Random(T, dk),
                  V = Eigen::MatrixXf::Random(T, dv);

  LinearAttention<EluPlusOne> attn;
  RowMatrix<float> full = attn.parallel(Q, K, V);
  RowMatrix<float> causal = attn.parallel(Q, K, V, Mask::causal);
  RowMatrix<float> same = attn.recurrent(Q, K, V);

  auto state = attn.make_state(Q.cols(), V.cols());
  auto prefix = attn.parallel(Q.topRows(100), K.topRows(100), V.topRows(100), Mask::causal, state);
  Eigen::VectorXf q = Q.row(100).transpose(), k = K.row(100).transpose(),
                  v = V.row(100).transpose();
  RowVector<float> y = attn.step(state, q, k, v);

  // Grouped-query heads: G query heads read one state per key/value head.
  const Index G = 2;
  const std::vector<RowMatrix<float>> Qs{Q, 0.5f * Q};
  std::vector<RowMatrix<float>> outs(G, RowMatrix<float>(T, dv));
  auto kv_state = attn.make_state(dk, dv);
  attn.parallel_group_into(G, [&](Index g) -> const auto& { return Qs[g]; }, K, V, kv_state,
                           [&](Index g) -> auto& { return outs[g]; });  // prefill, K absorbed once
  const RowMatrix<float> qs = Q.topRows(G);
  RowMatrix<float> ys(G, dv);
  attn.step_group_into(kv_state, G, [&](Index g) { return qs.row(g); }, k, v,
                       [&](Index g) { return ys.row(g); });  // decode, absorbed once

  LinearAttention<Identity> raw(Identity{}, Options{Normalization::unnormalized()});
  const RowMatrix<float> raw_out = raw.parallel(Q, K, V, Mask::causal);

  PositiveRandomFeatures<double> favor(/*d=*/dk, /*m=*/256, /*seed=*/42);
  LinearAttention<PositiveRandomFeatures<double>, double> performer(favor);
  const RowMatrix<double> approx = performer.parallel(Q.cast<double>(), K.cast<double>(),
                                                      V.cast<double>(), Mask::causal);

  RuleAttention<L2Normalize, Delta, float> delta;
  const Eigen::VectorXf beta = Eigen::VectorXf::Constant(T, 0.5f);
  auto y_delta = delta.parallel(Q, K, V, beta);

  std::cout << "full " << full.rows() << "x" << full.cols() << ", prefix then step agrees with "
            << "the causal row to " << (y - causal.row(100)).cwiseAbs().maxCoeff()
            << "; recurrent vs parallel " << (same - causal).cwiseAbs().maxCoeff()
            << "; prefix rows " << prefix.rows() << "; grouped heads "
            << (outs[0] - causal).cwiseAbs().maxCoeff() << "; unnormalized " << raw_out.rows()
            << "; performer " << approx.rows() << "; delta " << y_delta.rows() << "\n";
}
