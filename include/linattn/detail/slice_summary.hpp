#pragma once
// The summary of a slice of a sequence and the scan that combines summaries in order
// (REFERENCES.md section 8). Every write rule maps the state affinely over a slice p,
//   S -> A_p S + B_p,   z -> A_p z + b_p   (z only for the rules that keep it),
// with B_p, b_p the slice's state run from zero and A_p the slice run from the identity with
// zero values:
//   Additive    A_p = I                                  (nothing to send)
//   Decay       A_p = a_p I,       a_p = gamma^T_p         (one scalar)
//   Gated       A_p = diag(a_p),   a_p = exp(sum_t log g_t) per channel  (r scalars; scalar
//               gates send r equal values, so ranks may mix T x 1 and T x r gates)
//   Delta       A_p = prod_t (I - beta_t kf_t kf_t^T), latest factor on the left  (r x r)
//   GatedDelta  A_p = prod_t alpha_t (I - beta_t kf_t kf_t^T)                      (r x r)
//               per-channel log_alpha: A_p = prod_t (I - beta_t kf_t kf_t^T) diag(alpha_t)
// The carried state of slice p is the composition of the maps of slices 0..p-1 applied to the
// state before slice 0. CarryScan applies them one at a time in rank order, so the result
// depends only on the summaries and their order, never on how they travelled.
//
// Backward: the state gradient flows the other way, dS_p = A_p^T dS_{p+1} (+ the slice's own
// contribution); carry_back() is that transposed step on the same packed summary.
//
// Nothing here depends on MPI: linattn/mpi.hpp moves the packed summaries between ranks.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <cmath>
#include <type_traits>

namespace linattn::detail {

/// The form of A_p for a write rule.
enum class CarryMap { identity, scalar, diagonal, matrix };

template <class Rule>
constexpr CarryMap carry_map_of() {
  switch (Rule::kind) {
    case WriteKind::additive:
      return CarryMap::identity;
    case WriteKind::decay:
      return CarryMap::scalar;
    case WriteKind::gated:
      return CarryMap::diagonal;
    case WriteKind::delta:
    case WriteKind::gated_delta:
      break;
  }
  return CarryMap::matrix;
}

/// Where each part of one head's packed summary lies: [B (r x dv, row-major) | b (r, rules that
/// keep z) | A (0, 1, r or r x r scalars, row-major)].
struct SummaryLayout {
  Index r = 0, dv = 0;
  bool keeps_z = false;
  CarryMap map = CarryMap::identity;

  template <class Rule>
  static SummaryLayout of(Index r, Index dv) {
    return {r, dv, Rule::keeps_normalizer, carry_map_of<Rule>()};
  }
  [[nodiscard]] Index z_offset() const noexcept { return r * dv; }
  [[nodiscard]] Index a_offset() const noexcept { return r * dv + (keeps_z ? r : 0); }
  [[nodiscard]] Index a_size() const noexcept {
    switch (map) {
      case CarryMap::identity:
        return 0;
      case CarryMap::scalar:
        return 1;
      case CarryMap::diagonal:
        return r;
      case CarryMap::matrix:
        break;
    }
    return r * r;
  }
  /// Scalars of one head's summary: r dv + r (Additive), + 1 (Decay), + 2 r in all (Gated),
  /// r dv + r r (Delta, GatedDelta).
  [[nodiscard]] Index scalars() const noexcept { return a_offset() + a_size(); }
};

/// One packed summary seen through its layout.
template <class Scalar>
struct SummaryRef {
  using MatrixMap = Eigen::Map<RowMatrix<Scalar>>;
  using VectorMap = Eigen::Map<ColVector<Scalar>>;
  Scalar* data;
  SummaryLayout layout;

  [[nodiscard]] MatrixMap B() const { return MatrixMap(data, layout.r, layout.dv); }
  [[nodiscard]] VectorMap b() const {
    return VectorMap(data + layout.z_offset(), layout.keeps_z ? layout.r : 0);
  }
  /// A's scalars: 1 (scalar), r (diagonal) or r x r row-major (matrix).
  [[nodiscard]] VectorMap a() const { return VectorMap(data + layout.a_offset(), layout.a_size()); }
  [[nodiscard]] MatrixMap A() const {
    return MatrixMap(data + layout.a_offset(), layout.map == CarryMap::matrix ? layout.r : 0,
                     layout.map == CarryMap::matrix ? layout.r : 0);
  }
};

/// The carried state of one head through a sequence of slices: start() with the state before
/// the first slice, then advance() over each slice's summary in order. Scratch is sized once.
/// Cost per step: O(r dv) (O(r^2 dv) for the delta rules).
template <class Scalar>
class CarryScan {
 public:
  explicit CarryScan(const SummaryLayout& layout)
      : layout_(layout),
        S_(RowMatrix<Scalar>::Zero(layout.r, layout.dv)),
        z_(ColVector<Scalar>::Zero(layout.keeps_z ? layout.r : 0)),
        product_(layout.map == CarryMap::matrix ? layout.r : 0, layout.dv) {}

