// Must NOT compile: query heads share one state only with an ordinary feature map; a
// log-scaled (random-feature) state rescales S per token, so each query head keeps its own
// state. ctest checks that the error carries our readable message.
#include <linattn/attention.hpp>
#include <linattn/random_features.hpp>

#include <vector>

int main() {
  using Map = linattn::PositiveRandomFeatures<float>;
  using Matrix = linattn::RowMatrix<float>;
  const linattn::LinearAttention<Map> attn(Map(4, 8, 1));
  auto state = attn.make_state(4, 4);
  const Matrix Q = Matrix::Ones(2, 4), K = Q, V = Q;
  Matrix out(2, 4);
  const std::vector<linattn::ConstRowsView<float>> queries{
      linattn::ConstRowsView<float>(Q.data(), 2, 4, Eigen::OuterStride<>(4))};
  const std::vector<linattn::RowsView<float>> outputs{
      linattn::RowsView<float>(out.data(), 2, 4, Eigen::OuterStride<>(4))};
  attn.prefill_into(state, queries, K, V, outputs);
}
