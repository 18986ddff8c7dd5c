#pragma once
/// \file attention.hpp
/// RuleAttention<Phi, Rule, Scalar>: linear attention with feature map Phi and write rule Rule
/// (linattn/write_rules.hpp) in precision Scalar; LinearAttention<Phi, Scalar> is the additive
/// rule, linear attention as in Katharopoulos et al. (2020). A parallel path (full or causal, in
/// chunks) and a recurrent path (token by token through the state) agree to rounding.
///
/// Math for the additive rule (rows are tokens, phi applied row-wise, sums over keys j):
///   full:    y_i = sum_j (phi(q_i)^T phi(k_j)) v_j / sum_j phi(q_i)^T phi(k_j)
///                = phi(q_i)^T (phi(K)^T V) / phi(q_i)^T (phi(K)^T 1)
///   causal:  the same with j <= i, i.e. through the state S_t = S_{t-1} + phi(k_t) v_t^T,
///            z_t = z_{t-1} + phi(k_t), y_t = phi(q_t)^T S_t / phi(q_t)^T z_t.
/// This is exact for the kernel phi(q)^T phi(k); it is not softmax attention. Other rules
/// change the write (write_rules.hpp) and are causal only.
///
/// Every entry point takes its arguments in one order:
///   [state,] Q, K, V, per-token inputs of the rule..., [mask,] [output]
/// Per-token inputs: none (Additive, Decay), log-gates (Gated: T x 1 or T x r), beta (Delta:
/// length T), beta then log_alpha (GatedDelta: T x 1 or T x r). They are read in place where
/// they hold Scalar with direct access and validated before any state changes
/// (std::invalid_argument naming the token). Inputs are any Eigen dense expressions, read in
/// place; outputs are row-major Tq x dv (a block or strided Map of a larger buffer is fine).
/// Shape errors throw ShapeError;
/// a state made by another attention throws StateMismatchError; denominators go through the
/// Normalization policy (default: DenominatorError). All members are const and the object
/// holds no scratch: one attention can serve many threads, each with its own states.
///
/// Complexity for T tokens, key dim dk, feature dim r, value dim dv, chunk size C:
///   parallel, full:    O((Tq + Tk) r dv); never forms Tq x Tk.
///   parallel, causal / prefill:  O(T C (r + dv) + T r dv); never forms T x T.
///   recurrent / step:  O(r dv) per token; the state is r dv + r scalars.
/// Grouped calls (a span of G query heads over one K, V and one state) pay the key side and
/// the state update once and the reads G times.

#include <linattn/detail/additive_paths.hpp>
#include <linattn/detail/attention_calls.hpp>
#include <linattn/detail/head_group.hpp>
#include <linattn/detail/rule_paths.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/options.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <concepts>
#include <span>
#include <stdexcept>
#include <utility>

namespace linattn {

/// Linear attention with feature map Phi, write rule Rule and precision Scalar (see the file
/// comment for the math, the argument order and the complexity).
template <class Phi, class Rule = Additive, class Scalar = float>
class RuleAttention : private detail::AttentionCalls<RuleAttention<Phi, Rule, Scalar>> {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  static_assert(FeatureMap<Phi, Scalar>,
                "Phi is not a feature map: it needs `static constexpr bool strictly_positive`, "
                "`Index feature_dim(Index d) const` and `void apply(const In& x, Out& out) "
                "const` (see linattn/feature_maps.hpp)");
  static_assert(WriteRule<Rule>,
                "Rule is not a write rule: use Additive, Decay, Gated, Delta or GatedDelta "
                "(see linattn/write_rules.hpp)");
  using Calls = detail::AttentionCalls<RuleAttention>;
  friend Calls;

 public:
  using feature_map_type = Phi;
  using rule_type = Rule;
  using scalar_type = Scalar;
  /// AttentionState for Additive, RuleState otherwise (state_t).
  using State = state_t<Rule, Scalar>;
  using Output = RowMatrix<Scalar>;
  using OutputRef = Eigen::Ref<RowMatrix<Scalar>>;

