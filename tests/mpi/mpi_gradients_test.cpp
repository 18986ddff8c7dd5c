// linattn/mpi_gradients.hpp across real MPI processes (ctest runs this program under mpiexec
// with 2, 3 and 4 ranks). Every rank holds the whole sequence (same seeds everywhere), passes
// its slice to mpi::prefill_backward, and compares its dQ, dK, dV and its initial-state
// gradient with a plain double-precision loop written from the formulas of gradients.hpp, to
// a bound derived below; single-process linattn::prefill_backward is held to the same bound;
// a second call gives the same bits; bad input makes every rank throw the same exception.

#include <catch2/catch.hpp>

#include <linattn/mpi_gradients.hpp>
#include <linattn/multihead_gradients.hpp>

#include "mpi_support.hpp"  // world, same_on_every_rank
#include "slice_reference.hpp"
#include "test_support.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace mpi_gradients_test {  // this file's own names: the three files build as one program

using namespace linattn;
using namespace linattn_test;

namespace {

// Gradients of the causal read continuing (S0, z0), in double, from gradients.hpp's formulas
// (w_ij = qf_i . kf_j, v'_j = [v_j, 1], G_i = [dy_i / den_i, -(dy_i . y_i) / den_i], or
// [dy_i, 0] unnormalized), each with its magnitude: the same sums over |terms|.
struct Reference {
  MatrixXdR dQ, dK, dV;
  MatrixXdR mQ, mK, mV;
  std::vector<MatrixXdR> dS_at, mS_at;  // gradient w.r.t. the state before row t, t = 0..T
  std::vector<Eigen::VectorXd> dz_at, mz_at;
};

Reference reference(bool elu, bool normalized, const MatrixXdR& Q, const MatrixXdR& K,
                    const MatrixXdR& V, const MatrixXdR& dY, const MatrixXdR& S0,
                    const Eigen::VectorXd& z0, const MatrixXdR& dS_T, const Eigen::VectorXd& dz_T) {
  const Index T = Q.rows(), r = Q.cols(), dv = V.cols();
  const auto phi = [&](double x) { return elu ? elu_plus_one(x) : x; };
  const auto dphi = [&](double x) { return elu ? (x > 0 ? 1.0 : std::exp(x)) : 1.0; };
  MatrixXdR qf = Q.unaryExpr(phi), kf = K.unaryExpr(phi);
  MatrixXdR G(T, dv + 1), mG(T, dv + 1);  // with magnitudes
  for (Index i = 0; i < T; ++i) {
    Eigen::RowVectorXd num = qf.row(i) * S0, mnum = qf.row(i).cwiseAbs() * S0.cwiseAbs();
    double den = qf.row(i).dot(z0);
    for (Index j = 0; j <= i; ++j) {
      const double w = qf.row(i).dot(kf.row(j)), mw = qf.row(i).cwiseAbs().dot(kf.row(j).cwiseAbs());
      num += w * V.row(j);
      mnum += mw * V.row(j).cwiseAbs();
      den += w;
    }
    if (normalized) {
      const Eigen::RowVectorXd y = num / den, my = mnum / den;
      G.row(i) << dY.row(i) / den, -dY.row(i).dot(y) / den;
      mG.row(i) << dY.row(i).cwiseAbs() / den, dY.row(i).cwiseAbs().dot(my) / den;
    } else {
      G.row(i) << dY.row(i), 0.0;
      mG.row(i) << dY.row(i).cwiseAbs(), 0.0;
    }
  }
  MatrixXdR Vp(T, dv + 1), mVp(T, dv + 1), Sz0(r, dv + 1), SzT(r, dv + 1);
  Vp << V, Eigen::VectorXd::Ones(T);
  mVp << V.cwiseAbs(), Eigen::VectorXd::Ones(T);
  Sz0 << S0, z0;
  SzT << dS_T, dz_T;
  Reference ref;
  MatrixXdR dqf = G * Sz0.transpose(), mqf = mG * Sz0.cwiseAbs().transpose();
  MatrixXdR dkf = Vp * SzT.transpose(), mkf = mVp * SzT.cwiseAbs().transpose();
  ref.dV = kf * dS_T;
  ref.mV = kf.cwiseAbs() * dS_T.cwiseAbs();
  for (Index i = 0; i < T; ++i)
    for (Index j = 0; j <= i; ++j) {
      const double gv = G.row(i).dot(Vp.row(j)), mgv = mG.row(i).dot(mVp.row(j));
      const double w = qf.row(i).dot(kf.row(j)), mw = qf.row(i).cwiseAbs().dot(kf.row(j).cwiseAbs());
      dqf.row(i) += gv * kf.row(j);
      mqf.row(i) += mgv * kf.row(j).cwiseAbs();
      dkf.row(j) += gv * qf.row(i);
      mkf.row(j) += mgv * qf.row(i).cwiseAbs();
      ref.dV.row(j) += w * G.row(i).head(dv);
      ref.mV.row(j) += mw * mG.row(i).head(dv);
    }
  const MatrixXdR dQ_chain = Q.unaryExpr(dphi), dK_chain = K.unaryExpr(dphi);
  ref.dQ = dqf.cwiseProduct(dQ_chain);
  ref.mQ = mqf.cwiseProduct(dQ_chain.cwiseAbs());
  ref.dK = dkf.cwiseProduct(dK_chain);
  ref.mK = mkf.cwiseProduct(dK_chain.cwiseAbs());
  // [dS, dz] before row t: sum_{i >= t} qf_i G_i^T + [dS_T, dz_T].
  ref.dS_at.assign(std::size_t(T + 1), dS_T);
  ref.mS_at.assign(std::size_t(T + 1), dS_T.cwiseAbs());
  ref.dz_at.assign(std::size_t(T + 1), dz_T);
  ref.mz_at.assign(std::size_t(T + 1), dz_T.cwiseAbs());
  for (Index t = T; t-- > 0;) {
    const auto k = std::size_t(t);
    ref.dS_at[k] = ref.dS_at[k + 1] + qf.row(t).transpose() * G.row(t).head(dv);
    ref.mS_at[k] = ref.mS_at[k + 1] + qf.row(t).cwiseAbs().transpose() * mG.row(t).head(dv);
    ref.dz_at[k] = ref.dz_at[k + 1] + qf.row(t).transpose() * G(t, dv);
    ref.mz_at[k] = ref.mz_at[k + 1] + qf.row(t).cwiseAbs().transpose() * mG(t, dv);
  }
  return ref;
}

// Largest |got - want| / (units u magnitude) over the entries (<= 1 passes).
template <class Scalar, class M>
double worst(const M& got, const MatrixXdR& want, const MatrixXdR& magnitude, double units) {
  return worst_ratio_of<Scalar>(got, want, [&](Index i, Index c) { return units * magnitude(i, c); });
}

template <class Scalar>
void check_against_reference(bool elu, bool normalized) {
  const int rank = world().rank, P = world().size;
  const Index T = 61, d = 6, dv = 5, prefix = 5;
  Options options;
  if (!normalized) options.normalization = Normalization::unnormalized();
  const auto run = [&](const auto& attn) {
    const RowMatrix<Scalar> Q = random_matrix<Scalar>(T, d, 4100, 0.7),
                            K = random_matrix<Scalar>(T, d, 4101, 0.7),
                            V = random_matrix<Scalar>(T, dv, 4102),
                            dY = random_matrix<Scalar>(T, dv, 4103);
    // An initial state made by a prefix of tokens (so that its z makes positive denominators).
    const RowMatrix<Scalar> Kp = random_matrix<Scalar>(prefix, d, 4104, 0.7),
                            Vp = random_matrix<Scalar>(prefix, dv, 4105);
    auto start = attn.make_state(d, dv);
    static_cast<void>(attn.prefill(start, Kp, Kp, Vp));
    const StateGradient<Scalar> final_gradient{random_matrix<Scalar>(d, dv, 4106),
                                               random_matrix<Scalar>(d, 1, 4107).col(0)};
    const MatrixXdR Qd = Q.template cast<double>(), Kd = K.template cast<double>();
    const Reference ref = reference(
        elu, normalized, Qd, Kd, V.template cast<double>(), dY.template cast<double>(),
        start.S().template cast<double>(), start.z().template cast<double>(),
        final_gradient.S.template cast<double>(), final_gradient.z.template cast<double>());
    // Rounding bound, in units of u, relative to each entry's magnitude (the same sums over
    // |terms|), as tests/gradients_test.cpp derives it: along the longest chain each rounding
    // adds at most u relative to the magnitude of what it rounds (the scores, r products; num
    // and den, T + prefix keys plus r state terms; the division and y; dy . y, dv; the score
    // gradient, dv + 1; the sums over T rows; the state's share, r or dv terms; the feature
    // map's chain rule), each at most twice: 2 (2 T + 2 r + 2 dv + d + 16), plus 8 for ELU's
    // exp on both sides. The split adds no new kind of term: the carried state is a sum over
    // the earlier keys and the scanned gradient a sum over the later rows, the same terms in
    // another grouping (P more additions, within the 2 T).
    const double units = 2.0 * double(2 * (T + prefix) + 2 * d + 2 * dv + d + 16) + 8;
    const double dz_units = units;
    const auto whole = linattn::prefill_backward(attn, start, Q, K, V, dY, &final_gradient);
    CHECK(worst<Scalar>(whole.Q, ref.dQ, ref.mQ, units) <= 1);
    CHECK(worst<Scalar>(whole.K, ref.dK, ref.mK, units) <= 1);
    CHECK(worst<Scalar>(whole.V, ref.dV, ref.mV, units) <= 1);
    for (const auto& lengths : slicings(T, P)) {
      Index first = 0;
      for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
      const Index n = lengths[std::size_t(rank)];
      INFO("rank " << rank << " of " << P << ", rows " << first << " + " << n);
      const auto mine = [&] {
        return mpi::prefill_backward(MPI_COMM_WORLD, attn, rank == 0 ? start : attn.make_state(d, dv),
                                     Q.middleRows(first, n), K.middleRows(first, n),
                                     V.middleRows(first, n), dY.middleRows(first, n),
                                     rank == P - 1 ? &final_gradient : nullptr);
      };
      const Gradients<Scalar> got = mine();
      CHECK(worst<Scalar>(got.Q, ref.dQ.middleRows(first, n), ref.mQ.middleRows(first, n), units) <= 1);
      CHECK(worst<Scalar>(got.K, ref.dK.middleRows(first, n), ref.mK.middleRows(first, n), units) <= 1);
      CHECK(worst<Scalar>(got.V, ref.dV.middleRows(first, n), ref.mV.middleRows(first, n), units) <= 1);
      // The gradient with respect to the state this slice starts from (rank 0: the initial state).
      CHECK(worst<Scalar>(got.initial.S, ref.dS_at[std::size_t(first)], ref.mS_at[std::size_t(first)], units) <= 1);
      CHECK(worst<Scalar>(MatrixXdR(got.initial.z.template cast<double>()),
                          MatrixXdR(ref.dz_at[std::size_t(first)]), MatrixXdR(ref.mz_at[std::size_t(first)]),
                          dz_units) <= 1);
      // Same P and slices: the same bits.
      const Gradients<Scalar> again = mine();
      CHECK(again.Q == got.Q);
      CHECK(again.K == got.K);
      CHECK(again.V == got.V);
      CHECK(again.initial.S == got.initial.S);
      CHECK(again.initial.z == got.initial.z);
    }
  };
  if (elu)
    run(LinearAttention<EluPlusOne, Scalar>(EluPlusOne{}, options));
  else
    run(LinearAttention<Identity, Scalar>(Identity{}, options));
}

}  // namespace

