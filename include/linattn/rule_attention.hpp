#pragma once
/// \file rule_attention.hpp
/// RuleAttention<Phi, Rule, Scalar>: causal linear attention with a chosen feature map and a
/// chosen write rule (linattn/write_rules.hpp), by a chunked parallel path and a recurrent
/// path that agree to rounding, with a state carried across calls (prefill, then decode).
///
/// Per-token inputs follow Q, K, V (or the state) in every call, as many as Rule::token_inputs:
///   Additive, Decay:  none                        attn.parallel(Q, K, V)
///   Gated:            log_gates, T x 1 or T x r   attn.parallel(Q, K, V, log_gates)
///   Delta:            beta, length T              attn.parallel(Q, K, V, beta)
///   GatedDelta:       beta, log_alpha, length T   attn.parallel(Q, K, V, beta, log_alpha)
/// step() takes the same inputs for one token: scalars, or a length-r vector of log-gates.
/// They are validated before any state changes: beta in [0, 1], log-gates finite and <= 0
/// (std::invalid_argument naming the token); shapes throw ShapeError.
///
/// Reads: Additive, Decay and Gated read y = qf^T S / qf^T z under the Normalization policy
/// (strict by default). Delta and GatedDelta read y = S^T qf only: their default options are
/// Normalization::unnormalized(), and passing a dividing normalization throws
/// std::invalid_argument at construction (their state has no z()).
///
/// Parallel paths (chunk size C from Options::chunk_size, r features, dv values):
///   Additive:   LinearAttention's chunked form (this class delegates; identical results).
///   Decay, scalar Gated: chunks with cumulative log-gates, weights exp(b_i - b_j) <= 1.
///   per-channel Gated: the same per channel, in sub-chunks so that no factor exceeds 1.
///   Delta, GatedDelta: the WY / UT form, one C x C unit-lower-triangular solve per chunk.
/// Complexity: O(T C (r + dv) + T r dv) time for every rule (O(T C dv) more for the solve of
/// the delta rules), O(C (C + r + dv)) scratch per call; recurrent/step O(r dv) per token.
/// Per-token input arrays are copied once per call (O(T r) at most).
///
/// All members are const; one object can serve many threads, each with its own state.

#include <linattn/attention.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_kernels.hpp>
#include <linattn/detail/gated_kernels.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace linattn {

namespace detail {

/// An Eigen dense matrix, vector or expression (what per-token inputs are passed as).
/// (Any class derived from some Eigen::MatrixBase<D>: matrices, blocks, maps, expressions.)
template <class T>
concept EigenDense = requires(const T& x) { []<class D>(const Eigen::MatrixBase<D>&) {}(x); };

/// A per-token input of one step: a number, or an Eigen vector (per-channel log-gates).
template <class T>
concept StepInput = std::is_arithmetic_v<T> || EigenDense<T>;

}  // namespace detail

/// Causal linear attention with feature map Phi and write rule Rule, in precision Scalar.
/// Except under Additive (which delegates to LinearAttention), a log-scaled map (random
/// features) is used through its plain features, without LinearAttention's running-maximum
/// stabiliser: keys of large norm can underflow, and the strict normalization then throws
/// rather than return a wrong average.
template <class Phi, class Rule = Additive, class Scalar = float>
class RuleAttention {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  static_assert(FeatureMap<Phi, Scalar>,
                "Phi is not a feature map: it needs `static constexpr bool strictly_positive`, "
                "`Index feature_dim(Index d) const` and `void apply(const In& x, Out& out) "
                "const` (see linattn/feature_maps.hpp)");
  static_assert(WriteRule<Rule>,
                "Rule is not a write rule: use Additive, Decay, Gated, Delta or GatedDelta "
                "(see linattn/write_rules.hpp)");

  static constexpr bool additive = Rule::kind == WriteKind::additive;
  static constexpr bool delta_family =
      Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta;

