// Must NOT compile: query heads share one state only with an ordinary feature map; a
// log-scaled (random-feature) state rescales S per token, so each query head keeps its own
// state. ctest checks that the error carries our readable message.
#include <linattn/attention.hpp>
#include <linattn/random_features.hpp>

int main() {
  using Map = linattn::PositiveRandomFeatures<float>;
  using Matrix = linattn::RowMatrix<float>;
  const linattn::LinearAttention<Map> attn(Map(4, 8, 1));
  auto state = attn.make_state(4, 4);
  const Matrix Q = Matrix::Ones(2, 4), K = Q, V = Q;
  Matrix out(2, 4);
  attn.parallel_group_into(
      1, [&](linattn::Index) -> const Matrix& { return Q; }, K, V, state,
      [&](linattn::Index) -> Matrix& { return out; });
}