TEMPLATE_TEST_CASE("sequence-parallel backward equals the formulas to rounding on every slicing, "
                   "the same bits when repeated",
                   "[mpi][gradients]", float, double) {
  SECTION("ELU + 1, normalized") { check_against_reference<TestType>(true, true); }
  SECTION("Identity, unnormalized") { check_against_reference<TestType>(false, false); }
}

TEST_CASE("sequence-parallel backward: bad input on one rank throws the same on every rank",
          "[mpi][gradients]") {
  const int rank = world().rank, P = world().size;
  const Index T = 24, d = 4, dv = 3, n = T / P;
  const LinearAttention<EluPlusOne> attn;
  const auto qkv = random_qkv<float>(T, d, dv, 4200);
  const RowMatrix<float> dY = random_matrix<float>(T, dv, 4203);
  const auto call = [&](Index my_d, Index my_dy_rows) {
    const RowMatrix<float> Q = random_matrix<float>(n, my_d, 4201), K = random_matrix<float>(n, my_d, 4202);
    static_cast<void>(mpi::prefill_backward(MPI_COMM_WORLD, attn, attn.make_state(my_d, dv), Q, K,
                                            qkv.V.topRows(n), dY.topRows(my_dy_rows)));
  };
  // The last rank's dY has a row too few: ShapeError everywhere, naming that rank.
  std::string message;
  try {
    call(d, rank == P - 1 ? n - 1 : n);
  } catch (const ShapeError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("rank " + std::to_string(P - 1)) && Catch::Contains("dY"));
  CHECK(same_on_every_rank(message));
  // Rank 1 has another key dimension: RankMismatchError everywhere.
  message.clear();
  try {
    call(rank == 1 ? d + 1 : d, n);
  } catch (const mpi::RankMismatchError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("rank 1"));
  CHECK(same_on_every_rank(message));
  // And the next call works.
  CHECK_NOTHROW(call(d, n));
}