 public:
  using feature_map_type = Phi;
  using rule_type = Rule;
  using scalar_type = Scalar;
  /// AttentionState for Additive (interchangeable with LinearAttention), RuleState otherwise.
  using State = std::conditional_t<additive, AttentionState<Scalar>, RuleState<Rule, Scalar>>;
  using Output = RowMatrix<Scalar>;
  using OutputRef = Eigen::Ref<RowMatrix<Scalar>>;

  /// Strict normalization for rules that keep z; the unnormalized read for the delta rules.
  [[nodiscard]] static Options default_options() {
    Options options;
    if constexpr (!Rule::keeps_normalizer) options.normalization = Normalization::unnormalized();
    return options;
  }

  RuleAttention()
    requires std::default_initializable<Phi> && std::default_initializable<Rule>
      : RuleAttention(Phi{}, Rule{}) {}

  /// Throws std::invalid_argument for chunk_size < 1, or for a dividing normalization with a
  /// rule that keeps no normalizer (the weighted average does not exist there).
  explicit RuleAttention(Phi phi, Rule rule = Rule{}, Options options = default_options())
      : base_(std::move(phi), options), rule_(rule) {
    if (!Rule::keeps_normalizer && options.normalization.divides())
      throw std::invalid_argument(
          std::string("linattn: the ") + Rule::name +
          " write rule's state is not a sum of positive weights, so the weighted average "
          "phi(q)^T S / phi(q)^T z is undefined; use Normalization::unnormalized() (its "
          "default)");
  }

  [[nodiscard]] const Phi& feature_map() const noexcept { return base_.feature_map(); }
  [[nodiscard]] const Rule& rule() const noexcept { return rule_; }
  [[nodiscard]] const Options& options() const noexcept { return base_.options(); }
  [[nodiscard]] Index feature_dim(Index dk) const { return base_.feature_dim(dk); }

  /// An empty state for keys of dimension dk and values of dimension dv. O(r dv). Under
  /// Additive it is LinearAttention's state (with its decode block), so both classes step the
  /// same way.
  [[nodiscard]] State make_state(Index dk, Index dv) const {
    if constexpr (additive)
      return base_.make_state(dk, dv);
    else
      return State(feature_dim(dk), dk, dv);
  }

  // ---- parallel path -------------------------------------------------------------------

  /// Causal attention of Q (T x dk), K (T x dk), V (T x dv) from an empty state, by chunks.
  template <class DQ, class DK, class DV, class... In>
    requires(detail::EigenDense<In> && ...)
  [[nodiscard]] Output parallel(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, const In&... inputs) const {
    State state = make_state(K.cols(), V.cols());
    return parallel(Q, K, V, state, inputs...);
  }

  /// Causal attention continuing from `state`, which absorbs all T tokens. Pieces of a
  /// sequence give the same outputs and state as one call (to rounding).
  template <class DQ, class DK, class DV, class... In>
    requires(detail::EigenDense<In> && ...)
  [[nodiscard]] Output parallel(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, State& state,
                                const In&... inputs) const {
    Output out(Q.rows(), V.cols());
    parallel_into(Q, K, V, state, out, inputs...);
    return out;
  }