  /// Whether the map works in a shifted log domain (random features under Additive: the state
  /// keeps S and z scaled by a running maximum). Such states cannot be shared by query heads.
  static constexpr bool log_scaled = Rule::kind == WriteKind::additive && LogScaledFeatureMap<Phi, Scalar>;

  /// Strict normalization for rules that keep z; the unnormalized read for the delta rules.
  [[nodiscard]] static Options default_options() {
    Options options;
    if constexpr (!Rule::keeps_normalizer) options.normalization = Normalization::unnormalized();
    return options;
  }

  RuleAttention()
    requires std::default_initializable<Phi> && std::default_initializable<Rule>
      : RuleAttention(Phi{}, Rule{}, default_options()) {}

  /// For rules without a parameter (Additive, Gated, Delta, GatedDelta).
  explicit RuleAttention(Phi phi, Options options = default_options())
    requires std::default_initializable<Rule>
      : RuleAttention(std::move(phi), Rule{}, options) {}

  /// Throws std::invalid_argument for an option no call could use (chunk_size < 1, a negative
  /// decode block) or a dividing normalization with a rule that keeps no normalizer.
  RuleAttention(Phi phi, Rule rule, Options options = default_options())
      : phi_(std::move(phi)), rule_(std::move(rule)), options_(options) {
    detail::check_options(options_);
    if constexpr (!Rule::keeps_normalizer) {
      if (options_.normalization.divides())
        throw std::invalid_argument(
            std::string("linattn: the ") + Rule::name +
            " rule keeps no normalizer z, so the weighted average qf^T S / qf^T z does not "
            "exist; use Normalization::unnormalized() (its default)");
    }
    identity_ = detail::StateIdentity{detail::feature_map_name<Phi>(),
                                      detail::feature_map_fingerprint(phi_), Rule::name,
                                      static_cast<double>(rule_.parameter())};
  }

  [[nodiscard]] const Phi& feature_map() const noexcept { return phi_; }
  [[nodiscard]] const Rule& rule() const noexcept { return rule_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  /// r, the feature dimension for keys of dimension dk.
  [[nodiscard]] Index feature_dim(Index dk) const { return phi_.feature_dim(dk); }
  /// The chunk size the causal paths use for feature dim r and value dim dv (Options).
  [[nodiscard]] Index chunk_size(Index r, Index dv) const {
    return detail::resolve_chunk_size(options_, r, dv, Index{sizeof(Scalar)});
  }
  /// B of the states made for feature dim r and value dim dv (Options); 0 unless additive
  /// with an ordinary map.
  [[nodiscard]] Index decode_block(Index r, Index dv) const {
    if constexpr (Rule::kind != WriteKind::additive || log_scaled) return 0;
    return detail::resolve_decode_block(options_, r, dv, Index{sizeof(Scalar)});
  }
  /// What states made by this attention record (feature map, fingerprint, rule).
  [[nodiscard]] const detail::StateIdentity& state_identity() const noexcept { return identity_; }

  /// An empty state for keys of dimension dk and values of dimension dv. O(r (dv + B)).
  /// Throws ShapeError unless dk, dv >= 1.
  [[nodiscard]] State make_state(Index dk, Index dv) const {
    if (dk < 1 || dv < 1)
      detail::throw_shape_error("a state needs dk >= 1 and dv >= 1, got dk=", dk, " dv=", dv);
    const Index r = phi_.feature_dim(dk);
    if constexpr (Rule::kind == WriteKind::additive)
      return State(r, dk, dv, identity_, log_scaled, decode_block(r, dv));
    else
      return State(r, dk, dv, identity_);
  }

  // ---- stateless ----------------------------------------------------------------------------

  /// parallel(Q, K, V, inputs..., mask): attention of Q (Tq x dk) over K (Tk x dk), V (Tk x dv);
  /// returns Tq x dv. Mask::causal runs the chunked pass from an empty state; Mask::none (or a
  /// run-time Mask) only where the rule has a full form (Additive; a compile error otherwise).
  template <class DQ, class DK, class DV, class... Args>
  [[nodiscard]] Output parallel(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, const Args&... inputs_then_mask) const {
    Output out(Q.rows(), V.cols());
    parallel_into(Q, K, V, inputs_then_mask..., out);
    return out;
  }
  /// parallel_into(Q, K, V, inputs..., mask, out): parallel() writing into out (Tq x dv).
  template <class DQ, class DK, class DV, class... Args>
  void parallel_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    Calls::parallel_into(Q, K, V, std::forward<Args>(args)...);
  }
  /// recurrent(Q, K, V, inputs...): causal attention token by token from an empty state; the
  /// same as parallel(Q, K, V, inputs..., Mask::causal) to rounding. O(T r dv), no allocation
  /// per token.
  template <class DQ, class DK, class DV, class... In>
  [[nodiscard]] Output recurrent(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V, const In&... inputs) const {
    detail::check_inputs(Q, K, V, true);
    State state = make_state(K.cols(), V.cols());
    return recurrent(state, Q, K, V, inputs...);
  }

