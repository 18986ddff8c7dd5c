// The README's usage snippets, compiled and run so the README stays true.

#include <linattn/linattn.hpp>

#include <iostream>

int main() {
  using namespace linattn;
  const Index T = 128, dk = 16, dv = 8;
  Eigen::MatrixXf Q = Eigen::MatrixXf::Random(T, dk), K = Eigen::MatrixXf::Random(T, dk),
                  V = Eigen::MatrixXf::Random(T, dv);

  LinearAttention<EluPlusOne> attn;
  RowMatrix<float> full = attn.parallel(Q, K, V, Mask::none);
  RowMatrix<float> causal = attn.parallel(Q, K, V, Mask::causal);
  RowMatrix<float> same = attn.recurrent(Q, K, V);

  auto state = attn.make_state(Q.cols(), V.cols());
  auto prefix = attn.prefill(state, Q.topRows(100), K.topRows(100), V.topRows(100));
  Eigen::VectorXf q = Q.row(100).transpose(), k = K.row(100).transpose(),
                  v = V.row(100).transpose();
  RowVector<float> y = attn.step(state, q, k, v);

  // Grouped-query heads: G query heads read one state per key/value head. The heads lie side
  // by side in [T, G*d] buffers, as a model stores them, and are read and written in place.
  const Index G = 2;
  RowMatrix<float> Qs(T, G * dk), outs(T, G * dv);
  Qs << Q, 0.5f * Q;
  auto kv_state = attn.make_state(dk, dv);
  attn.prefill_into(kv_state, TensorView<const float>::batch_first(Qs.data(), 1, T, G, dk), K, V,
                    TensorView<float>::batch_first(outs.data(), 1, T, G, dv));  // K absorbed once
  const RowMatrix<float> qs = Qs.row(T - 1);  // one decode token's G queries, [1, G*dk]
  RowMatrix<float> ys(1, G * dv);
  attn.step_into(kv_state, TensorView<const float>::batch_first(qs.data(), 1, 1, G, dk), k, v,
                 TensorView<float>::batch_first(ys.data(), 1, 1, G, dv));  // absorbed once

  LinearAttention<Identity> raw(Identity{}, Options{Normalization::unnormalized()});
  const RowMatrix<float> raw_out = raw.parallel(Q, K, V, Mask::causal);

  PositiveRandomFeatures<double> favor(/*d=*/dk, /*m=*/256, /*seed=*/42);
  LinearAttention<PositiveRandomFeatures<double>, double> performer(favor);
  const RowMatrix<double> approx = performer.parallel(Q.cast<double>(), K.cast<double>(),
                                                      V.cast<double>(), Mask::causal);

  RuleAttention<L2Normalize, Delta, float> delta;
  const Eigen::VectorXf beta = Eigen::VectorXf::Constant(T, 0.5f);
  auto y_delta = delta.parallel(Q, K, V, beta, Mask::causal);

  std::cout << "full " << full.rows() << "x" << full.cols() << ", prefix then step agrees with "
            << "the causal row to " << (y - causal.row(100)).cwiseAbs().maxCoeff()
            << "; recurrent vs parallel " << (same - causal).cwiseAbs().maxCoeff()
            << "; prefix rows " << prefix.rows() << "; grouped heads "
            << (outs.leftCols(dv) - causal).cwiseAbs().maxCoeff() << "; unnormalized "
            << raw_out.rows() << "; performer " << approx.rows() << "; delta " << y_delta.rows()
            << "\n";
}
