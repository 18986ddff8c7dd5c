// Must NOT compile: a run-time Mask could say none, and the delta rule has no full
// (non-causal) form; only the constant Mask::causal is accepted. ctest checks our readable
// message.
#include <linattn/attention.hpp>

int main() {
  using Matrix = linattn::RowMatrix<float>;
  const linattn::RuleAttention<linattn::L2Normalize, linattn::Delta> attn;
  const Matrix Q = Matrix::Ones(2, 4), K = Q, V = Q;
  const linattn::ColVector<float> beta = linattn::ColVector<float>::Constant(2, 0.5f);
  const linattn::Mask mask = linattn::Mask::causal;
  const Matrix out = attn.parallel(Q, K, V, beta, mask);
  return static_cast<int>(out.rows());
}
