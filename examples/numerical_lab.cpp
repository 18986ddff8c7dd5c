// The numerical lab: the articles' examples step by step, printing every write (S, z) and every
// read (numerator, denominator, output), then checking the parallel path against the recurrent one.

#include <linattn/linattn.hpp>

#include <iostream>

namespace {

using Matrix = Eigen::MatrixXd;
using linattn::Identity;
using linattn::LinearAttention;
using linattn::Mask;

const Eigen::IOFormat kRow(Eigen::StreamPrecision, Eigen::DontAlignCols, ", ", "; ", "", "", "[",
                           "]");

void run(const char* title, const Matrix& Q, const Matrix& K, const Matrix& V) {
  std::cout << "== " << title << " ==\n";
  const LinearAttention<Identity, double> attn;  // the examples give features directly
  auto state = attn.make_state(K.cols(), V.cols());
  for (Eigen::Index t = 0; t < Q.rows(); ++t) {
    const auto y = attn.step(state, Q.row(t), K.row(t), V.row(t));
    // The read, spelled out: numerator q^T S and denominator q^T z after the write.
    const Eigen::RowVectorXd numerator = Q.row(t) * state.S();
    const double denominator = Q.row(t).dot(state.z());
    std::cout << "token " << t << ": write k=" << K.row(t).format(kRow)
              << " v=" << V.row(t).format(kRow) << "\n"
              << "  S" << t + 1 << " = " << state.S().format(kRow)
              << "   z" << t + 1 << " = " << state.z().transpose().format(kRow) << "\n"
              << "  read q=" << Q.row(t).format(kRow) << ": numerator " << numerator.format(kRow)
              << " / denominator " << denominator << " = y" << t << " " << y.format(kRow) << "\n";
  }
  const auto parallel = attn.parallel(Q, K, V, Mask::causal);
  const auto recurrent = attn.recurrent(Q, K, V);
  std::cout << "causal parallel  = " << parallel.format(kRow) << "\n"
            << "recurrent        = " << recurrent.format(kRow) << "\n"
            << "full (non-causal) = " << attn.parallel(Q, K, V, Mask::none).format(kRow) << "\n"
            << "max |parallel - recurrent| = " << (parallel - recurrent).cwiseAbs().maxCoeff()
            << "\n\n";
}

}  // namespace

int main() {
  {
    // First article: keys (1,0), (1,1); scalar values 2, 4; query (1,1). Read: 10/3.
    Matrix Q(2, 2), K(2, 2), V(2, 1);
    Q << 1, 1, 1, 1;
    K << 1, 0, 1, 1;
    V << 2, 4;
    run("two-token read (first article)", Q, K, V);
    const auto soft = linattn::softmax_attention(Q.row(1), K, V, Mask::none, 1.0);
    std::cout << "softmax on the same scores (1, 2) gives " << soft(0, 0)
              << ", not 10/3: exactness holds for the kernel phi(q)^T phi(k) only.\n\n";
  }
  {
    // Second article: queries = keys = [1,0],[0,1],[1,0]; values [2,0],[0,3],[1,1].
    Matrix Q(3, 2), V(3, 2);
    Q << 1, 0, 0, 1, 1, 0;
    V << 2, 0, 0, 3, 1, 1;
    run("three tokens (second article): y2 = [1.5, 0.5], S3 = [3,1; 0,3], z3 = [2, 1]", Q, Q, V);
  }
}
