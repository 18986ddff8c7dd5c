// Must not compile: gradients need a DifferentiableFeatureMap, and a map without backward()
// is rejected with a readable static_assert (registered in tests/CMakeLists.txt,
// expecting "the feature map has no derivative").

#include <linattn/gradients.hpp>

namespace {
struct NoDerivative {
  static constexpr bool strictly_positive = true;
  linattn::Index feature_dim(linattn::Index d) const { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const { out = x; }
};
}  // namespace

int main() {
  const linattn::LinearAttention<NoDerivative> attn;
  const linattn::RowMatrix<float> X = linattn::RowMatrix<float>::Zero(2, 2);
  static_cast<void>(linattn::parallel_backward(attn, X, X, X, linattn::Mask::none, X));
}
