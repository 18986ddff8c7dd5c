#pragma once
// StateCore: what every recurrent state holds whatever its write rule (S, z, the token count,
// the dims, and the identity of the attention that made it) and the accessors over it;
// AttentionState and RuleState add their own scratch.

#include <linattn/detail/eigen_utils.hpp>
#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace linattn::detail {

/// What made a state: the feature map (its name, and for maps with parameters their
/// fingerprint, e.g. the random draw) and the write rule with its parameter (Decay's gamma).
/// A state stepped by an attention of another identity would mix two kernels in one sum, so
/// every call compares it (StateMismatchError) and a saved state records it.
struct StateIdentity {
  const char* map_name = "user";
  std::uint64_t map_fingerprint = 0;
  const char* rule_name = "additive";
  double rule_parameter = 0;

  friend bool operator==(const StateIdentity& a, const StateIdentity& b) noexcept {
    return std::strcmp(a.map_name, b.map_name) == 0 && a.map_fingerprint == b.map_fingerprint &&
           std::strcmp(a.rule_name, b.rule_name) == 0 && a.rule_parameter == b.rule_parameter;
  }

  /// "feature map elu_plus_one (fingerprint 0), rule decay(0.9)", for messages.
  [[nodiscard]] std::string describe() const {
    std::ostringstream os;
    os << "feature map " << map_name << " (fingerprint " << map_fingerprint << "), rule "
       << rule_name;
    if (rule_parameter != 0) os << "(" << rule_parameter << ")";
    return os.str();
  }
};

/// The largest token count a state accepts: a call that would pass it throws ShapeError, and a
/// restored count above it is refused, so a count can never overflow.
inline constexpr Index kMaxTokens = std::numeric_limits<Index>::max() / 2;

/// Scratch a decode step needs, sized once with the state and reused, so that a step never
/// allocates; never part of the state's value.
template <class Scalar>
struct StepScratch {
  StepScratch() = default;
  StepScratch(Index r, Index dk, Index dv)
      : query_row(1, dk), key_row(1, dk), value_row(1, dv), query_features(1, r),
        key_features(1, r), gates(1, r), z_next(r), prediction(1, dv) {}
  RowMatrix<Scalar> query_row, key_row, value_row;  // copies of inputs that are not contiguous
  RowMatrix<Scalar> query_features, key_features;   // phi(q), phi(k)
  RowMatrix<Scalar> gates;                          // a gated rule's exp(log-gates)
  ColVector<Scalar> z_next;                         // z after the token, before it is committed
  RowVector<Scalar> prediction;                     // the delta rule's S^T phi(k)
};

/// The library's access to a state's internals (the paths and the state format); the states
/// befriend it, so their own public interface stays read-only.
struct StateAccess {
  template <class St> static auto& S(St& s) noexcept { return s.S_; }
  template <class St> static auto& z(St& s) noexcept { return s.z_; }
  template <class St> static auto& tokens(St& s) noexcept { return s.tokens_; }
  template <class St> static auto& scratch(St& s) noexcept { return s.scratch_; }
  template <class St> static auto& pending(St& s) noexcept { return s.pending_; }
  template <class St> static auto& log_scale(St& s) noexcept { return s.log_scale_; }
  template <class St> static auto& scores(St& s) noexcept { return s.scores_; }
};

template <class Scalar>
class StateCore {
 public:
  using scalar_type = Scalar;

  /// S: r x dv, row-major; the sum of phi(k) v^T over the absorbed tokens as the write rule
  /// accumulates it.
  [[nodiscard]] const RowMatrix<Scalar>& S() const noexcept { return S_; }

  /// Number of tokens absorbed since the state was made or reset.
  [[nodiscard]] Index tokens() const noexcept { return tokens_; }