  /// The state before the first slice; `known_zero` when it is exactly zero (then A of the
  /// first non-empty slice is never read, so a slice that starts from zero may leave it unset).
  template <class DS, class DZ>
  void start(const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DZ>& z, bool known_zero) {
    known_zero_ = known_zero;
    if (known_zero) {
      S_.setZero();
      z_.setZero();
    } else {
      S_ = S;
      if (layout_.keeps_z) z_ = z;
    }
  }

  /// S = A S + B and z = A z + b for the summary of a slice of `tokens` tokens; an empty slice
  /// is the identity map and changes nothing (its summary is not read).
  void advance(const Scalar* summary, Index tokens) {
    if (tokens == 0) return;
    const SummaryRef<Scalar> s{const_cast<Scalar*>(summary), layout_};
    if (known_zero_) {
      S_ = s.B();
      if (layout_.keeps_z) z_ = s.b();
      known_zero_ = false;
      return;
    }
    switch (layout_.map) {
      case CarryMap::identity:
        break;
      case CarryMap::scalar:
        S_ *= s.a()(0);
        z_ *= s.a()(0);
        break;
      case CarryMap::diagonal:
        S_ = s.a().asDiagonal() * S_;
        z_ = z_.cwiseProduct(s.a());
        break;
      case CarryMap::matrix:
        product_.noalias() = s.A() * S_;
        S_.swap(product_);
        break;
    }
    S_ += s.B();
    if (layout_.keeps_z) z_ += s.b();
  }

  [[nodiscard]] const RowMatrix<Scalar>& S() const noexcept { return S_; }
  [[nodiscard]] const ColVector<Scalar>& z() const noexcept { return z_; }
  /// Whether the carried state is exactly zero (started from zero, only empty slices since).
  [[nodiscard]] bool known_zero() const noexcept { return known_zero_; }

 private:
  SummaryLayout layout_;
  RowMatrix<Scalar> S_;
  ColVector<Scalar> z_;
  RowMatrix<Scalar> product_;
  bool known_zero_ = true;
};

/// The transposed step of the scan, for the reverse scan of the state gradient:
/// dS = A^T dS and dz = A^T dz (A symmetric except for the delta rules). `scratch` is r x dv.
/// O(r dv) (O(r^2 dv) for the delta rules).
template <class Scalar>
void carry_back(const Scalar* summary, const SummaryLayout& layout, RowMatrix<Scalar>& dS,
                ColVector<Scalar>& dz, RowMatrix<Scalar>& scratch) {
  const SummaryRef<Scalar> s{const_cast<Scalar*>(summary), layout};
  switch (layout.map) {
    case CarryMap::identity:
      break;
    case CarryMap::scalar:
      dS *= s.a()(0);
      dz *= s.a()(0);
      break;
    case CarryMap::diagonal:
      dS = s.a().asDiagonal() * dS;
      dz = dz.cwiseProduct(s.a());
      break;
    case CarryMap::matrix:
      scratch.noalias() = s.A().transpose() * dS;
      dS.swap(scratch);
      break;
  }
}

/// The decay of a decayed or gated slice (the A of its summary): a = exp(sum_t log g_t), the
/// sum taken in double so that its rounding is negligible, one value per channel where the
/// log-gates are per channel (`log_gate(t, c)`, gate_cols = r) and the same value in every
/// entry of `a` where they are one per token (gate_cols = 1) or constant (Decay: `log_gate`
/// is not read and every token's log-gate is `constant_log_gate`, per_token false). O(T r).
template <class LogGate, class Out>
void slice_decay(const LogGate& log_gate, Index tokens, Index gate_cols, bool per_token,
                 double constant_log_gate, Out&& a) {
  using Scalar = typename std::decay_t<Out>::Scalar;
  if (!per_token || gate_cols == 1) {
    double sum = static_cast<double>(tokens) * constant_log_gate;
    if (per_token) {
      sum = 0;
      for (Index t = 0; t < tokens; ++t) sum += static_cast<double>(log_gate(t, 0));
    }
    a.setConstant(static_cast<Scalar>(std::exp(sum)));
    return;
  }
  for (Index c = 0; c < a.size(); ++c) {
    double sum = 0;
    for (Index t = 0; t < tokens; ++t) sum += static_cast<double>(log_gate(t, c));
    a(c) = static_cast<Scalar>(std::exp(sum));
  }
}

}  // namespace linattn::detail
