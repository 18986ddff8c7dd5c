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
///                  = (I - beta_t kf kf^T) S_{t-1} + beta_t kf v_t^T,   beta_t in [0, 2]
///                (DeltaNet; use unit-norm keys, e.g. the L2Normalize feature map, so that
///                I - beta kf kf^T has eigenvalues 1 and 1 - beta in [-1, 1] and never
///                amplifies S; beta > 1 gives the negative eigenvalues of Grazzi et al. 2024)
///   GatedDelta   S_t = alpha_t (I - beta_t kf kf^T) S_{t-1} + beta_t kf v_t^T,
///                alpha_t = exp(log_alpha_t) in (0, 1], beta_t in [0, 2] (Gated DeltaNet);
///                or one alpha per feature channel (Kimi Delta Attention):
///                S_t = (I - beta_t kf kf^T) diag(alpha_t) S_{t-1} + beta_t kf v_t^T
///
/// Additive, Decay and Gated states are sums of kf v^T with positive weights, and z is decayed
/// the same way, so the normalized read y = qf^T S / qf^T z (linear attention's weighted
/// average, Katharopoulos et al. 2020) stays available. Delta and GatedDelta states are not: the delta write subtracts, so no
/// consistent z exists and only the unnormalized read y = S^T qf is offered (RuleAttention
/// rejects a dividing Normalization with std::invalid_argument, and their state has no z()).
///
/// A rule is a small value type checked by the WriteRule concept. Per-token inputs (gates,
/// betas) are not part of the rule; they are passed with each call (see RuleAttention).

#include <linattn/types.hpp>

#include <concepts>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace linattn {

/// Which update a write rule performs; RuleAttention dispatches on it.
enum class WriteKind { additive, decay, gated, delta, gated_delta };

/// A write-rule policy: `static constexpr WriteKind kind`, `static constexpr bool
/// keeps_normalizer` (true iff the normalized read is defined), `static constexpr bool
/// has_full_form` (true iff a non-causal read of all keys is defined), `static constexpr int
/// token_inputs` (per-token arrays each call needs), a `name` and `double parameter() const`
/// (the rule's constant, recorded in its states' identity; 0 when it has none).
template <class R>
concept WriteRule = std::copy_constructible<R> && requires(const R& rule) {
  { std::integral_constant<WriteKind, R::kind>::value } -> std::convertible_to<WriteKind>;
  { std::bool_constant<R::keeps_normalizer>::value } -> std::convertible_to<bool>;
  { std::bool_constant<R::has_full_form>::value } -> std::convertible_to<bool>;
  { std::integral_constant<int, R::token_inputs>::value } -> std::convertible_to<int>;
  { R::name } -> std::convertible_to<const char*>;
  { rule.parameter() } -> std::convertible_to<double>;
};

/// S += kf v^T, z += kf: the rule of Katharopoulos et al. (2020) and LinearAttention's
/// behaviour. No per-token input.
struct Additive {
  static constexpr WriteKind kind = WriteKind::additive;
  static constexpr bool keeps_normalizer = true;
  static constexpr bool has_full_form = true;
  static constexpr int token_inputs = 0;
  static constexpr const char* name = "additive";
  [[nodiscard]] static constexpr double parameter() noexcept { return 0; }
};

/// S = gamma S + kf v^T, z = gamma z + kf with one fixed gamma in (0, 1] (RetNet retention).
/// Token j's weight in the read at token i is gamma^(i-j) (qf_i . kf_j). gamma = 1 is Additive.
/// No per-token input. Throws std::invalid_argument unless 0 < gamma <= 1.
class Decay {
 public:
  static constexpr WriteKind kind = WriteKind::decay;
  static constexpr bool keeps_normalizer = true;
  static constexpr bool has_full_form = false;
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
  [[nodiscard]] double parameter() const noexcept { return gamma_; }

 private:
  double gamma_;
};

/// S = diag(g_t) S + kf v^T, z = g_t .* z + kf with per-token gates given as log_g_t <= 0
/// (finite). Each call takes the log-gates as a T x 1 matrix/vector (one scalar gate per
/// token) or a T x r matrix (one gate per feature channel). log_g = 0 everywhere is Additive.
struct Gated {
  static constexpr WriteKind kind = WriteKind::gated;
  static constexpr bool keeps_normalizer = true;
  static constexpr bool has_full_form = false;
  static constexpr int token_inputs = 1;
  static constexpr const char* name = "gated";
  [[nodiscard]] static constexpr double parameter() noexcept { return 0; }
};

/// S = S + beta_t kf (v_t - S^T kf)^T (error-correcting write). Each call takes beta, a length-T
/// vector in [0, 2]. beta_t = 0 leaves the state unchanged; with |kf| = 1 and beta_t = 1 the
/// readout for kf becomes exactly v_t; with beta_t in (1, 2] the old readout's sign flips
/// (eigenvalue 1 - beta_t < 0: DeltaNet's negative eigenvalues, for state tracking such as
/// parity). Unnormalized read only.
struct Delta {
  static constexpr WriteKind kind = WriteKind::delta;
  static constexpr bool keeps_normalizer = false;
  static constexpr bool has_full_form = false;
  static constexpr int token_inputs = 1;
  static constexpr const char* name = "delta";
  [[nodiscard]] static constexpr double parameter() noexcept { return 0; }
};

/// S = alpha_t (I - beta_t kf kf^T) S + beta_t kf v_t^T. Each call takes beta (length T, in
/// [0, 2]) then log_alpha (<= 0 and finite): T x 1 (or a length-T vector), one gate per token;
/// or T x r, one gate per feature channel, S = (I - beta_t kf kf^T) diag(alpha_t) S +
/// beta_t kf v_t^T (Kimi Delta Attention; the same rule when the channels are equal). A step
/// takes log_alpha as a number or a length-r vector. Every path takes per-channel log_alpha:
/// RuleAttention's calls, the gradients and saved forwards, the multi-head layer
/// ([B, T, H_v, r] views) and the sequence-parallel (MPI) calls. Unnormalized read only.
struct GatedDelta {
  static constexpr WriteKind kind = WriteKind::gated_delta;
  static constexpr bool keeps_normalizer = false;
  static constexpr bool has_full_form = false;
  static constexpr int token_inputs = 2;
  static constexpr const char* name = "gated_delta";
  [[nodiscard]] static constexpr double parameter() noexcept { return 0; }
};

}  // namespace linattn