  /// parallel() from `state`, writing into `out` (T x dv), which may be a strided view.
  template <class DQ, class DK, class DV, class... In>
    requires(detail::EigenDense<In> && ...)
  void parallel_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, State& state, OutputRef out,
                     const In&... inputs) const {
    causal_into<false>(Q, K, V, state, out, inputs...);
  }

  // ---- recurrent path ------------------------------------------------------------------

  /// Causal attention token by token from an empty state. O(T r dv), no allocation per token.
  template <class DQ, class DK, class DV, class... In>
    requires(detail::EigenDense<In> && ...)
  [[nodiscard]] Output recurrent(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V, const In&... inputs) const {
    State state = make_state(K.cols(), V.cols());
    return recurrent(Q, K, V, state, inputs...);
  }

  /// recurrent() continuing from `state`. If a row's denominator is rejected, the state holds
  /// the tokens before that row.
  template <class DQ, class DK, class DV, class... In>
    requires(detail::EigenDense<In> && ...)
  [[nodiscard]] Output recurrent(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V, State& state,
                                 const In&... inputs) const {
    Output out(Q.rows(), V.cols());
    recurrent_into(Q, K, V, state, out, inputs...);
    return out;
  }

  /// recurrent() from `state`, writing into `out` (T x dv).
  template <class DQ, class DK, class DV, class... In>
    requires(detail::EigenDense<In> && ...)
  void recurrent_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                      const Eigen::MatrixBase<DV>& V, State& state, OutputRef out,
                      const In&... inputs) const {
    causal_into<true>(Q, K, V, state, out, inputs...);
  }

  /// One decode step; q, k (length dk), v (length dv) as rows or columns. Inputs per rule:
  /// Gated a log-gate (a number, or a vector of length r), Delta beta, GatedDelta beta then
  /// log_alpha. O(r dv), allocates nothing besides the returned row.
  template <class Dq, class Dk, class Dv, class... In>
    requires(detail::StepInput<In> && ...)
  [[nodiscard]] RowVector<Scalar> step(State& state, const Eigen::MatrixBase<Dq>& q,
                                       const Eigen::MatrixBase<Dk>& k,
                                       const Eigen::MatrixBase<Dv>& v, const In&... inputs) const {
    RowVector<Scalar> y(state.value_dim());
    step_into(state, q, k, v, y, inputs...);
    return y;
  }

  /// step() writing into `y` (1 x dv); allocates nothing. Strong guarantee: invalid inputs or
  /// a rejected denominator leave the state unchanged.
  template <class Dq, class Dk, class Dv, class... In>
    requires(detail::StepInput<In> && ...)
  void step_into(State& state, const Eigen::MatrixBase<Dq>& q, const Eigen::MatrixBase<Dk>& k,
                 const Eigen::MatrixBase<Dv>& v, Eigen::Ref<RowVector<Scalar>> y,
                 const In&... inputs) const {
    check_input_count<sizeof...(In)>();
    if constexpr (additive) {
      base_.step_into(state, q, k, v, y);
    } else {
      if (y.size() != state.value_dim())
        detail::throw_shape_error("step output has length ", y.size(), ", expected dv = ",
                                  state.value_dim());
      detail::copy_as_row(state.query_row_, q, "q");
      detail::copy_as_row(state.key_row_, k, "k");
      detail::copy_as_row(state.value_row_, v, "v");
      step_token(state, y, inputs...);
    }
  }

 private:
  // parallel_into (Recurrent = false: chunks) and recurrent_into (true: token by token).
  template <bool Recurrent, class DQ, class DK, class DV, class... In>
  void causal_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                   const Eigen::MatrixBase<DV>& V, State& state, OutputRef out,
                   const In&... inputs) const {
    check_input_count<sizeof...(In)>();
    if constexpr (additive && Recurrent) {
      base_.recurrent_into(Q, K, V, state, out);
    } else if constexpr (additive) {
      base_.parallel_into(Q, K, V, Mask::causal, state, out);
    } else {
      check_shapes(Q, K, V, state, out);
      run<Recurrent>(detail::materialize(Q), detail::materialize(K), detail::materialize(V),
                     state, out, Q.rows(), inputs...);
    }
  }

  template <int N>
  static constexpr void check_input_count() {
    static_assert(N == Rule::token_inputs,
                  "wrong number of per-token inputs for this write rule: Additive and Decay "
                  "take none, Gated takes log-gates, Delta takes beta, GatedDelta takes beta "
                  "then log_alpha");
  }

  template <class DQ, class DK, class DV>
  void check_shapes(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V, const State& state,
                    const OutputRef& out) const {
    if (Q.cols() != K.cols())
      detail::throw_shape_error("Q and K need the same key dimension, got Q ",
                                detail::shape_of(Q), " and K ", detail::shape_of(K));
    if (Q.rows() != K.rows() || K.rows() != V.rows())
      detail::throw_shape_error("causal attention needs one row per token in Q, K and V, got Q ",
                                detail::shape_of(Q), ", K ", detail::shape_of(K), " and V ",
                                detail::shape_of(V));
    if (out.rows() != Q.rows() || out.cols() != V.cols())
      detail::throw_shape_error("output is ", detail::shape_of(out), ", expected ", Q.rows(),
                                "x", V.cols(), " (Q rows x V cols)");
    state.check_shape(feature_dim(K.cols()), K.cols(), V.cols());
  }

  // A length-T vector input (row or column) as a column in Scalar; copied, O(T).
  template <class D>
  static ColVector<Scalar> token_vector(const Eigen::MatrixBase<D>& x, Index T, const char* what) {
    if (!(x.rows() == 1 || x.cols() == 1) || x.size() != T)
      detail::throw_shape_error(what, " must be a vector with one entry per token (", T,
                                "), got ", detail::shape_of(x));
    ColVector<Scalar> out(T);
    for (Index t = 0; t < T; ++t)
      out(t) = static_cast<Scalar>(x.rows() == 1 ? x(0, t) : x(t, 0));
    return out;
  }

  // Log-gates T x 1 or T x r as a row-major matrix in Scalar; copied, O(T r).
  template <class D>
  static RowMatrix<Scalar> token_gates(const Eigen::MatrixBase<D>& x, Index T, Index r) {
    if (x.rows() != T || !(x.cols() == 1 || x.cols() == r))
      detail::throw_shape_error("log-gates must be T x 1 or T x r = ", T, "x1 or ", T, "x", r,
                                ", got ", detail::shape_of(x));
    RowMatrix<Scalar> out = x.template cast<Scalar>();
    // Valid gates in two vectorized reductions (x * 0 is 0 for finite x, NaN otherwise); the
    // element-wise check then names the first bad entry.
    const bool valid = out.size() == 0 || ((out.array() * Scalar(0)).sum() == Scalar(0) &&
                                           out.maxCoeff() <= Scalar(0));
    if (!valid) detail::check_log_gates(out, "a log-gate");
    return out;
  }

  // Features of rows [first, first + n) of X into the first n rows of `buffer`.
  template <class DX>
  auto features(const DX& X, Index first, Index n, RowMatrix<Scalar>& buffer) const {
    Eigen::Ref<RowMatrix<Scalar>> f(buffer.topRows(n));
    feature_map().apply(X.middleRows(first, n), f);
    return buffer.topRows(n);
  }

  // Binds the per-token inputs, validates them, then runs the chunked or recurrent loop.
  template <bool Recurrent, class DQ, class DK, class DV, class... In>
  void run(const DQ& Q, const DK& K, const DV& V, State& state, OutputRef out, Index T,
           const In&... inputs) const {
    const Index r = state.feature_dim();
    if constexpr (Rule::kind == WriteKind::decay) {
      const RowMatrix<Scalar> log_gate =
          RowMatrix<Scalar>::Constant(T, 1, static_cast<Scalar>(std::log(rule_.gamma())));
      loop_gated<Recurrent>(Q, K, V, state, out, log_gate);
    } else if constexpr (Rule::kind == WriteKind::gated) {
      loop_gated<Recurrent>(Q, K, V, state, out, token_gates(inputs..., T, r));
    } else if constexpr (Rule::kind == WriteKind::delta) {
      const ColVector<Scalar> beta = token_vector(inputs..., T, "beta");
      detail::check_betas(beta);
      loop_delta<Recurrent>(Q, K, V, state, out, beta, ColVector<Scalar>());
    } else {
      static_assert(Rule::kind == WriteKind::gated_delta);
      bind_gated_delta<Recurrent>(Q, K, V, state, out, T, inputs...);
    }
  }

  template <bool Recurrent, class DQ, class DK, class DV, class DB, class DA>
  void bind_gated_delta(const DQ& Q, const DK& K, const DV& V, State& state, OutputRef out,
                        Index T, const DB& beta_in, const DA& log_alpha_in) const {
    const ColVector<Scalar> beta = token_vector(beta_in, T, "beta");
    const ColVector<Scalar> log_alpha = token_vector(log_alpha_in, T, "log_alpha");
    detail::check_betas(beta);
    detail::check_log_gates(log_alpha, "log_alpha");
    loop_delta<Recurrent>(Q, K, V, state, out, beta, log_alpha);
  }

  template <bool Recurrent, class DQ, class DK, class DV>
  void loop_gated(const DQ& Q, const DK& K, const DV& V, State& state, OutputRef out,
                  const RowMatrix<Scalar>& log_gate) const {
    const Index T = Q.rows(), r = state.feature_dim(), dv = state.value_dim();
    const Normalization& norm = options().normalization;
    const bool per_channel = log_gate.cols() != 1;
    const bool fixed = Rule::kind == WriteKind::decay;  // one gate for every token
    const Index ld_out = out.outerStride();
    if constexpr (Recurrent) {
      // Features (and per-channel gates) for blocks of 32 tokens; two tokens per sweep of S
      // (detail::GatedRecurrence), the last of an odd count alone; finish() leaves the exact
      // state however the loop ends.
      const Index block = std::min<Index>(T, 32);
      RowMatrix<Scalar> qf(block, r), kf(block, r), g(per_channel ? block : 0, r),
          v_buffer(block, dv);
      detail::GatedRecurrence<Scalar> recurrence(r, dv);
      struct Finish {
        detail::GatedRecurrence<Scalar>& recurrence;
        RowMatrix<Scalar>& S;
        ~Finish() { recurrence.finish(S); }
      } finish{recurrence, state.S_};
      const Scalar fixed_gate = fixed && T > 0 ? std::exp(log_gate(0, 0)) : Scalar(1);
      for (Index first = 0; first < T; first += block) {
        const Index n = std::min(block, T - first);
        features(Q, first, n, qf);
        features(K, first, n, kf);
        if (per_channel) detail::gates_from_logs(log_gate.row(first).data(), 1, g.data(), n * r);
        const auto v = detail::row_major_rows(V, first, n, v_buffer);
        const auto token = [&](Index i) {
          detail::GatedToken<Scalar> tk;
          tk.qf = qf.row(i).data();
          tk.kf = kf.row(i).data();
          tk.v = v.first + i * v.second;
          if (per_channel)
            tk.gates = g.row(i).data();
          else
            tk.gate = fixed ? fixed_gate : std::exp(log_gate(first + i, 0));
          tk.y = out.row(first + i).data();
          return tk;
        };
        Index i = 0;
        for (; i + 1 < n; i += 2) {
          const Index t = first + i;
          // Output rows of the next sweep, requested now so that they arrive during this one.
          for (Index ahead = t + 2; ahead < std::min(t + 4, T); ++ahead)
            detail::prefetch_for_write(out.row(ahead).data(), dv);
          const detail::GatedToken<Scalar> pair[2] = {token(i), token(i + 1)};
          recurrence.pair(state.S_, state.z_, pair, norm, t, state.tokens_, t + 2 >= T);
        }
        if (i < n)
          recurrence.single(state.S_, state.z_, token(i), norm, first + i, state.tokens_, true);
      }
    } else {
      const Index C = std::min(options().chunk_size, std::max<Index>(T, 1));
      RowMatrix<Scalar> qf(C, r), kf(C, r), v_buffer(C, dv);
      const auto chunks = [&](auto& kernel, auto gates) {
        for (Index first = 0; first < T; first += C) {
          const Index n = std::min(C, T - first);
          features(Q, first, n, qf);
          features(K, first, n, kf);
          const auto v = detail::row_major_rows(V, first, n, v_buffer);
          kernel.prepare(n, kf.data(), r, v.first, v.second, gates.from(first));
          kernel.read(qf.data(), r, state.S_, state.z_, out.data() + first * ld_out, ld_out, norm,
                      first);
          kernel.absorb(state.S_, state.z_);
          state.tokens_ += n;
        }
      };
      if (per_channel) {
        detail::ChannelGatedChunk<Scalar> kernel(C, r, dv);
        chunks(kernel, detail::TokenRows<Scalar>{log_gate.data(), r});
      } else {
        detail::ScalarGatedChunk<Scalar> kernel(C, r, dv);
        chunks(kernel, detail::TokenValues<Scalar>{log_gate.data(), fixed ? 0 : 1});
      }
    }
  }

  template <bool Recurrent, class DQ, class DK, class DV>
  void loop_delta(const DQ& Q, const DK& K, const DV& V, State& state, OutputRef out,
                  const ColVector<Scalar>& beta, const ColVector<Scalar>& log_alpha) const {
    const Index T = Q.rows(), r = state.feature_dim(), dv = state.value_dim();
    const bool gated = log_alpha.size() > 0;
    const Index ld_out = out.outerStride();
    if constexpr (Recurrent) {
      // Features for blocks of 32 tokens; two tokens per sweep of S, the update carried into
      // the next sweep; finish() applies the last one however the loop ends.
      const Index block = std::min<Index>(T, 32);
      RowMatrix<Scalar> qf(block, r), kf(block, r), v_buffer(block, dv);
      detail::DeltaRecurrence<Scalar> recurrence(r, dv);
      struct Finish {
        detail::DeltaRecurrence<Scalar>& recurrence;
        RowMatrix<Scalar>& S;
        ~Finish() { recurrence.finish(S, false); }
      } finish{recurrence, state.S_};
      const auto alpha = [&](Index t) { return gated ? std::exp(log_alpha(t)) : Scalar(1); };
      for (Index first = 0; first < T; first += block) {
        const Index n = std::min(block, T - first);
        features(Q, first, n, qf);
        features(K, first, n, kf);
        const auto v = detail::row_major_rows(V, first, n, v_buffer);
        Index i = 0;
        for (; i + 1 < n; i += 2) {
          const Index t = first + i;
          for (Index ahead = t + 2; ahead < std::min(t + 4, T); ++ahead)
            detail::prefetch_for_write(out.row(ahead).data(), dv);
          const Scalar* const vs[2] = {v.first + i * v.second, v.first + (i + 1) * v.second};
          const Scalar* const q[2] = {qf.row(i).data(), qf.row(i + 1).data()};
          const Scalar* const k[2] = {kf.row(i).data(), kf.row(i + 1).data()};
          const Scalar b[2] = {beta(t), beta(t + 1)}, a[2] = {alpha(t), alpha(t + 1)};
          Scalar* const y[2] = {out.row(t).data(), out.row(t + 1).data()};
          recurrence.pair(state.S_, q, k, vs, b, a, y, (t / 2) % 2 != 0);
          state.tokens_ += 2;
        }
        if (i < n) {
          const Index t = first + i;
          recurrence.single(state.S_, qf.row(i).data(), kf.row(i).data(),
                            v.first + i * v.second, beta(t), alpha(t), out.row(t).data(),
                            (t / 2) % 2 != 0);
          ++state.tokens_;
        }
      }
    } else {
      const Index C = std::min(options().chunk_size, std::max<Index>(T, 1));
      RowMatrix<Scalar> qf(C, r), kf(C, r), v_buffer(C, dv);
      detail::DeltaChunk<Scalar> kernel(C, r, dv);
      for (Index first = 0; first < T; first += C) {
        const Index n = std::min(C, T - first);
        features(Q, first, n, qf);
        features(K, first, n, kf);
        const auto v = detail::row_major_rows(V, first, n, v_buffer);
        kernel.prepare(n, kf.data(), r, v.first, v.second,
                       detail::TokenValues<Scalar>{beta.data() + first, 1},
                       gated ? detail::TokenValues<Scalar>{log_alpha.data() + first, 1}
                             : detail::TokenValues<Scalar>{},
                       state.S_);
        kernel.read(qf.data(), r, state.S_, out.data() + first * ld_out, ld_out);
        kernel.absorb(state.S_);
        state.tokens_ += n;
      }
    }
  }

  // One token of step(): the rows are already in the state's scratch.
  template <class... In>
  void step_token(State& state, Eigen::Ref<RowVector<Scalar>>& y, const In&... inputs) const {
    Eigen::Ref<RowMatrix<Scalar>> qf(state.query_features_), kf(state.key_features_);
    feature_map().apply(state.query_row_, qf);
    feature_map().apply(state.key_row_, kf);
    const Index r = state.feature_dim();
    if constexpr (Rule::kind == WriteKind::decay || Rule::kind == WriteKind::gated) {
      auto& g = state.gate_row_;
      detail::GatedToken<Scalar> token;
      token.qf = qf.data();
      token.kf = kf.data();
      token.v = state.value_row_.data();
      token.y = y.data();
      if constexpr (Rule::kind == WriteKind::decay) {
        token.gate = static_cast<Scalar>(rule_.gamma());
      } else if (set_step_gates(g, r, inputs...)) {
        token.gates = g.data();
      } else {
        token.gate = g(0, 0);
      }
      detail::gated_token(state.S_, state.z_, state.scratch_, token, options().normalization,
                          state.tokens_, state.tokens_);
    } else {
      const auto [beta, alpha] = step_delta_inputs(inputs...);
      detail::delta_token<Scalar>(state.S_, state.prediction_.data(), qf.data(), kf.data(),
                                  state.value_row_.data(), beta, alpha, y.data(),
                                  state.tokens_ % 2 != 0);
      ++state.tokens_;
    }
  }

  // The gates of one step into g (1 x r); true if they are per channel (a vector of length r),
  // false for one gate (g(0, 0)).
  template <class G>
  static bool set_step_gates(RowMatrix<Scalar>& g, Index r, const G& log_gate) {
    if constexpr (std::is_arithmetic_v<G>) {
      detail::check_log_gates(Eigen::Matrix<double, 1, 1>::Constant(double(log_gate)),
                              "a log-gate");
      g(0, 0) = static_cast<Scalar>(std::exp(static_cast<double>(log_gate)));
      return false;
    } else {
      if (!(log_gate.rows() == 1 || log_gate.cols() == 1) ||
          !(log_gate.size() == 1 || log_gate.size() == r))
        detail::throw_shape_error("a step's log-gates must be a number or a vector of length 1 "
                                  "or r = ", r, ", got ", detail::shape_of(log_gate));
      for (Index n = 0; n < log_gate.size(); ++n) {
        const Scalar lg = static_cast<Scalar>(
            log_gate.rows() == 1 ? log_gate(0, n) : log_gate(n, 0));
        detail::check_log_gates(Eigen::Matrix<double, 1, 1>::Constant(double(lg)), "a log-gate");
        g(0, n) = std::exp(lg);
      }
      return log_gate.size() != 1;
    }
  }

  template <class B, class... A>
  static std::pair<Scalar, Scalar> step_delta_inputs(const B& beta_in, const A&... alpha_in) {
    static_assert(std::is_arithmetic_v<B> && (std::is_arithmetic_v<A> && ...),
                  "a delta-rule step takes beta (and log_alpha) as numbers");
    const Eigen::Matrix<double, 1, 1> beta = Eigen::Matrix<double, 1, 1>::Constant(beta_in);
    detail::check_betas(beta);
    double alpha = 1.0;
    if constexpr (sizeof...(A) == 1) {
      const Eigen::Matrix<double, 1, 1> la =
          Eigen::Matrix<double, 1, 1>::Constant((static_cast<double>(alpha_in), ...));
      detail::check_log_gates(la, "log_alpha");
      alpha = std::exp(la(0));
    }
    return {static_cast<Scalar>(beta(0)), static_cast<Scalar>(alpha)};
  }

  LinearAttention<Phi, Scalar> base_;
  Rule rule_;
};

}  // namespace linattn
