// Must NOT compile: a decaying state weighs keys by their distance in token order, so the rule
// has no full (non-causal) read; Mask::none is rejected at compile time (the old trap: a
// RuleAttention call without a mask used to mean causal). ctest checks our readable message.
#include <linattn/attention.hpp>

int main() {
  using Matrix = linattn::RowMatrix<float>;
  const linattn::RuleAttention<linattn::EluPlusOne, linattn::Decay> attn(linattn::EluPlusOne{},
                                                                         linattn::Decay(0.9));
  const Matrix Q = Matrix::Ones(2, 4), K = Q, V = Q;
  const Matrix out = attn.parallel(Q, K, V, linattn::Mask::none);
  return static_cast<int>(out.rows());
}