// float only: the rules' backward exchanges its summaries and states through
// detail::mpi_type<Scalar>, as the additive backward above does, which runs in double too (a
// double instantiation here added a fifth to this program's compile time, g++ 12).
TEMPLATE_TEST_CASE("the rules' sequence-parallel backward equals the single-process backward on "
                   "every slicing, the same bits when repeated",
                   "[mpi][gradients][rules]", float) {
  using Scalar = TestType;
  const int rank = world().rank, P = world().size;
  const Index T = 29, dk = 4, dv = 3;
  for_each_rule<Scalar>(T, dk, 5100, [&](const char* name, const auto& attn, auto, const MatrixXdR&,
                                         const MatrixXdR&, const MatrixXdR&, const auto&... in) {
    using Attention = std::decay_t<decltype(attn)>;
    using Rule = typename Attention::rule_type;
    if constexpr (Rule::kind != WriteKind::additive) {
      INFO(name);
      const auto qkv = random_qkv<Scalar>(T, dk, dv, 5200);
      const RowMatrix<Scalar> dY = random_matrix<Scalar>(T, dv, 5203);
      const Index r = attn.feature_dim(dk);
      // A carried initial state and a final-state gradient, both non-zero.
      auto start = attn.make_state(dk, dv);
      const RowMatrix<Scalar> S0 = random_matrix<Scalar>(r, dv, 5204);
      StateGradient<Scalar> final_gradient{random_matrix<Scalar>(r, dv, 5206), ColVector<Scalar>()};
      if constexpr (Rule::keeps_normalizer) {
        start.assign(S0, uniform_matrix<Scalar>(r, 1, 5205, 0.5, 1.5).col(0), 7);
        final_gradient.z = random_matrix<Scalar>(r, 1, 5207).col(0);
      } else {
        start.assign(S0, 7);
      }
      const auto whole = linattn::prefill_backward(attn, start, qkv.Q, qkv.K, qkv.V, in..., dY,
                                                   &final_gradient);
      // The distributed backward computes the same sums associated differently (the carried
      // state through the slices' summaries, the state gradient through A^T and the slices'
      // local parts, the chunks restarted at slice boundaries). Every gradient entry is a sum
      // of at most T + C + r + dv products (tokens, one chunk, the r- and dv-long dot
      // products), so regrouping it moves it by at most 2 (T + C + r + dv) u times the
      // magnitude sum of its terms; each term is at most one token's share, and the magnitude
      // sum is bounded by T times the largest |entry| of that gradient (plus 1 for gradients
      // near 0). C = the attention's chunk.
      const double C = double(attn.chunk_size(r, dv));
      const double allowed = 2.0 * (double(T) + C + double(r) + double(dv)) * double(T) *
                             unit_roundoff<Scalar>();
      const auto near = [&](const auto& got, const auto& expected) {
        if (got.rows() != expected.rows() || got.cols() != expected.cols()) return false;
        if (got.size() == 0) return true;
        const double scale = 1.0 + double(expected.cwiseAbs().maxCoeff());
        return double((got - expected).cwiseAbs().maxCoeff()) <= allowed * scale;
      };
      for (const auto& lengths : slicings(T, P)) {
        Index first = 0;
        for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
        const Index n = lengths[std::size_t(rank)];
        INFO("rank " << rank << " of " << P << ", rows " << first << " + " << n);
        const auto mine = [&] {
          return mpi::prefill_backward(MPI_COMM_WORLD, attn, rank == 0 ? start : attn.make_state(dk, dv),
                                       qkv.Q.middleRows(first, n), qkv.K.middleRows(first, n),
                                       qkv.V.middleRows(first, n), in.middleRows(first, n)...,
                                       dY.middleRows(first, n),
                                       rank == P - 1 ? &final_gradient : nullptr);
        };
        const RuleGradients<Scalar> got = mine();
        CHECK(near(got.Q, whole.Q.middleRows(first, n)));
        CHECK(near(got.K, whole.K.middleRows(first, n)));
        CHECK(near(got.V, whole.V.middleRows(first, n)));
        if (whole.inputs.log_gate.size() > 0)
          CHECK(near(got.inputs.log_gate, whole.inputs.log_gate.middleRows(first, n)));
        if (whole.inputs.beta.size() > 0) CHECK(near(got.inputs.beta, whole.inputs.beta.segment(first, n)));
        if (whole.inputs.log_alpha.size() > 0)
          CHECK(near(got.inputs.log_alpha, whole.inputs.log_alpha.middleRows(first, n)));
        if (rank == 0) {
          CHECK(near(got.initial.S, whole.initial.S));
          CHECK(near(got.initial.z, whole.initial.z));
        }
        // Same P and slices: the same bits.
        const RuleGradients<Scalar> again = mine();
        CHECK(again.Q == got.Q);
        CHECK(again.K == got.K);
        CHECK(again.V == got.V);
        CHECK(again.inputs.log_gate == got.inputs.log_gate);
        CHECK(again.inputs.beta == got.inputs.beta);
        CHECK(again.inputs.log_alpha == got.inputs.log_alpha);
        CHECK(again.initial.S == got.initial.S);
        CHECK(again.initial.z == got.initial.z);
      }
    }
  });
}

namespace {

template <class View>
View token_rows(const View& full, Index t0, Index n) {
  return View(full.data() + t0 * full.strides()[1], {full.batches(), n, full.heads(), full.dim()},
              full.strides());
}

// A layer call's gradient buffers, [B, T, H, d] batch-first (dQ, dK, dV and the per-token
// inputs', shaped like `inputs`), every value `fill`, with views of their rows [t0, t0 + n).
// (Hv: the value heads, and the per-token inputs' heads; Hkv unless values are grouped.)
template <class Scalar, std::size_t N>
struct LayerGrads {
  Index B = 0, T = 0, Hq = 0, Hkv = 0, dk = 0, dv = 0, Hv = 0;
  std::vector<Scalar> Q, K, V;
  std::array<std::vector<Scalar>, N> in;
  std::array<Index, N> in_dim{};

  LayerGrads(Index B_, Index T_, Index Hq_, Index Hkv_, Index dk_, Index dv_,
             const std::array<TensorView<const Scalar>, N>& inputs, Scalar fill, Index Hv_ = 0)
      : B(B_), T(T_), Hq(Hq_), Hkv(Hkv_), dk(dk_), dv(dv_), Hv(Hv_ > 0 ? Hv_ : Hkv_),
        Q(std::size_t(B_ * T_ * Hq_ * dk_), fill),
        K(std::size_t(B_ * T_ * Hkv_ * dk_), fill),
        V(std::size_t(B_ * T_ * Hv * dv_), fill) {
    for (std::size_t i = 0; i < N; ++i) {
      in_dim[i] = inputs[i].dim();
      in[i].assign(std::size_t(B * T * Hv * in_dim[i]), fill);
    }
  }