  // ---- a carried state (prefill, then decode) ----------------------------------------------

  /// prefill(state, Q, K, V, inputs...): causal attention continuing `state`, in chunks; the
  /// state absorbs all T tokens. A sequence in pieces gives the outputs and state of one call
  /// (to rounding). After a DenominatorError the state holds the chunks before the failing one.
  template <class DQ, class DK, class DV, class... In>
  [[nodiscard]] Output prefill(State& state, const Eigen::MatrixBase<DQ>& Q,
                               const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                               const In&... inputs) const {
    Output out(Q.rows(), V.cols());
    prefill_into(state, Q, K, V, inputs..., out);
    return out;
  }
  /// prefill_into(state, Q, K, V, inputs..., out).
  template <class DQ, class DK, class DV, class... Args>
  void prefill_into(State& state, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    Calls::template causal_into<false>(state, Q, K, V, std::forward<Args>(args)...);
  }
  /// recurrent(state, Q, K, V, inputs...): the same token by token. After a DenominatorError
  /// the state holds the tokens before the failing row.
  template <class DQ, class DK, class DV, class... In>
  [[nodiscard]] Output recurrent(State& state, const Eigen::MatrixBase<DQ>& Q,
                                 const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                 const In&... inputs) const {
    Output out(Q.rows(), V.cols());
    recurrent_into(state, Q, K, V, inputs..., out);
    return out;
  }
  /// recurrent_into(state, Q, K, V, inputs..., out).
  template <class DQ, class DK, class DV, class... Args>
  void recurrent_into(State& state, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                      const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    Calls::template causal_into<true>(state, Q, K, V, std::forward<Args>(args)...);
  }
  /// step(state, q, k, v, inputs...): one decode token (q, k length dk, v length dv, as rows
  /// or columns; inputs as numbers, or a length-r vector of per-channel log-gates); returns
  /// y (1 x dv). O(r dv). Strong guarantee: bad inputs or a rejected denominator leave the
  /// state unchanged. With a decode block B > 1 (additive) the step reads S without writing it
  /// and folds B tokens at a time: the same math, so the same result to rounding; the bits
  /// depend only on the inputs and on where the state's blocks begin.
  template <class Dq, class Dk, class Dv, class... In>
  [[nodiscard]] RowVector<Scalar> step(State& state, const Eigen::MatrixBase<Dq>& q,
                                       const Eigen::MatrixBase<Dk>& k,
                                       const Eigen::MatrixBase<Dv>& v, const In&... inputs) const {
    RowVector<Scalar> y(state.value_dim());
    step_into(state, q, k, v, inputs..., y);
    return y;
  }
  /// step_into(state, q, k, v, inputs..., y): step() writing into y (1 x dv, may be v);
  /// allocates nothing.
  template <class Dq, class Dk, class Dv, class... Args>
  void step_into(State& state, const Eigen::MatrixBase<Dq>& q, const Eigen::MatrixBase<Dk>& k,
                 const Eigen::MatrixBase<Dv>& v, Args&&... args) const {
    Calls::step_into(state, q, k, v, std::forward<Args>(args)...);
  }

