// Checks that linattn::threads brings the thread pool: two threads over two heads give the
// bits of one thread.
#include <linattn/linattn.hpp>
#include <linattn/thread_pool.hpp>

#include <vector>

int main() {
  using Attention = linattn::LinearAttention<linattn::EluPlusOne>;
  const linattn::Index T = 64, H = 2, d = 32;
  linattn::MultiHeadAttention<Attention> layer(linattn::HeadConfig{H, H, d, d});
  std::vector<float> x(static_cast<std::size_t>(T * H * d));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) * 0.1f - 0.3f;
  std::vector<float> one(x.size()), two(x.size());
  using View = linattn::TensorView<const float>;
  const auto in = View::batch_first(x.data(), 1, T, H, d);
  layer.parallel_into(in, in, in, linattn::Mask::causal,
                      linattn::TensorView<float>::batch_first(one.data(), 1, T, H, d));
  linattn::ThreadPool pool(2);
  layer.set_executor(&pool);
  layer.parallel_into(in, in, in, linattn::Mask::causal,
                      linattn::TensorView<float>::batch_first(two.data(), 1, T, H, d));
  return one == two ? 0 : 1;
}