  std::pair<GradientViews<Scalar>, std::array<TensorView<Scalar>, N>> views(Index t0, Index n) {
    const GradientViews<Scalar> v{
        token_rows(TensorView<Scalar>::batch_first(Q.data(), B, T, Hq, dk), t0, n),
        token_rows(TensorView<Scalar>::batch_first(K.data(), B, T, Hkv, dk), t0, n),
        token_rows(TensorView<Scalar>::batch_first(V.data(), B, T, Hv, dv), t0, n)};
    std::array<TensorView<Scalar>, N> d;
    for (std::size_t i = 0; i < N; ++i)
      d[i] = token_rows(TensorView<Scalar>::batch_first(in[i].data(), B, T, Hv, in_dim[i]), t0, n);
    return {v, d};
  }
};

// The layer's distributed backward against the single-process layer backward
// (multihead_gradients.hpp) over the whole sequence, for attention `attn` whose per-token
// inputs are drawn from `specs` ({channels, lo, hi} per input). Grouped query heads (4 over 2
// key/value heads), or with `value_group` G_v > 1 grouped value heads (2 G_v over 2 query/key
// heads).
template <class Attention, std::size_t N>
void check_layer(const Attention& attn, const std::array<std::array<double, 3>, N>& specs,
                 Index value_group = 1) {
  using Scalar = typename Attention::scalar_type;
  const int rank = world().rank, P = world().size;
  const Index B = 2, T = 17, Hkv = 2, Hq = value_group > 1 ? 2 : 4, Hv = Hkv * value_group,
              Ho = std::max(Hq, Hv), dk = 4, dv = 3;
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv, Hv}, attn);
  const auto buffer = [](Index n, std::uint64_t seed) {
    const RowMatrix<Scalar> m = random_matrix<Scalar>(1, n, seed);
    return std::vector<Scalar>(m.data(), m.data() + n);
  };
  const std::vector<Scalar> Qb = buffer(B * T * Hq * dk, 6001), Kb = buffer(B * T * Hkv * dk, 6002),
                            Vb = buffer(B * T * Hv * dv, 6003), dYb = buffer(B * T * Ho * dv, 6004);
  std::array<std::vector<Scalar>, N> inb;
  std::array<TensorView<const Scalar>, N> in;
  for (std::size_t i = 0; i < N; ++i) {
    const Index c = Index(specs[i][0]);
    const RowMatrix<Scalar> m = uniform_matrix<Scalar>(1, B * T * Hv * c, 6010 + i, specs[i][1], specs[i][2]);
    inb[i].assign(m.data(), m.data() + m.size());
    in[i] = TensorView<const Scalar>::batch_first(inb[i].data(), B, T, Hv, c);
  }
  const auto Q = TensorView<const Scalar>::batch_first(Qb.data(), B, T, Hq, dk);
  const auto K = TensorView<const Scalar>::batch_first(Kb.data(), B, T, Hkv, dk);
  const auto V = TensorView<const Scalar>::batch_first(Vb.data(), B, T, Hv, dv);
  const auto dY = TensorView<const Scalar>::batch_first(dYb.data(), B, T, Ho, dv);
  auto state = layer.make_state(B);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < state.heads(); ++h) {
      const RowMatrix<Scalar> S = random_matrix<Scalar>(layer.feature_dim(), dv, std::uint64_t(6100 + 10 * b + h));
      if constexpr (Attention::rule_type::keeps_normalizer)
        state.sequence(b).head(h).assign(S, uniform_matrix<Scalar>(layer.feature_dim(), 1, 6200, 0.5, 1.5).col(0));
      else
        state.sequence(b).head(h).assign(S);
    }
  BatchStateGradient<Scalar> fin(state), whole_initial(state), initial(state);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < state.heads(); ++h) {
      fin.head(b, h).S = random_matrix<Scalar>(layer.feature_dim(), dv, std::uint64_t(6300 + 10 * b + h));
      if (fin.head(b, h).z.size() > 0)
        fin.head(b, h).z = random_matrix<Scalar>(layer.feature_dim(), 1, std::uint64_t(6400 + 10 * b + h)).col(0);
    }
  // Gradient buffers: the whole sequence's (reference) and the distributed ones.
  using Grads = LayerGrads<Scalar, N>;
  const auto make = [&] { return Grads(B, T, Hq, Hkv, dk, dv, in, Scalar(0), Hv); };
  const auto views = [](Grads& g, Index t0, Index n) { return g.views(t0, n); };
  Grads whole = make();
  {
    const auto vd = views(whole, 0, T);
    const auto& gv = vd.first;
    const auto& d = vd.second;
    std::apply([&](const auto&... x) {
      std::apply([&](const auto&... dx) {
        linattn::prefill_backward_into(layer, state, Q, K, V, x..., dY, &fin, gv, dx..., whole_initial);
      }, d);
    }, in);
  }
  // Bound as in the single-head test above: 2 (T + C + r + dv) u times T times the largest
  // |entry| of each gradient (plus 1), from regrouping sums of at most T + C + r + dv terms.
  const double C = double(attn.chunk_size(layer.feature_dim(), dv));
  const double allowed = 2.0 * (double(T) + C + double(layer.feature_dim()) + double(dv)) *
                         double(T) * unit_roundoff<Scalar>();
  const auto near_rows = [&](const std::vector<Scalar>& got, const std::vector<Scalar>& ref, Index H,
                             Index d, Index first, Index n) {
    double scale = 0, worst = 0;
    for (Scalar x : ref) scale = std::max(scale, double(std::abs(x)));
    for (Index b = 0; b < B; ++b)
      for (Index t = first; t < first + n; ++t)
        for (Index h = 0; h < H; ++h)
          for (Index c = 0; c < d; ++c) {
            const std::size_t at = std::size_t(((b * T + t) * H + h) * d + c);
            worst = std::max(worst, double(std::abs(got[at] - ref[at])));
          }
    return worst <= allowed * (1 + scale);
  };
  // One workspace through every slicing and schedule, with a call whose keys are NaN before
  // each use: the second call of each pair must still give the first's bits.
  BackwardWorkspace<Scalar> workspace;
  const std::vector<Scalar> nan_keys(Kb.size(), std::numeric_limits<Scalar>::quiet_NaN());
  const auto poisoned_K = TensorView<const Scalar>::batch_first(nan_keys.data(), B, T, Hkv, dk);
  for (const auto& lengths : slicings(T, P)) {
    Index first = 0;
    for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
    const Index n = lengths[std::size_t(rank)];
    INFO("rank " << rank << " of " << P << ", rows " << first << " + " << n);
    // Each schedule against the whole sequence's backward, and automatic: the bits of the
    // schedule the cost model picks for B max(H_q, H_v) items on P ranks.
    Grads picked = make();
    const bool pipeline_pays = linattn::detail::backward_pipeline_pays(
        B * Ho, P, linattn::detail::backward_costs<typename Attention::rule_type>());
    for (const mpi::Schedule schedule :
         {mpi::Schedule::summaries, mpi::Schedule::pipeline, mpi::Schedule::automatic}) {
    INFO("schedule " << int(schedule));
    const auto run = [&](Grads& g, const TensorView<const Scalar>& keys,
                         BackwardWorkspace<Scalar>* kept) {
      const auto vd = views(g, first, n);
      const auto& gv = vd.first;
      const auto& d = vd.second;
      std::array<TensorView<const Scalar>, N> mine_in;
      for (std::size_t i = 0; i < N; ++i) mine_in[i] = token_rows(in[i], first, n);
      const auto other = layer.make_state(B);
      std::apply([&](const auto&... x) {
        std::apply([&](const auto&... dx) {
          mpi::prefill_backward_into(MPI_COMM_WORLD, layer, rank == 0 ? state : other,
                                     token_rows(Q, first, n), token_rows(keys, first, n),
                                     token_rows(V, first, n), x..., token_rows(dY, first, n),
                                     rank == P - 1 ? &fin : nullptr, gv, dx..., initial, schedule,
                                     kept);
        }, d);
      }, mine_in);
    };
    Grads got = make(), again = make(), poisoned = make();
    run(got, K, nullptr);
    BatchStateGradient<Scalar> first_initial = initial;
    try {  // every rank throws the same, or none does (NaN through unnormalized reads)
      run(poisoned, poisoned_K, &workspace);
    } catch (const std::exception&) {
    }
    run(again, K, &workspace);
    CHECK(near_rows(got.Q, whole.Q, Hq, dk, first, n));
    CHECK(near_rows(got.K, whole.K, Hkv, dk, first, n));
    CHECK(near_rows(got.V, whole.V, Hv, dv, first, n));
    for (std::size_t i = 0; i < N; ++i) CHECK(near_rows(got.in[i], whole.in[i], Hv, in[i].dim(), first, n));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < state.heads(); ++h) {
        if (rank == 0) {
          const auto& a = first_initial.head(b, h);
          const auto& w = whole_initial.head(b, h);
          CHECK(((a.S - w.S).cwiseAbs().array() <= allowed * (1 + double(w.S.cwiseAbs().maxCoeff()))).all());
          if (w.z.size() > 0)
            CHECK(((a.z - w.z).cwiseAbs().array() <= allowed * (1 + double(w.z.cwiseAbs().maxCoeff()))).all());
        }
        CHECK(initial.head(b, h).S == first_initial.head(b, h).S);
        CHECK(initial.head(b, h).z == first_initial.head(b, h).z);
      }
    // Same P and slices: the same bits, with a workspace that served other calls or without.
    CHECK(again.Q == got.Q);
    CHECK(again.K == got.K);
    CHECK(again.V == got.V);
    for (std::size_t i = 0; i < N; ++i) CHECK(again.in[i] == got.in[i]);
    if (schedule == (pipeline_pays ? mpi::Schedule::pipeline : mpi::Schedule::summaries)) picked = got;
    if (schedule == mpi::Schedule::automatic) {
      CHECK(got.Q == picked.Q);
      CHECK(got.K == picked.K);
      CHECK(got.V == picked.V);
      for (std::size_t i = 0; i < N; ++i) CHECK(got.in[i] == picked.in[i]);
    }
    }
  }
}

