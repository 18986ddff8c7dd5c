// The README's usage snippets, compiled and run so the README stays true.

#include <linattn/linattn.hpp>

#include <iostream>

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
            << "; prefix rows " << prefix.rows() << "; unnormalized " << raw_out.rows()
            << "; performer " << approx.rows() << "; delta " << y_delta.rows() << "\n";
}
