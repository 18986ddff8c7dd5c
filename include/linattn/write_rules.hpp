#pragma once
/// \file write_rules.hpp
/// Write rules: how one token changes the recurrent state. A second policy axis, independent
/// of the feature map phi. Features kf = phi(k), qf = phi(q) (length r); S is r x dv.
///
///   Additive     S_t = S_{t-1} + kf v^T,                 z_t = z_{t-1} + kf
///   Decay        S_t = gamma S_{t-1} + kf v^T,           z_t = gamma z_{t-1} + kf
///                (one fixed gamma in (0, 1] per head; RetNet-style retention)
///   Gated        S_t = diag(g_t) S_{t-1} + kf v^T,       z_t = g_t .* z_{t-1} + kf
///                (data-dependent gates g_t = exp(log_g_t) per token, one scalar or one per
///                feature channel, given in log space, log_g_t <= 0; GLA / Mamba2-style)
///   Delta        S_t = S_{t-1} + beta_t kf (v_t - S_{t-1}^T kf)^T
///                  = (I - beta_t kf kf^T) S_{t-1} + beta_t kf v_t^T,   beta_t in [0, 1]
///                (DeltaNet; use unit-norm keys, e.g. the L2Normalize feature map, so that
///                I - beta kf kf^T is a contraction)
///   GatedDelta   S_t = alpha_t (I - beta_t kf kf^T) S_{t-1} + beta_t kf v_t^T,
///                alpha_t = exp(log_alpha_t) in (0, 1], beta_t in [0, 1] (Gated DeltaNet)
///
/// Additive, Decay and Gated states are sums of kf v^T with positive weights, and z is decayed
/// the same way, so the normalized read y = qf^T S / qf^T z (the articles' weighted average)
/// stays available. Delta and GatedDelta states are not: the delta write subtracts, so no
/// consistent z exists and only the unnormalized read y = S^T qf is offered (RuleAttention
/// rejects a dividing Normalization with std::invalid_argument, and their state has no z()).
///
/// A rule is a small value type checked by the WriteRule concept. Per-token inputs (gates,
/// betas) are not part of the rule; they are passed with each call (see RuleAttention).

#include <linattn/types.hpp>

#include <cmath>
#include <concepts>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace linattn {

/// Which update a write rule performs; RuleAttention dispatches on it.
enum class WriteKind { additive, decay, gated, delta, gated_delta };

/// A write-rule policy: `static constexpr WriteKind kind`, `static constexpr bool
/// keeps_normalizer` (true iff the normalized read is defined), `static constexpr int
/// token_inputs` (per-token arrays each call needs) and a `name`.
template <class R>
concept WriteRule = std::copy_constructible<R> && requires {
  { std::integral_constant<WriteKind, R::kind>::value } -> std::convertible_to<WriteKind>;
  { std::bool_constant<R::keeps_normalizer>::value } -> std::convertible_to<bool>;
  { std::integral_constant<int, R::token_inputs>::value } -> std::convertible_to<int>;
  { R::name } -> std::convertible_to<const char*>;
};

/// S += kf v^T, z += kf: the articles' rule and LinearAttention's behaviour. No per-token input.
struct Additive {
  static constexpr WriteKind kind = WriteKind::additive;
  static constexpr bool keeps_normalizer = true;
  static constexpr int token_inputs = 0;
  static constexpr const char* name = "additive";
};

/// S = gamma S + kf v^T, z = gamma z + kf with one fixed gamma in (0, 1] (RetNet retention).
/// Token j's weight in the read at token i is gamma^(i-j) (qf_i . kf_j). gamma = 1 is Additive.
/// No per-token input. Throws std::invalid_argument unless 0 < gamma <= 1.
class Decay {
 public:
  static constexpr WriteKind kind = WriteKind::decay;
  static constexpr bool keeps_normalizer = true;
  static constexpr int token_inputs = 0;
  static constexpr const char* name = "decay";

  explicit Decay(double gamma) : gamma_(gamma) {
    if (!(gamma > 0.0 && gamma <= 1.0)) {
      std::ostringstream os;
      os << "linattn: Decay needs gamma in (0, 1], got " << gamma;
      throw std::invalid_argument(os.str());
    }
  }
  [[nodiscard]] double gamma() const noexcept { return gamma_; }

 private:
  double gamma_;
};

/// S = diag(g_t) S + kf v^T, z = g_t .* z + kf with per-token gates given as log_g_t <= 0
/// (finite). Each call takes the log-gates as a T x 1 matrix/vector (one scalar gate per
/// token) or a T x r matrix (one gate per feature channel). log_g = 0 everywhere is Additive.
struct Gated {
  static constexpr WriteKind kind = WriteKind::gated;
  static constexpr bool keeps_normalizer = true;
  static constexpr int token_inputs = 1;
  static constexpr const char* name = "gated";
};

/// S = S + beta_t kf (v_t - S^T kf)^T (error-correcting write). Each call takes beta, a length-T
/// vector in [0, 1]. beta_t = 0 leaves the state unchanged; with |kf| = 1 and beta_t = 1 the
/// readout for kf becomes exactly v_t. Unnormalized read only.
struct Delta {
  static constexpr WriteKind kind = WriteKind::delta;
  static constexpr bool keeps_normalizer = false;
  static constexpr int token_inputs = 1;
  static constexpr const char* name = "delta";
};

/// S = alpha_t (I - beta_t kf kf^T) S + beta_t kf v_t^T. Each call takes beta (length T, in
/// [0, 1]) then log_alpha (length T, <= 0 and finite). Unnormalized read only.
struct GatedDelta {
  static constexpr WriteKind kind = WriteKind::gated_delta;
  static constexpr bool keeps_normalizer = false;
  static constexpr int token_inputs = 2;
  static constexpr const char* name = "gated_delta";
};

namespace detail {

/// Throws std::invalid_argument unless every entry of `beta` is in [0, 1] (NaN fails).
template <class Derived>
void check_betas(const Derived& beta) {
  for (Index t = 0; t < beta.size(); ++t) {
    const double b = static_cast<double>(beta.data()[t]);
    if (!(b >= 0.0 && b <= 1.0)) {
      std::ostringstream os;
      os << "linattn: beta must lie in [0, 1], got " << b << " at token " << t;
      throw std::invalid_argument(os.str());
    }
  }
}

/// Throws std::invalid_argument unless every log-gate is finite and <= 0 (a gate in (0, 1]).
template <class Derived>
void check_log_gates(const Derived& log_gate, const char* what) {
  for (Index t = 0; t < log_gate.rows(); ++t)
    for (Index n = 0; n < log_gate.cols(); ++n) {
      const double g = static_cast<double>(log_gate(t, n));
      if (!(g <= 0.0) || !std::isfinite(g)) {
        std::ostringstream os;
        os << "linattn: " << what << " must be finite and <= 0 (a gate in (0, 1]), got " << g
           << " at token " << t << ", channel " << n;
        throw std::invalid_argument(os.str());
      }
    }
}

}  // namespace detail
}  // namespace linattn