// The layer's distributed backward over a packed or padded layout of the whole sequence against
// the single-process layer backward of the whole sequence with the same layout and slots:
// sequences that cross ranks, lie on one rank, or are empty (the packed offsets of the forward's
// layout test); padding that holds NaN in every input (never read). On every slicing and
// schedule: this rank's gradient rows and rank 0's initial states' gradients to the bound of
// check_layer, padded rows exactly zero, the position no slot names untouched, and a second call
// with the same bits (automatic: the pipeline's). With `given_ends`, random initial states and
// final gradients; without, zero initial states and no final gradient (then the pipeline sends
// no message for a sequence that lies on one rank).
template <class Attention, std::size_t N>
void check_layout(const Attention& attn, const std::array<std::array<double, 3>, N>& specs,
                  SequenceLayout::Kind kind, bool given_ends) {
  using Scalar = typename Attention::scalar_type;
  const int rank = world().rank, P = world().size;
  const bool packed = kind == SequenceLayout::Kind::packed;
  const Index T = 61, B = packed ? 1 : 3, Hq = 4, Hkv = 2, dk = 4, dv = 3;
  const std::vector<Index> values =
      packed ? std::vector<Index>{0, 5, 5, 30, 44, 61} : std::vector<Index>{61, 23, 0};
  const SequenceLayout layout = packed ? SequenceLayout::packed(values) : SequenceLayout::padded(values);
  const Index S = layout.count(B);
  const MultiHeadAttention<Attention> layer(HeadConfig{Hq, Hkv, dk, dv}, attn);
  const Index r = layer.feature_dim();
  const auto length_of = [&](Index b) { return packed ? T : values[std::size_t(b)]; };
  // A [B, T, H, d] buffer; padded rows (b, t >= length) hold NaN.
  const auto buffer = [&](Index H, Index d, const RowMatrix<Scalar>& m) {
    std::vector<Scalar> x(m.data(), m.data() + m.size());
    for (Index b = 0; b < B; ++b)
      for (Index t = length_of(b); t < T; ++t)
        std::fill_n(x.begin() + ((b * T + t) * H) * d, H * d, std::numeric_limits<Scalar>::quiet_NaN());
    return x;
  };
  const std::vector<Scalar> Qb = buffer(Hq, dk, random_matrix<Scalar>(1, B * T * Hq * dk, 6501)),
                            Kb = buffer(Hkv, dk, random_matrix<Scalar>(1, B * T * Hkv * dk, 6502)),
                            Vb = buffer(Hkv, dv, random_matrix<Scalar>(1, B * T * Hkv * dv, 6503)),
                            dYb = buffer(Hq, dv, random_matrix<Scalar>(1, B * T * Hq * dv, 6504));
  std::array<std::vector<Scalar>, N> inb;
  std::array<TensorView<const Scalar>, N> in;
  for (std::size_t i = 0; i < N; ++i) {
    const Index c = Index(specs[i][0]) == 0 ? r : Index(specs[i][0]);
    inb[i] = buffer(Hkv, c, uniform_matrix<Scalar>(1, B * T * Hkv * c, 6510 + i, specs[i][1], specs[i][2]));
    in[i] = TensorView<const Scalar>::batch_first(inb[i].data(), B, T, Hkv, c);
  }
  const auto Q = TensorView<const Scalar>::batch_first(Qb.data(), B, T, Hq, dk);
  const auto K = TensorView<const Scalar>::batch_first(Kb.data(), B, T, Hkv, dk);
  const auto V = TensorView<const Scalar>::batch_first(Vb.data(), B, T, Hkv, dv);
  const auto dY = TensorView<const Scalar>::batch_first(dYb.data(), B, T, Hq, dv);
  // States and final gradients at S + 1 positions; sequence s at position S - s (0: no slot).
  std::vector<Index> slots(static_cast<std::size_t>(S));
  for (Index s = 0; s < S; ++s) slots[std::size_t(s)] = S - s;
  auto state = layer.make_state(S + 1);
  BatchStateGradient<Scalar> fin(state);
  for (Index p = 0; p <= S && given_ends; ++p)
    for (Index h = 0; h < state.heads(); ++h) {
      const RowMatrix<Scalar> S0 = random_matrix<Scalar>(r, dv, std::uint64_t(6600 + 10 * p + h));
      if constexpr (Attention::rule_type::keeps_normalizer)
        state.sequence(p).head(h).assign(S0, uniform_matrix<Scalar>(r, 1, 6700 + std::uint64_t(p), 0.5, 1.5).col(0));
      else
        state.sequence(p).head(h).assign(S0);
      fin.head(p, h).S = random_matrix<Scalar>(r, dv, std::uint64_t(6800 + 10 * p + h));
      if (fin.head(p, h).z.size() > 0)
        fin.head(p, h).z = random_matrix<Scalar>(r, 1, std::uint64_t(6900 + 10 * p + h)).col(0);
    }
  using Grads = LayerGrads<Scalar, N>;
  // 7 everywhere: rows a call does not write keep it.
  const auto make = [&] { return Grads(B, T, Hq, Hkv, dk, dv, in, Scalar(7)); };
  const auto views = [](Grads& g, Index t0, Index n) { return g.views(t0, n); };
  const auto marked = [&] {  // position 0 marked: no slot names it
    BatchStateGradient<Scalar> g(state);
    g.head(0, 0).S.setConstant(5);
    return g;
  };
  Grads whole = make();
  BatchStateGradient<Scalar> whole_initial = marked();
  {
    const auto vd = views(whole, 0, T);
    std::apply([&](const auto&... x) {
      std::apply([&](const auto&... dx) {
        linattn::prefill_backward_into(layer, state, Q, K, V, x..., dY, given_ends ? &fin : nullptr,
                                       vd.first, dx..., whole_initial, layout,
                                       std::span<const Index>(slots));
      }, vd.second);
    }, in);
  }
  // The bound of check_layer; NaN fails it.
  const double C = double(attn.chunk_size(r, dv));
  const double allowed = 2.0 * (double(T) + C + double(r) + double(dv)) * double(T) * unit_roundoff<Scalar>();
  const auto near = [&](const Scalar* got, const Scalar* ref, Index size, double scale) {
    for (Index i = 0; i < size; ++i)
      if (!(std::abs(double(got[i]) - double(ref[i])) <= allowed * (1 + scale))) return false;
    return true;
  };
  const auto near_rows = [&](const std::vector<Scalar>& got, const std::vector<Scalar>& ref, Index H,
                             Index d, Index first, Index n) {
    double scale = 0;
    for (Scalar x : ref) scale = std::max(scale, double(std::abs(x)));
    bool ok = true, padding_zero = true;
    for (Index b = 0; b < B; ++b)
      for (Index t = first; t < first + n; ++t) {
        const std::size_t at = std::size_t((b * T + t) * H * d);
        ok = ok && near(got.data() + at, ref.data() + at, H * d, scale);
        if (t >= length_of(b))
          padding_zero = padding_zero && std::all_of(got.begin() + std::ptrdiff_t(at),
                                                     got.begin() + std::ptrdiff_t(at + std::size_t(H * d)),
                                                     [](Scalar x) { return x == 0; });
      }
    return ok && padding_zero;
  };
  // One workspace through every slicing and schedule, as in check_layer.
  BackwardWorkspace<Scalar> workspace;
  const std::vector<Scalar> nan_keys(Kb.size(), std::numeric_limits<Scalar>::quiet_NaN());
  const auto poisoned_K = TensorView<const Scalar>::batch_first(nan_keys.data(), B, T, Hkv, dk);
  for (const auto& lengths : slicings_to_test(T, P)) {
    Index first = 0;
    for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
    const Index n = lengths[std::size_t(rank)];
    Grads pipelined = make();
    for (const mpi::Schedule schedule :
         {mpi::Schedule::pipeline, mpi::Schedule::summaries, mpi::Schedule::automatic}) {
      INFO((packed ? "packed" : "padded") << (given_ends ? "" : ", zero ends") << ", rank " << rank << " of " << P << ", rows " << first
                                          << " + " << n << ", schedule " << int(schedule));
      BatchStateGradient<Scalar> initial = marked();
      const auto run = [&](Grads& g, const TensorView<const Scalar>& keys,
                           BackwardWorkspace<Scalar>* kept) {
        const auto vd = views(g, first, n);
        std::array<TensorView<const Scalar>, N> mine_in;
        for (std::size_t i = 0; i < N; ++i) mine_in[i] = token_rows(in[i], first, n);
        const auto other = layer.make_state(S + 1);
        std::apply([&](const auto&... x) {
          std::apply([&](const auto&... dx) {
            mpi::prefill_backward_into(MPI_COMM_WORLD, layer, rank == 0 ? state : other,
                                       token_rows(Q, first, n), token_rows(keys, first, n),
                                       token_rows(V, first, n), x..., token_rows(dY, first, n),
                                       rank == P - 1 && given_ends ? &fin : nullptr, vd.first,
                                       dx..., initial,
                                       layout, std::span<const Index>(slots), schedule, kept);
          }, vd.second);
        }, mine_in);
      };
      Grads got = make(), again = make(), poisoned = make();
      run(got, K, nullptr);
      const BatchStateGradient<Scalar> first_initial = initial;
      try {  // every rank throws the same, or none does
        run(poisoned, poisoned_K, &workspace);
      } catch (const std::exception&) {
      }
      run(again, K, &workspace);
      CHECK(near_rows(got.Q, whole.Q, Hq, dk, first, n));
      CHECK(near_rows(got.K, whole.K, Hkv, dk, first, n));
      CHECK(near_rows(got.V, whole.V, Hkv, dv, first, n));
      for (std::size_t i = 0; i < N; ++i)
        CHECK(near_rows(got.in[i], whole.in[i], Hkv, in[i].dim(), first, n));
      if (rank == 0)
        for (Index p = 0; p <= S; ++p)
          for (Index h = 0; h < state.heads(); ++h) {
            const auto& a = first_initial.head(p, h);
            const auto& w = whole_initial.head(p, h);
            CHECK(near(a.S.data(), w.S.data(), w.S.size(), double(w.S.cwiseAbs().maxCoeff())));
            if (w.z.size() > 0)
              CHECK(near(a.z.data(), w.z.data(), w.z.size(), double(w.z.cwiseAbs().maxCoeff())));
            CHECK(initial.head(p, h).S == a.S);
            CHECK(initial.head(p, h).z == a.z);
          }
      // Rows of other ranks: not written.
      CHECK(std::all_of(got.Q.begin(), got.Q.begin() + first * Hq * dk, [](Scalar x) { return x == 7; }));
      // Same P and slices: the same bits, with a workspace that served other calls or without.
      CHECK(again.Q == got.Q);
      CHECK(again.K == got.K);
      CHECK(again.V == got.V);
      for (std::size_t i = 0; i < N; ++i) CHECK(again.in[i] == got.in[i]);
      if (schedule == mpi::Schedule::pipeline) pipelined = got;
      if (schedule == mpi::Schedule::automatic) {  // a packed or padded layout's: the pipeline
        CHECK(got.Q == pipelined.Q);
        CHECK(got.K == pipelined.K);
        CHECK(got.V == pipelined.V);
        for (std::size_t i = 0; i < N; ++i) CHECK(got.in[i] == pipelined.in[i]);
      }
    }
  }
}

}  // namespace