  [[nodiscard]] Index feature_dim() const noexcept { return S_.rows(); }
  [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
  [[nodiscard]] Index value_dim() const noexcept { return S_.cols(); }

  /// Scalars that persist between tokens: r*dv for S, plus r where z is kept.
  [[nodiscard]] Index scalar_count() const noexcept { return S_.size() + z_.size(); }

  /// The feature map and write rule this state was made for (see StateIdentity).
  [[nodiscard]] const StateIdentity& identity() const noexcept { return identity_; }

  /// Throws ShapeError unless this state fits (r, dk, dv).
  void check_shape(Index r, Index dk, Index dv) const {
    if (feature_dim() != r || key_dim() != dk || value_dim() != dv)
      throw_shape_error("state has r=", feature_dim(), " dk=", key_dim(), " dv=", value_dim(),
                        " but the inputs need r=", r, " dk=", dk, " dv=", dv);
  }

  /// Throws StateMismatchError unless this state was made for `identity`.
  void check_identity(const StateIdentity& identity) const {
    if (!(identity_ == identity))
      throw_error<StateMismatchError>("the state was made for ", identity_.describe(),
                                      ", this attention uses ", identity.describe(),
                                      "; make the state with this attention's make_state()");
  }

  /// Throws ShapeError or StateMismatchError unless `other` has this state's dims and identity.
  void check_like(const StateCore& other) const {
    other.check_shape(feature_dim(), key_dim(), value_dim());
    other.check_identity(identity_);
  }

  /// Throws ShapeError unless `n` more tokens keep the count within kMaxTokens.
  void check_room(Index n) const {
    if (n > kMaxTokens - tokens_)
      throw_shape_error("the state holds ", tokens_, " tokens and cannot take ", n,
                        " more (at most ", kMaxTokens, ")");
  }

 protected:
  friend struct StateAccess;

  StateCore() = default;
  /// Zero S (r x dv) and, when `keeps_z`, zero z (r). Throws ShapeError unless r, dk, dv >= 1
  /// and r * dv fits an Index, before anything is sized with them.
  StateCore(Index r, Index dk, Index dv, bool keeps_z, const StateIdentity& identity)
      : S_(RowMatrix<Scalar>::Zero(checked_feature_dim(r, dk, dv), dv)),
        z_(ColVector<Scalar>::Zero(keeps_z ? r : 0)),
        key_dim_(dk),
        identity_(identity),
        scratch_(r, dk, dv) {}

  /// Checks and copies a caller's S (r x dv), z (r, for states that keep one) and token count.
  template <class DS, class DZ>
  void assign_sums(const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DZ>& z, Index tokens) {
    if (S.rows() != S_.rows() || S.cols() != S_.cols() ||
        (z_.size() > 0 && !((z.rows() == 1 || z.cols() == 1) && z.size() == z_.size())) ||
        (z_.size() == 0 && z.size() != 0))
      throw_shape_error("assign() needs S ", S_.rows(), "x", S_.cols(), " and z of length ",
                        z_.size(), ", got S ", shape_of(S), " and z ", shape_of(z));
    if (tokens < 0 || tokens > kMaxTokens)
      throw_shape_error("assign() needs a token count in [0, ", kMaxTokens, "], got ", tokens);
    // Checked after the cast to the state's type: a finite double beyond float's range would
    // otherwise enter a float state as Inf.
    const bool finite = [&] {
      if constexpr (std::is_same_v<typename DS::Scalar, Scalar> &&
                    std::is_same_v<typename DZ::Scalar, Scalar>)
        return all_finite(S) && all_finite(z);  // in place, as packets
      else
        return all_finite(S.template cast<Scalar>()) && all_finite(z.template cast<Scalar>());
    }();
    if (!finite)
      throw std::invalid_argument(
          "linattn: assign() needs S and z finite in the state's scalar type");
    S_ = S.template cast<Scalar>();
    if (z_.size() > 0) z_ = z.reshaped().template cast<Scalar>();
    tokens_ = tokens;
  }

  /// S, z and the token count back to zero; keeps the allocations.
  void reset_sums() noexcept {
    S_.setZero();
    z_.setZero();
    tokens_ = 0;
  }

  RowMatrix<Scalar> S_;
  ColVector<Scalar> z_;
  Index tokens_ = 0;
  Index key_dim_ = 0;
  StateIdentity identity_{};
  StepScratch<Scalar> scratch_;

 private:
  static Index checked_feature_dim(Index r, Index dk, Index dv) {
    if (r < 1 || dk < 1 || dv < 1)
      throw_shape_error("a state needs positive dimensions, got r=", r, " dk=", dk, " dv=", dv);
    static_cast<void>(checked_product(r, dv, "state size r x dv"));
    return r;
  }
};

}  // namespace linattn::detail
