// Sequence-parallel prefill over MPI (linattn/mpi.hpp, docs/distributed.md): one long prompt
// split across the ranks, each rank holding and computing only its slice; then decoding
// continues from the final state, which every rank holds (Carry::broadcast_final).
//
//   mpirun -np 2 ./example_distributed_prefill
//
// (As root add --allow-run-as-root; with more ranks than cores, --oversubscribe.)
// Rank 0 also runs the whole prompt in one process and prints how far the final states differ:
// rounding only.

#include <linattn/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

using namespace linattn;

namespace {

constexpr Index kTokens = 4096, kHeads = 4, kDim = 32;

// The prompt's activations for tokens [first, first + n): in a model each rank would compute
// them from its own tokens; here a fixed formula, so that every split sees the same sequence.
std::vector<float> activations(Index first, Index n, Index width, float phase) {
  std::vector<float> x(static_cast<std::size_t>(n * width));
  for (Index t = 0; t < n; ++t)
    for (Index c = 0; c < width; ++c)
      x[std::size_t(t * width + c)] = std::sin(0.01f * float(first + t) * float(c % 7 + 1) + phase);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int rc = 0;
  try {
    using Layer = MultiHeadAttention<LinearAttention<EluPlusOne>>;
    const Layer layer({kHeads, kHeads, kDim, kDim});

    // Slices: rank 0, which starts from the empty state, takes a little more (its slice needs
    // no carry; see balanced_slices).
    const std::vector<Index> lengths = mpi::balanced_slices(kTokens, ranks, 0.35);
    Index first = 0;
    for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
    const Index n = lengths[std::size_t(rank)], width = kHeads * kDim;
    const auto q = activations(first, n, width, 0.0f), k = activations(first, n, width, 1.0f),
               v = activations(first, n, width, 2.0f);
    std::vector<float> out(q.size());
    const auto view = [&](const std::vector<float>& x) {
      return TensorView<const float>::batch_first(x.data(), 1, n, kHeads, kDim);
    };

    // The distributed prefill: every rank ends with the state after the whole prompt.
    auto state = layer.make_state(1);
    mpi::SequenceParallel<Layer> prefill(layer, MPI_COMM_WORLD, {mpi::kLastRank, true});
    const mpi::ExchangeStats sent = prefill.prefill_into(
        state, view(q), view(k), view(v), TensorView<float>::batch_first(out.data(), 1, n, kHeads, kDim));
    std::printf("rank %d of %d: tokens [%ld, %ld), sent %zu bytes (summaries %zu), received %zu; "
                "state holds %ld tokens\n",
                rank, ranks, long(first), long(first + n), sent.sent_bytes(), sent.summary_bytes,
                sent.received_bytes, long(state.sequence(0).tokens()));

    // Decoding continues from the final state on any rank, here one token.
    const auto q1 = activations(kTokens, 1, width, 0.0f), k1 = activations(kTokens, 1, width, 1.0f),
               v1 = activations(kTokens, 1, width, 2.0f);
    std::vector<float> y1(q1.size());
    const auto token = [&](const std::vector<float>& x) {
      return TensorView<const float>::batch_first(x.data(), 1, 1, kHeads, kDim);
    };
    layer.step_into(state, token(q1), token(k1), token(v1),
                    TensorView<float>::batch_first(y1.data(), 1, 1, kHeads, kDim));

    if (rank == 0) {
      // The same prompt and token in one process, for comparison.
      const auto Q = activations(0, kTokens, width, 0.0f), K = activations(0, kTokens, width, 1.0f),
                 V = activations(0, kTokens, width, 2.0f);
      std::vector<float> O(Q.size()), y1_whole(y1.size());
      const auto all = [&](const std::vector<float>& x) {
        return TensorView<const float>::batch_first(x.data(), 1, kTokens, kHeads, kDim);
      };
      auto whole = layer.make_state(1);
      layer.prefill_into(whole, all(Q), all(K), all(V),
                         TensorView<float>::batch_first(O.data(), 1, kTokens, kHeads, kDim));
      layer.step_into(whole, token(q1), token(k1), token(v1),
                      TensorView<float>::batch_first(y1_whole.data(), 1, 1, kHeads, kDim));
      double output_diff = 0, state_diff = 0, state_size = 0;
      for (std::size_t i = 0; i < y1.size(); ++i)
        output_diff = std::max(output_diff, double(std::abs(y1[i] - y1_whole[i])));
      for (Index h = 0; h < kHeads; ++h) {
        const auto& a = state.sequence(0).head(h);
        const auto& b = whole.sequence(0).head(h);
        state_diff = std::max(state_diff, double((a.S() - b.S()).cwiseAbs().maxCoeff()));
        state_size = std::max(state_size, double(b.S().cwiseAbs().maxCoeff()));
      }
      std::printf("against one process: the decoded token differs by %.3g (outputs of order 1), "
                  "the state by %.3g (entries up to %.3g): float rounding\n",
                  output_diff, state_diff, state_size);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