TEST_CASE("the layer's sequence-parallel backward over a packed or padded layout equals the "
          "single-process layer backward with that layout", "[mpi][gradients][multihead][layout]") {
  Options delta;
  delta.normalization = Normalization::unnormalized();
  for (const auto kind : {SequenceLayout::Kind::packed, SequenceLayout::Kind::padded})
    for (const bool ends : {true, false}) {
      check_layout(LinearAttention<EluPlusOne, double>(), std::array<std::array<double, 3>, 0>{},
                   kind, ends);
      check_layout(RuleAttention<EluPlusOne, Decay, float>(EluPlusOne{}, Decay(0.9)),
                   std::array<std::array<double, 3>, 0>{}, kind, ends);
      // specs: {channels (0: r, per-channel gates), lo, hi}
      check_layout(RuleAttention<EluPlusOne, Gated, double>(),
                   std::array<std::array<double, 3>, 1>{{{0, -0.3, -0.01}}}, kind, ends);
      check_layout(RuleAttention<L2Normalize, GatedDelta, double>(L2Normalize{}, delta),
                   std::array<std::array<double, 3>, 2>{{{1, 0.1, 0.9}, {1, -0.2, -0.01}}}, kind,
                   ends);
    }
}

TEST_CASE("the layer's sequence-parallel backward equals the single-process layer backward",
          "[mpi][gradients][multihead]") {
  Options delta;
  delta.normalization = Normalization::unnormalized();
  SECTION("additive") { check_layer(LinearAttention<EluPlusOne, double>(), std::array<std::array<double, 3>, 0>{}); }
  SECTION("gated, one gate per token") {
    check_layer(RuleAttention<EluPlusOne, Gated, double>(), std::array<std::array<double, 3>, 1>{{{1, -0.3, -0.01}}});
  }
  SECTION("gated delta") {
    check_layer(RuleAttention<L2Normalize, GatedDelta, double>(L2Normalize{}, delta),
                std::array<std::array<double, 3>, 2>{{{1, 0.1, 0.9}, {1, -0.2, -0.01}}});
  }
  SECTION("gated delta, per-channel log_alpha") {
    check_layer(RuleAttention<L2Normalize, GatedDelta, double>(L2Normalize{}, delta),
                std::array<std::array<double, 3>, 2>{{{1, 0.1, 0.9}, {4, -0.2, -0.01}}});  // r = dk = 4
  }
  SECTION("decay, float") {
    check_layer(RuleAttention<EluPlusOne, Decay, float>(EluPlusOne{}, Decay(0.9)), std::array<std::array<double, 3>, 0>{});
  }
  SECTION("grouped value heads: additive, gated delta") {
    check_layer(LinearAttention<EluPlusOne, double>(), std::array<std::array<double, 3>, 0>{}, 3);
    check_layer(RuleAttention<L2Normalize, GatedDelta, double>(L2Normalize{}, delta),
                std::array<std::array<double, 3>, 2>{{{1, 0.1, 1.9}, {1, -0.2, -0.01}}}, 2);
  }
}

