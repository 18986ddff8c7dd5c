// Checks that a consumer gets headers, Eigen and C++20 from linattn::linattn alone.
#include <linattn/linattn.hpp>

#include <cmath>

int main() {
  Eigen::MatrixXf K(2, 2), V(2, 1), Q(1, 2);
  K << 1, 0, 1, 1;
  V << 2, 4;
  Q << 1, 1;
  const linattn::LinearAttention<linattn::Identity> attn;
  const auto y = attn.parallel(Q, K, V, linattn::Mask::none);
  return std::abs(y(0, 0) - 10.0f / 3.0f) < 1e-5f ? 0 : 1;
}