  // ---- one state, several readers (additive rule) -------------------------------------------

  /// absorb(state, k, v): S += phi(k) v^T, z += phi(k) without a read; with read_into() several
  /// queries read one state. absorb() then read_into() gives step()'s bits when the state has a
  /// decode block, step()'s result to rounding otherwise. O(r dv), or O(r + dv) with a block.
  template <class Dk, class Dv>
  void absorb(State& state, const Eigen::MatrixBase<Dk>& k, const Eigen::MatrixBase<Dv>& v) const {
    Calls::absorb(state, k, v);
  }
  /// read_into(state, q, y, scratch): y = phi(q)^T S / phi(q)^T z without changing the state,
  /// so any number of readers may read at once, each with its own ReadScratch(state).
  /// O(r dv + B (r + dv)); allocates nothing. The denominator's row is the last absorbed token.
  template <class Dq>
  void read_into(const State& state, const Eigen::MatrixBase<Dq>& q, Eigen::Ref<RowVector<Scalar>> y,
                 ReadScratch<Scalar>& scratch) const {
    Calls::read_into(state, q, y, scratch);
  }

  // ---- grouped query heads: one K, V (and state) for G query heads --------------------------
  // `queries` is a span (or vector) of ConstRowsView, one per head, or a TensorView slice with
  // B = 1 and H = G (TensorView::slice); `outputs` likewise with RowsView or a mutable view.
  // Heads are read and written in place.

  /// parallel_into(queries, K, V, inputs..., mask, outputs): parallel_into() for G query heads
  /// over one K, V, each output with the bits of the single-head call; the keys' features, the
  /// state's updates (causal) or phi(K)^T V (full) are computed once. Queries Tq x dk each.
  template <detail::QueryGroup<Scalar> Queries, class DK, class DV, class... Args>
  void parallel_into(const Queries& queries, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     Args&&... args) const {
    Calls::parallel_group_into(detail::query_group<Scalar>(queries), K, V,
                               std::forward<Args>(args)...);
  }
  /// prefill_into(state, queries, K, V, inputs..., outputs): the grouped causal pass continuing
  /// one state; each head's output has the bits of prefill_into() on its own copy of the
  /// state. If a denominator is rejected, the state holds the chunks before the failing one.
  template <detail::QueryGroup<Scalar> Queries, class DK, class DV, class... Args>
  void prefill_into(State& state, const Queries& queries, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    Calls::prefill_group_into(state, detail::query_group<Scalar>(queries), K, V,
                              std::forward<Args>(args)...);
  }
  /// step_into(state, queries, k, v, inputs..., outputs): one decode token for G query heads
  /// (1 x dk each) of one state: absorbs (k, v) once, reads G times (additive: absorb() then
  /// read_into() per head, bit for bit). Strong guarantee: every head's denominator is checked
  /// before the state changes. Allocates nothing. O(r dv + G r dv).
  template <detail::QueryGroup<Scalar> Queries, class Dk, class Dv, class... Args>
  void step_into(State& state, const Queries& queries, const Eigen::MatrixBase<Dk>& k,
                 const Eigen::MatrixBase<Dv>& v, Args&&... args) const {
    Calls::step_group_into(state, detail::query_group<Scalar>(queries), k, v,
                           std::forward<Args>(args)...);
  }

 private:
  Phi phi_{};
  Rule rule_{};
  Options options_{};
  detail::StateIdentity identity_{};
};

/// The articles' linear attention: the additive write rule.
template <class Phi, class Scalar = float>
using LinearAttention = RuleAttention<Phi, Additive, Scalar>;

}  // namespace linattn