TEST_CASE("the rules' and the layer's sequence-parallel backward: bad input on one rank throws "
          "the same on every rank",
          "[mpi][gradients][rules]") {
  const int rank = world().rank, P = world().size;
  const Index T = 24, d = 4, dv = 3, n = T / P;
  Options options;
  options.normalization = Normalization::unnormalized();
  const RuleAttention<L2Normalize, Delta, double> attn(L2Normalize{}, options);
  const auto qkv = random_qkv<double>(T, d, dv, 4300);
  const RowMatrix<double> dY = random_matrix<double>(T, dv, 4303);
  const auto call = [&](Index beta_rows) {
    const RowMatrix<double> beta = RowMatrix<double>::Constant(beta_rows, 1, 0.5);
    static_cast<void>(mpi::prefill_backward(MPI_COMM_WORLD, attn, attn.make_state(d, dv),
                                            qkv.Q.topRows(n), qkv.K.topRows(n), qkv.V.topRows(n),
                                            beta, dY.topRows(n)));
  };
  // The last rank's beta has a row too few: ShapeError everywhere, naming that rank.
  std::string message;
  try {
    call(rank == P - 1 ? n - 1 : n);
  } catch (const ShapeError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("rank " + std::to_string(P - 1)) && Catch::Contains("beta"));
  CHECK(same_on_every_rank(message));
  CHECK_NOTHROW(call(n));

  // The layer: rank 1's dQ view has a head too few.
  const MultiHeadAttention<RuleAttention<L2Normalize, Delta, double>> layer(HeadConfig{2, 1, d, dv}, attn);
  std::vector<double> q(std::size_t(n * 2 * d), 0.1), k(std::size_t(n * d), 0.2), v(std::size_t(n * dv), 0.3),
      dy(std::size_t(n * 2 * dv), 1.0), b(std::size_t(n), 0.5), dq(q.size()), dk(k.size()), dvv(v.size()),
      db(b.size());
  const auto state = layer.make_state(1);
  BatchStateGradient<double> initial(state);
  const GradientViews<double> grads{TensorView<double>::batch_first(dq.data(), 1, n, rank == 1 ? 1 : 2, d),
                                    TensorView<double>::batch_first(dk.data(), 1, n, 1, d),
                                    TensorView<double>::batch_first(dvv.data(), 1, n, 1, dv)};
  message.clear();
  try {
    mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state,
                               TensorView<const double>::batch_first(q.data(), 1, n, 2, d),
                               TensorView<const double>::batch_first(k.data(), 1, n, 1, d),
                               TensorView<const double>::batch_first(v.data(), 1, n, 1, dv),
                               TensorView<const double>::batch_first(b.data(), 1, n, 1, 1),
                               TensorView<const double>::batch_first(dy.data(), 1, n, 2, dv), nullptr,
                               grads, TensorView<double>::batch_first(db.data(), 1, n, 1, 1), initial);
  } catch (const ShapeError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("rank 1") && Catch::Contains("dQ"));
  CHECK(same_on_every_rank(message));
}

}  // namespace mpi_gradients_test

