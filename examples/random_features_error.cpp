// How close random-feature linear attention gets to softmax attention, as the number of
// projections m grows: the table of docs/random_features.md.
//
// For fixed random Q, K, V (T = 64 tokens, d = dv = 16, entries N(0, sigma^2)) and each map
// (positive, hyperbolic, trig) with orthogonal or iid projections, prints the relative
// Frobenius error |Y - Y_softmax| / |Y_softmax| of the causal output, averaged over independent
// draws (seeds 1..S), for m in {16, 64, 256, 1024, 4096}, at sigma = 0.5 and sigma = 1.
// Draws whose causal read hits a denominator <= 0 (possible only for trig features) are counted
// and left out of the mean. Everything is in double.
//
// Usage: example_random_features_error [draws per cell, default 20]

#include <linattn/attention.hpp>
#include <linattn/random_features.hpp>
#include <linattn/reference.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using linattn::Index;
using Matrix = linattn::RowMatrix<double>;

Matrix gaussian(Index rows, Index cols, std::uint64_t seed, double sigma) {
  linattn::detail::GaussianStream gauss(seed);  // the library's own, reproducible stream
  Matrix m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = sigma * gauss.next();
  return m;
}

struct Cell {
  double mean_error = 0;
  double standard_error = 0;  // sample sd / sqrt(n) of the per-draw errors
  int failures = 0;
};

template <class Phi>
Cell measure(Index d, Index m, const linattn::RandomFeatureOptions& options, int draws,
             const Matrix& Q, const Matrix& K, const Matrix& V, const Matrix& exact) {
  Cell cell;
  std::vector<double> errors;
  for (int s = 1; s <= draws; ++s) {
    const linattn::LinearAttention<Phi, double> attn(Phi(d, m, static_cast<std::uint64_t>(s), options));
    try {
      errors.push_back((attn.parallel(Q, K, V, linattn::Mask::causal) - exact).norm() / exact.norm());
    } catch (const linattn::DenominatorError&) {
      ++cell.failures;
    }
  }
  const double n = static_cast<double>(errors.size());
  for (const double e : errors) cell.mean_error += e / n;
  double sq = 0;
  for (const double e : errors) sq += (e - cell.mean_error) * (e - cell.mean_error);
  if (errors.size() > 1) cell.standard_error = std::sqrt(sq / (n - 1) / n);
  return cell;
}

}  // namespace

int main(int argc, char** argv) {
  const int draws = argc > 1 ? std::atoi(argv[1]) : 20;
  if (draws < 1) {
    std::fprintf(stderr, "usage: %s [draws per cell >= 1]\n", argv[0]);
    return 2;
  }
  const Index T = 64, d = 16, dv = 16;
  const std::vector<Index> ms = {16, 64, 256, 1024, 4096};
  struct Variant {
    const char* name;
    bool trig, hyperbolic;
    linattn::Projection projection;
  };
  const Variant variants[] = {
      {"positive, orthogonal", false, false, linattn::Projection::orthogonal},
      {"positive, iid", false, false, linattn::Projection::iid},
      {"hyperbolic, orthogonal", false, true, linattn::Projection::orthogonal},
      {"hyperbolic, iid", false, true, linattn::Projection::iid},
      {"trig, orthogonal", true, false, linattn::Projection::orthogonal},
      {"trig, iid", true, false, linattn::Projection::iid},
  };

  std::printf("Relative Frobenius error of the causal output vs softmax attention\n");
  std::printf("T = %ld, d = dv = %ld, mean over %d draws per cell; r = m (positive) or 2m.\n",
              static_cast<long>(T), static_cast<long>(d), draws);
  std::printf("± is the standard error of the mean over draws; (k/%d) = k draws hit a\n", draws);
  std::printf("denominator <= 0 (DenominatorError) and are left out of the mean.\n");
  for (const double sigma : {0.5, 1.0}) {
    const Matrix Q = gaussian(T, d, 11, sigma), K = gaussian(T, d, 12, sigma),
                 V = gaussian(T, dv, 13, sigma);
    const Matrix exact = linattn::softmax_attention(Q, K, V, linattn::Mask::causal);
    std::printf("\nInputs N(0, %.2f):\n\n| map | m = 16 | 64 | 256 | 1024 | 4096 |\n", sigma * sigma);
    std::printf("|---|---|---|---|---|---|\n");
    for (const Variant& v : variants) {
      std::printf("| %s |", v.name);
      for (const Index m : ms) {
        const linattn::RandomFeatureOptions options{v.projection, std::nan(""), v.hyperbolic};
        const Cell c = v.trig
                           ? measure<linattn::TrigRandomFeatures<double>>(d, m, options, draws, Q, K, V, exact)
                           : measure<linattn::PositiveRandomFeatures<double>>(d, m, options, draws, Q, K, V, exact);
        if (c.failures == draws)
          std::printf(" all fail |");
        else if (c.failures > 0)
          std::printf(" %.3f ± %.3f (%d/%d) |", c.mean_error, c.standard_error, c.failures, draws);
        else
          std::printf(" %.3f ± %.3f |", c.mean_error, c.standard_error);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
