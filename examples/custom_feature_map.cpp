// Writing your own feature map: ten lines, checked by the FeatureMap concept at compile time.

#include <linattn/linattn.hpp>

#include <iostream>

// phi(x) = [relu(x), 1]: non-negative features plus a constant one, so every score is >= 1 and
// the weighted average is always defined. r = d + 1.
struct ReluPlusBias {
  static constexpr bool strictly_positive = false;  // relu features can be 0
  linattn::Index feature_dim(linattn::Index d) const { return d + 1; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    out.leftCols(x.cols()) = x.cwiseMax(0);
    out.col(x.cols()).setOnes();
  }
};
static_assert(linattn::FeatureMap<ReluPlusBias>, "ReluPlusBias must satisfy FeatureMap");

int main() {
  const linattn::Index T = 6, d = 4, dv = 2;
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Random(T, d);
  const Eigen::MatrixXf K = Eigen::MatrixXf::Random(T, d);
  const Eigen::MatrixXf V = Eigen::MatrixXf::Random(T, dv);

  const linattn::LinearAttention<ReluPlusBias> attn;
  const auto parallel = attn.parallel(Q, K, V, linattn::Mask::causal);
  const auto recurrent = attn.recurrent(Q, K, V);
  std::cout << "feature dim r = " << attn.feature_dim(d) << "\n"
            << "causal output (parallel):\n" << parallel << "\n"
            << "max |parallel - recurrent| = " << (parallel - recurrent).cwiseAbs().maxCoeff()
            << "\n";
}