namespace mpi_gradients_test {

TEST_CASE("the layer's pipelined backward: a failure in the wavefront throws the same on every "
          "rank, and the next call runs",
          "[mpi][gradients][multihead]") {
  const int rank = world().rank, P = world().size;
  const Index n = 5, d = 4, dv = 3, H = 2;
  const MultiHeadAttention<RuleAttention<EluPlusOne, Decay, double>> layer(
      HeadConfig{H, 1, d, dv}, RuleAttention<EluPlusOne, Decay, double>(EluPlusOne{}, Decay(0.9)));
  const RowMatrix<double> q = random_matrix<double>(n, H * d, 7001), k = random_matrix<double>(n, d, 7002),
                          v = random_matrix<double>(n, dv, 7003), dy = random_matrix<double>(n, H * dv, 7004);
  RowMatrix<double> bad_v = v;
  bad_v(2, 1) = std::numeric_limits<double>::infinity();
  std::vector<double> dq(std::size_t(n * H * d)), dk(std::size_t(n * d)), dvv(std::size_t(n * dv));
  const auto state = layer.make_state(1);
  BatchStateGradient<double> initial(state);
  const GradientViews<double> grads{TensorView<double>::batch_first(dq.data(), 1, n, H, d),
                                    TensorView<double>::batch_first(dk.data(), 1, n, 1, d),
                                    TensorView<double>::batch_first(dvv.data(), 1, n, 1, dv)};
  const auto call = [&](const RowMatrix<double>& values) {
    mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state,
                               TensorView<const double>::batch_first(q.data(), 1, n, H, d),
                               TensorView<const double>::batch_first(k.data(), 1, n, 1, d),
                               TensorView<const double>::batch_first(values.data(), 1, n, 1, dv),
                               TensorView<const double>::batch_first(dy.data(), 1, n, H, dv), nullptr,
                               grads, initial, mpi::Schedule::pipeline);
  };
  // The middle rank's (P / 2) slice holds an Inf value: its state after the slice is not
  // finite, in the forward wavefront, after the ranks before it sent their states on.
  for (int failing : {0, P / 2, P - 1}) {
    INFO("failing rank " << failing);
    std::string message;
    try {
      call(rank == failing ? bad_v : v);
    } catch (const std::domain_error& e) {
      message = e.what();
    }
    CHECK_THAT(message, Catch::Contains("not finite") && Catch::Contains("rank " + std::to_string(failing)));
    CHECK(same_on_every_rank(message));
    CHECK_NOTHROW(call(v));  // no message of the failed call is left in flight
  }
  // The backward has no hybrid schedule: invalid_argument on every rank.
  std::string message;
  try {
    mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state,
                               TensorView<const double>::batch_first(q.data(), 1, n, H, d),
                               TensorView<const double>::batch_first(k.data(), 1, n, 1, d),
                               TensorView<const double>::batch_first(v.data(), 1, n, 1, dv),
                               TensorView<const double>::batch_first(dy.data(), 1, n, H, dv), nullptr,
                               grads, initial, mpi::Schedule::hybrid);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("hybrid"));
  CHECK(same_on_every_rank(message));
}

}  // namespace mpi_gradients_test

namespace mpi_gradients_test {

TEST_CASE("the layer's backward over a packed layout: bad input or a layout the ranks disagree on "
          "throws the same on every rank, and the next call runs",
          "[mpi][gradients][multihead][layout]") {
  const int rank = world().rank, P = world().size;
  const Index n = 6, T = n * P, d = 4, dv = 3, H = 2;
  Options options;
  options.normalization = Normalization::unnormalized();
  using Attn = RuleAttention<L2Normalize, Delta, double>;
  const MultiHeadAttention<Attn> layer(HeadConfig{H, 1, d, dv}, Attn(L2Normalize{}, options));
  const RowMatrix<double> q = random_matrix<double>(n, H * d, 7101), k = random_matrix<double>(n, d, 7102),
                          v = random_matrix<double>(n, dv, 7103), dy = random_matrix<double>(n, H * dv, 7104);
  std::vector<double> dq(std::size_t(n * H * d)), dk(std::size_t(n * d)), dvv(std::size_t(n * dv)),
      db(static_cast<std::size_t>(n));
  const GradientViews<double> grads{TensorView<double>::batch_first(dq.data(), 1, n, H, d),
                                    TensorView<double>::batch_first(dk.data(), 1, n, 1, d),
                                    TensorView<double>::batch_first(dvv.data(), 1, n, 1, dv)};
  const auto call = [&](const std::vector<double>& beta, const std::vector<Index>& offsets) {
    const auto state = layer.make_state(Index(offsets.size()) - 1);
    BatchStateGradient<double> initial(state);
    mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state,
                               TensorView<const double>::batch_first(q.data(), 1, n, H, d),
                               TensorView<const double>::batch_first(k.data(), 1, n, 1, d),
                               TensorView<const double>::batch_first(v.data(), 1, n, 1, dv),
                               TensorView<const double>::batch_first(beta.data(), 1, n, 1, 1),
                               TensorView<const double>::batch_first(dy.data(), 1, n, H, dv), nullptr,
                               grads, TensorView<double>::batch_first(db.data(), 1, n, 1, 1), initial,
                               SequenceLayout::packed(offsets), mpi::Schedule::pipeline);
  };
  const std::vector<double> good(std::size_t(n), 0.5);
  std::vector<double> bad = good;
  bad[4] = 2.5;  // beyond [0, 2]
  // Documents of 3 rows lie on one rank each (no forward before the backward wavefront);
  // documents of 4 rows cross into the next rank.
  for (const Index length : {Index{3}, Index{4}}) {
    std::vector<Index> offsets;
    for (Index at = 0; at < T; at += length) offsets.push_back(at);
    offsets.push_back(T);
    for (int failing : {0, P / 2, P - 1}) {
      INFO("documents of " << length << " rows, failing rank " << failing);
      std::string message;
      try {
        call(rank == failing ? bad : good, offsets);
      } catch (const std::invalid_argument& e) {
        message = e.what();
      }
      CHECK_THAT(message, Catch::Contains("beta") && Catch::Contains("rank " + std::to_string(failing)));
      CHECK(same_on_every_rank(message));
      CHECK_NOTHROW(call(good, offsets));  // no message of the failed call is left in flight
    }
  }
  // Offsets that do not end at T: ShapeError on every rank; rank 1's other offsets: a mismatch.
  std::string message;
  try {
    call(good, {0, 2, T - 1});
  } catch (const ShapeError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("offsets"));
  CHECK(same_on_every_rank(message));
  message.clear();
  try {
    call(good, rank == 1 ? std::vector<Index>{0, 3, T} : std::vector<Index>{0, 2, T});
  } catch (const mpi::RankMismatchError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("layout"));
  CHECK(same_on_every_rank(message));
  CHECK_NOTHROW(call(good, {0, 2, T}));
}

}  // namespace mpi_gradients_test
