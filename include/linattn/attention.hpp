#pragma once
/// \file attention.hpp
/// LinearAttention<Phi, Scalar>: linear attention with a chosen feature map, by a parallel
/// path (full or causal) and a recurrent path that agree to rounding.
///
/// Math (rows are tokens, phi applied row-wise, sums over keys j):
///   full:    y_i = sum_j (phi(q_i)^T phi(k_j)) v_j / sum_j phi(q_i)^T phi(k_j)
///                = phi(q_i)^T (phi(K)^T V) / phi(q_i)^T (phi(K)^T 1)
///   causal:  the same with j <= i, i.e. through the state S_t = S_{t-1} + phi(k_t) v_t^T,
///            z_t = z_{t-1} + phi(k_t), y_t = phi(q_t)^T S_t / phi(q_t)^T z_t.
/// This is exact for the kernel phi(q)^T phi(k); it is not softmax attention.
///
/// Inputs are any Eigen dense expressions (row- or column-major, blocks, Maps with strides);
/// they are read in place. Outputs are row-major T x dv. Shape errors throw ShapeError;
/// denominators are handled by the Normalization policy (default: DenominatorError).
/// All members are const and the object holds no scratch, so one LinearAttention can serve
/// many threads; each thread needs its own state.

#include <linattn/detail/chunked.hpp>
#include <linattn/detail/deferred.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/log_domain.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <concepts>
#include <stdexcept>
#include <type_traits>

namespace linattn {

/// Options::decode_block's default: chosen from the size of S (see there).
inline constexpr Index kAutoDecodeBlock = -1;

/// Runtime options of a LinearAttention.
struct Options {
  /// What the read divides by; strict (throwing) by default.
  Normalization normalization{};
  /// Tokens per chunk in the causal parallel path (>= 1). Per token the chunked path costs
  /// about 4 r dv + C (r + dv) flops: smaller chunks spend less on the within-chunk score
  /// block, larger ones read and write S less often and give the products more rows. 16 and
  /// 32 measured within a few percent of each other at r = dv = 64 and 128 in float on the
  /// reference machine, 64 and more slower (docs/performance.md, chunk_size sweep); 32 also
  /// suits RuleAttention, which shares these options.
  Index chunk_size = 32;
  /// Tokens a state made by this attention collects in step() before folding them into S
  /// (0 or 1 folds every token in one fused pass over S). With B > 1 each step reads S
  /// instead of rewriting it, and one rank-B product per B tokens updates it: same flops,
  /// half the state traffic, plus about 2 B (r + dv) flops per token for the pending tokens.
  /// That pays when S does not fit L1: at r = dv = 128 in float decode ran 1.2 x faster with
  /// B = 16 when heads take turns per token (as a model decodes), about as fast when each
  /// head decodes alone; at 64 it ran about 0.8 x as fast (docs/performance.md). The default,
  /// kAutoDecodeBlock, takes B = 16 when S (r x dv) is larger than 32 KiB and 0 otherwise.
  /// Costs B (2 r + dv + 1) scalars per state. Ignored (0) for log-scaled (random-feature)
  /// maps, whose steps rescale S.
  Index decode_block = kAutoDecodeBlock;
};

/// Linear attention with feature map Phi in precision Scalar (float or double).
///
/// Complexity for T tokens, key dim dk, feature dim r, value dim dv:
///   parallel, full:    O((Tq + Tk) r dv) time, O(r dv) extra memory beyond phi(Q), phi(K).
///   parallel, causal:  O(T C (r + dv) + T r dv) time for chunk size C; never forms T x T.
///   recurrent / step:  O(r dv) per token; the state is r dv + r scalars.
template <class Phi, class Scalar = float>
class LinearAttention {
  static_assert(SupportedScalar<Scalar>, "linattn computes in float or double");
  static_assert(FeatureMap<Phi, Scalar>,
                "Phi is not a feature map: it needs `static constexpr bool strictly_positive`, "
                "`Index feature_dim(Index d) const` and `void apply(const In& x, Out& out) "
                "const` (see linattn/feature_maps.hpp)");

 public:
  using feature_map_type = Phi;
  using scalar_type = Scalar;
  using State = AttentionState<Scalar>;
  using Output = RowMatrix<Scalar>;
  /// A writable view of a T x dv row-major output, e.g. one head inside a [T, H*dv] buffer.
  using OutputRef = Eigen::Ref<RowMatrix<Scalar>>;

  LinearAttention()
    requires std::default_initializable<Phi>
  = default;
  explicit LinearAttention(Phi phi, Options options = {}) : phi_(std::move(phi)), options_(options) {
    if (options_.chunk_size < 1)
      throw std::invalid_argument("linattn: Options::chunk_size must be at least 1");
    if (options_.decode_block < kAutoDecodeBlock)
      throw std::invalid_argument(
          "linattn: Options::decode_block must be non-negative or kAutoDecodeBlock");
  }

  [[nodiscard]] const Phi& feature_map() const noexcept { return phi_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  /// r, the feature dimension for keys of dimension dk.
  [[nodiscard]] Index feature_dim(Index dk) const { return phi_.feature_dim(dk); }

  /// An empty state for keys of dimension dk and values of dimension dv. O(r (dv + B)).
  [[nodiscard]] State make_state(Index dk, Index dv) const {
    const Index r = phi_.feature_dim(dk);
    return State(r, dk, dv, log_scaled, decode_block(r, dv));
  }

  /// B of the states for feature dim r and value dim dv: Options::decode_block, resolved as
  /// described there when it is kAutoDecodeBlock; 0 for a log-scaled map.
  [[nodiscard]] Index decode_block(Index r, Index dv) const noexcept {
    if (log_scaled) return 0;
    if (options_.decode_block != kAutoDecodeBlock) return options_.decode_block;
    constexpr Index l1_budget = 32 * 1024;  // bytes; a typical x86 L1d is 32 to 48 KiB
    const bool fits_l1 = r * dv <= l1_budget / Index{sizeof(Scalar)};
    return fits_l1 ? 0 : 16;
  }

  // ---- parallel path -------------------------------------------------------------------

  /// Full (Mask::none, Tq may differ from Tk) or causal attention of Q (Tq x dk), K (Tk x dk),
  /// V (Tk x dv); returns Tq x dv. Causal starts from an empty state.
  template <class DQ, class DK, class DV>
  [[nodiscard]] Output parallel(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, Mask mask = Mask::none) const {
    Output out(Q.rows(), V.cols());
    parallel_into(Q, K, V, mask, out);
    return out;
  }

  /// Causal attention continuing from `state`, which absorbs all T tokens. Processing a
  /// sequence in pieces gives the same outputs and state as one call (to rounding).
  /// `mask` must be Mask::causal: a full read has no carried state.
  template <class DQ, class DK, class DV>
  [[nodiscard]] Output parallel(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, Mask mask, State& state) const {
    Output out(Q.rows(), V.cols());
    parallel_into(Q, K, V, mask, state, out);
    return out;
  }

  /// parallel() writing into `out` (Tq x dv), which may be a strided view of a larger buffer.
  template <class DQ, class DK, class DV>
  void parallel_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, Mask mask, OutputRef out) const {
    if (mask == Mask::causal) {
      check_causal(Q, K, V, out);
      State state = make_state(K.cols(), V.cols());
      causal_chunked(detail::materialize(Q), detail::materialize(K), detail::materialize(V),
                     state, out);
    } else {
      full(detail::materialize(Q), detail::materialize(K), detail::materialize(V), out);
    }
  }

  /// Causal parallel() from a carried state, writing into `out`.
  template <class DQ, class DK, class DV>
  void parallel_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, Mask mask, State& state,
                     OutputRef out) const {
    if (mask != Mask::causal)
      throw std::invalid_argument("linattn: a carried state needs Mask::causal");
    check_causal(Q, K, V, out);
    check_state(state, K.cols(), V.cols());
    state.settle();
    causal_chunked(detail::materialize(Q), detail::materialize(K), detail::materialize(V), state,
                   out);
  }

  // ---- recurrent path ------------------------------------------------------------------

  /// Causal attention token by token through the state, from an empty state. Same result as
  /// parallel(Q, K, V, Mask::causal) to rounding. O(T r dv), no allocation per token.
  template <class DQ, class DK, class DV>
  [[nodiscard]] Output recurrent(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V) const {
    State state = make_state(K.cols(), V.cols());
    return recurrent(Q, K, V, state);
  }

  /// recurrent() continuing from `state`, which absorbs all T tokens. If a row's denominator
  /// is rejected, the state holds the tokens before that row (state.tokens() tells how many).
  template <class DQ, class DK, class DV>
  [[nodiscard]] Output recurrent(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V, State& state) const {
    Output out(Q.rows(), V.cols());
    recurrent_into(Q, K, V, state, out);
    return out;
  }

  /// recurrent() from a carried state, writing into `out` (T x dv).
  template <class DQ, class DK, class DV>
  void recurrent_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                      const Eigen::MatrixBase<DV>& V, State& state, OutputRef out) const {
    check_causal(Q, K, V, out);
    check_state(state, K.cols(), V.cols());
    state.settle();
    const auto& Qm = detail::materialize(Q);
    const auto& Km = detail::materialize(K);
    const auto& Vm = detail::materialize(V);
    if constexpr (log_scaled) {
      for (Index t = 0; t < Qm.rows(); ++t)
        token(state, Qm.row(t), Km.row(t), Vm.row(t), out.row(t), t);
    } else {
      recurrent_pairs(Qm, Km, Vm, state, out);
    }
  }

  /// One decode step: S += phi(k) v^T, z += phi(k), returns y = phi(q)^T S / phi(q)^T z.
  /// q, k (length dk) and v (length dv) may be row or column vectors. O(r dv). Strong
  /// guarantee: if the denominator is rejected, the state is unchanged.
  ///
  /// With a decode block B > 1 (Options::decode_block) the step reads S without writing it:
  /// y = (phi(q)^T S_stored + sum over the p <= B pending tokens j of (phi(q)^T phi(k_j)) v_j)
  /// / phi(q)^T z; a full block of B pending tokens is folded into S_stored by one rank-B
  /// product when the next token arrives. Same math, so the same result to rounding;
  /// O(r dv + B (r + dv)) per token.
  /// Deterministic: the result depends on the inputs and on where the state's blocks begin
  /// (at its creation or reset, and wherever another path, mutable_S() or settle() folded it).
  template <class Dq, class Dk, class Dv>
  [[nodiscard]] RowVector<Scalar> step(State& state, const Eigen::MatrixBase<Dq>& q,
                                       const Eigen::MatrixBase<Dk>& k,
                                       const Eigen::MatrixBase<Dv>& v) const {
    RowVector<Scalar> y(state.value_dim());
    step_into(state, q, k, v, y);
    return y;
  }

  /// step() writing y into `y` (1 x dv); allocates nothing.
  template <class Dq, class Dk, class Dv>
  void step_into(State& state, const Eigen::MatrixBase<Dq>& q, const Eigen::MatrixBase<Dk>& k,
                 const Eigen::MatrixBase<Dv>& v, Eigen::Ref<RowVector<Scalar>> y) const {
    if (y.size() != state.value_dim())
      detail::throw_shape_error("step output has length ", y.size(), ", expected dv = ",
                                state.value_dim());
    check_state(state, state.key_dim(), state.value_dim());
    // Read in place where the caller's vectors are contiguous and are not y (an in-place
    // update y = v, say), else from copies in the state's scratch.
    const auto q_row = detail::row_view(q, state.query_row_, "q", y.data(), y.size());
    const auto k_row = detail::row_view(k, state.key_row_, "k", y.data(), y.size());
    const auto v_row = detail::row_view(v, state.value_row_, "v", y.data(), y.size());
    token(state, q_row, k_row, v_row, y, state.tokens());
  }

  // ---- shared states: absorb once, read many times ----------------------------------------

  /// Scratch for read_into() against states of this attention with key dim dk and value dim
  /// dv; one per reader. O(r + dk + B).
  [[nodiscard]] ReadScratch<Scalar> make_read_scratch(Index dk, Index dv) const {
    const Index r = phi_.feature_dim(dk);
    return ReadScratch<Scalar>(dk, r, decode_block(r, dv));
  }

  /// Absorbs one token without reading: S += phi(k) v^T, z += phi(k). With a decode block it
  /// joins the pending tokens (O(r + dv), and a fold of O(B r dv) every B tokens); otherwise
  /// O(r dv). Together with read_into() this lets several queries read one state, as the
  /// query heads of one key/value head do under grouped-query attention: absorb the group's
  /// token once, then read_into() for each query head. absorb() then read_into() gives the bits
  /// of step() when the state has a decode block, and agrees to rounding otherwise. Ordinary
  /// (not log-scaled) feature maps only.
  template <class Dk, class Dv>
  void absorb(State& state, const Eigen::MatrixBase<Dk>& k, const Eigen::MatrixBase<Dv>& v) const {
    static_assert(!log_scaled,
                  "absorb() and read_into() take ordinary feature maps; a log-scaled map "
                  "(random features) rescales S per token: use step()");
    check_state(state, state.key_dim(), state.value_dim());
    const auto k_row = detail::row_view(k, state.key_row_, "k", static_cast<const Scalar*>(nullptr), 0);
    const auto v_row = detail::row_view(v, state.value_row_, "v", static_cast<const Scalar*>(nullptr), 0);
    Eigen::Ref<RowMatrix<Scalar>> kf(state.key_features_);
    phi_.apply(k_row, kf);
    absorb_features(state, kf, v_row);
  }

  /// Reads a state without changing it: y = phi(q)^T S / phi(q)^T z over the tokens absorbed
  /// so far (pending ones included). `state` is const, so any number of readers may read it at
  /// once, each with its own `scratch` (make_read_scratch). O(r dv + B (r + dv)); allocates
  /// nothing. The denominator goes through the Normalization policy like step()'s (its row is
  /// the last absorbed token).
  template <class Dq>
  void read_into(const State& state, const Eigen::MatrixBase<Dq>& q,
                 Eigen::Ref<RowVector<Scalar>> y, ReadScratch<Scalar>& scratch) const {
    static_assert(!log_scaled,
                  "absorb() and read_into() take ordinary feature maps; a log-scaled map "
                  "(random features) rescales S per token: use step()");
    check_state(state, state.key_dim(), state.value_dim());
    const Index r = state.feature_dim();
    if (y.size() != state.value_dim())
      detail::throw_shape_error("read output has length ", y.size(), ", expected dv = ",
                                state.value_dim());
    if (scratch.query_row_.cols() != state.key_dim() || scratch.query_features_.cols() != r ||
        scratch.scores_.size() < state.pending_tokens())
      detail::throw_shape_error("read scratch was made for dk=", scratch.query_row_.cols(),
                                " r=", scratch.query_features_.cols(), " and ",
                                scratch.scores_.size(), " pending tokens, the state has dk=",
                                state.key_dim(), " r=", r, " and ", state.pending_tokens(),
                                "; make it with this attention's make_read_scratch(dk, dv)");
    const auto q_row = detail::row_view(q, scratch.query_row_, "q", y.data(), y.size());
    Eigen::Ref<RowMatrix<Scalar>> qf(scratch.query_features_);
    phi_.apply(q_row, qf);
    read_features(state, qf.data(), y.data(), scratch.scores_.data());
  }

  // ---- grouped query heads: one state per key/value head ----------------------------------

  /// Stateless attention of G query heads that share one key/value head: output(g) =
  /// parallel(query(g), K, V, mask) for g < G. Mask::causal runs the grouped chunked pass below
  /// from an empty state; Mask::none computes phi(K)^T V and phi(K)^T 1 once and reads them
  /// per head (Tq may differ from Tk). query(g) and output(g) as below. Each output has the
  /// bits of parallel_into(query(g), K, V, mask, out). Ordinary feature maps only.
  template <class QueryAt, class DK, class DV, class OutputAt>
  void parallel_group_into(Index group, QueryAt&& query, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, Mask mask, OutputAt&& output) const {
    if (mask == Mask::causal) {
      State state = make_state(K.cols(), V.cols());
      parallel_group_into(group, query, K, V, state, output);
      return;
    }
    check_group<QueryAt, true>(group);
    for (Index g = 0; g < group; ++g) {
      OutputRef out = output(g);
      check_common(query(g), K, V, out);
    }
    full_reads(group, query, detail::materialize(K), detail::materialize(V),
               [&](Index g) -> OutputRef { return output(g); });
  }

  /// Causal prefill of G query heads that share one key/value head (grouped-query attention):
  /// for g < G, output(g) = parallel(query(g), K, V, Mask::causal) continued from `state`,
  /// while the state absorbs K and V once. query(g) returns head g's T x dk queries as an
  /// Eigen object with direct access (a Matrix, Map or block of one); output(g) returns its
  /// T x dv output as anything that binds to OutputRef. Each head's output has the bits of
  /// parallel_into() on its own copy of the state; the state ends as that call leaves it.
  /// Cost per token: G reads (2 r dv + about C (r + dv) flops each) and one update (2 r dv),
  /// where G separate calls pay G updates. If a denominator is rejected, the state holds the
  /// chunks before the failing one; heads before the failing head have written that chunk's
  /// rows, the rest of the outputs are unspecified. Ordinary feature maps only.
  template <class QueryAt, class DK, class DV, class OutputAt>
  void parallel_group_into(Index group, QueryAt&& query, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, State& state, OutputAt&& output) const {
    check_group<QueryAt, true>(group);
    check_state(state, K.cols(), V.cols());
    for (Index g = 0; g < group; ++g) {
      OutputRef out = output(g);
      check_causal(query(g), K, V, out);
    }
    state.settle();
    const auto& Km = detail::materialize(K);
    const auto& Vm = detail::materialize(V);
    detail::causal_chunked<Scalar>(phi_, group, query, Km, Vm, state.S_, state.z_,
                                   state.tokens_, options_.chunk_size, options_.normalization,
                                   [&](Index g) -> OutputRef { return output(g); });
  }

  /// One decode token for G query heads that share one state: absorbs (k, v) once, then
  /// writes output(g) = phi(q_g)^T S / phi(q_g)^T z for each query(g) (length dk, as step()
  /// takes q; output(g) a 1 x dv row that binds to Eigen::Ref<RowVector<Scalar>>). The same
  /// as absorb() followed by read_into() per head, bit for bit, so with a decode block each
  /// head gets step()'s bits. Strong guarantee: every head's denominator is checked before
  /// the state changes, so a rejected one (or a query of the wrong shape) leaves the state
  /// unchanged and no output written.
  /// output(g) may overlap query(g), k or v (they are read first), not another head's query.
  /// Uses the state's own scratch (no allocation); O(r dv + G r dv + B (r + dv) G).
  /// Ordinary feature maps only.
  template <class QueryAt, class Dk, class Dv, class OutputAt>
  void step_group_into(State& state, Index group, QueryAt&& query, const Eigen::MatrixBase<Dk>& k,
                       const Eigen::MatrixBase<Dv>& v, OutputAt&& output) const {
    check_group<QueryAt, false>(group);
    check_state(state, state.key_dim(), state.value_dim());
    const Index r = state.feature_dim();
    for (Index g = 0; g < group; ++g) {
      Eigen::Ref<RowVector<Scalar>> y = output(g);
      if (y.size() != state.value_dim())
        detail::throw_shape_error("output ", g, " of the group has length ", y.size(),
                                  ", expected dv = ", state.value_dim());
    }
    const auto k_row = detail::row_view(k, state.key_row_, "k", static_cast<const Scalar*>(nullptr), 0);
    const auto v_row = detail::row_view(v, state.value_row_, "v", static_cast<const Scalar*>(nullptr), 0);
    Eigen::Ref<RowMatrix<Scalar>> kf(state.key_features_), qf(state.query_features_);
    phi_.apply(k_row, kf);
    const Normalization& norm = options_.normalization;
    // z after this token, with the adds absorb_features() will make, for the checks.
    state.z_next_ = state.z_ + kf.transpose();
    // Every query's shape, and its denominator where the policy divides, before any change.
    for (Index g = 0; g < group; ++g) {
      decltype(auto) q = query(g);  // kept alive while q_row may point into it
      const auto q_row =
          detail::row_view(q, state.query_row_, "q", static_cast<const Scalar*>(nullptr), 0);
      if (!norm.divides()) continue;
      phi_.apply(q_row, qf);
      static_cast<void>(norm.divisor(detail::ordered_dot(qf.data(), state.z_next_.data(), r),
                                     state.tokens()));
    }
    absorb_features(state, kf, v_row);  // kf still holds phi(k)
    for (Index g = 0; g < group; ++g) {
      Eigen::Ref<RowVector<Scalar>> y = output(g);
      decltype(auto) q = query(g);
      const auto q_row = detail::row_view(q, state.query_row_, "q", y.data(), y.size());
      phi_.apply(q_row, qf);
      read_features(state, qf.data(), y.data(), state.pending_.scores.data());
    }
  }

 private:
  // What every grouped call requires: an ordinary map and G >= 1; with `Prefill`, queries with
  // direct access (the chunked kernel reads their rows in place).
  template <class QueryAt, bool Prefill>
  static void check_group(Index group) {
    static_assert(!log_scaled,
                  "grouped heads share a state with ordinary feature maps only; a log-scaled "
                  "map (random features) keeps one state per query head");
    if constexpr (Prefill) {
      using QueryType = std::remove_cvref_t<std::invoke_result_t<QueryAt&, Index>>;
      static_assert((QueryType::Flags & Eigen::DirectAccessBit) != 0,
                    "query(g) must return a matrix, Map or block with direct access (copy an "
                    "expression into a matrix first)");
    }
    if (group < 1)
      detail::throw_shape_error("a query group needs at least one head, got ", group);
  }

  // absorb()'s update from the key's features kf (1 x r) and the value row v_row.
  template <class Kf, class Vr>
  static void absorb_features(State& state, const Kf& kf, const Vr& v_row) {
    state.z_ += kf.transpose();
    if (state.pending_.capacity > 0)
      detail::append_pending(state.S_, state.pending_, kf.data(), v_row.data());
    else
      state.S_.noalias() += kf.transpose() * v_row;
    ++state.tokens_;
  }

  // read_into()'s read from the query's features qf (r scalars) into y (dv scalars), with
  // `scores` room for the pending tokens; the denominator's row is the last absorbed token.
  void read_features(const State& state, const Scalar* qf, Scalar* y, Scalar* scores) const {
    const Scalar den = detail::ordered_dot(qf, state.z_.data(), state.feature_dim());
    const Index row = std::max<Index>(state.tokens() - 1, 0);
    const Scalar divisor = options_.normalization.divisor(den, row);
    detail::read_with_pending(state.S_, state.pending_, qf, y, scores, divisor,
                              options_.normalization.divides(), false);
  }

  // A state fits when its dims match and it was made for this kind of feature map (a state
  // for a log-scaled map starts at M = -inf; an ordinary one keeps M = 0).
  void check_state(const State& state, Index dk, Index dv) const {
    state.check_shape(phi_.feature_dim(dk), dk, dv);
    if (state.log_domain() != log_scaled)
      detail::throw_shape_error("state was made for ", state.log_domain() ? "a log-scaled" : "an ordinary",
                                " feature map; make it with this attention's make_state()");
  }

  template <class DQ, class DK, class DV, class DO>
  static void check_causal(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, const DO& out) {
    check_common(Q, K, V, out);
    if (Q.rows() != K.rows())
      detail::throw_shape_error("causal attention needs as many queries as keys, got Q ",
                                detail::shape_of(Q), " and K ", detail::shape_of(K));
  }

  template <class DQ, class DK, class DV, class DO>
  static void check_common(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, const DO& out) {
    if (Q.cols() != K.cols())
      detail::throw_shape_error("Q and K need the same key dimension, got Q ",
                                detail::shape_of(Q), " and K ", detail::shape_of(K));
    if (K.rows() != V.rows())
      detail::throw_shape_error("K and V need one row per token, got K ", detail::shape_of(K),
                                " and V ", detail::shape_of(V));
    if (out.rows() != Q.rows() || out.cols() != V.cols())
      detail::throw_shape_error("output is ", detail::shape_of(out), ", expected ", Q.rows(),
                                "x", V.cols(), " (Q rows x V cols)");
  }

  // Features of rows [first, first + n) of X into the first n rows of `buffer`.
  template <class DX>
  auto features(const DX& X, Index first, Index n, RowMatrix<Scalar>& buffer) const {
    Eigen::Ref<RowMatrix<Scalar>> f(buffer.topRows(n));
    phi_.apply(X.middleRows(first, n), f);
    return buffer.topRows(n);
  }

  template <class DQ, class DK, class DV>
  void full(const DQ& Q, const DK& K, const DV& V, OutputRef out) const {
    check_common(Q, K, V, out);
    if constexpr (log_scaled) {
      detail::log_domain_full_read<Scalar>(phi_, Q, K, V, out, options_.normalization);
    } else {
      full_reads(1, [&](Index) -> const DQ& { return Q; }, K, V,
                 [&](Index) -> OutputRef { return out; });
    }
  }

  // The full read for `group` queries of one K, V (ordinary maps): S = phi(K)^T V and
  // z = phi(K)^T 1 once, then output(g) = phi(query(g)) S / phi(query(g)) z per head.
  template <class QueryAt, class DK, class DV, class OutputAt>
  void full_reads(Index group, const QueryAt& query, const DK& K, const DV& V,
                  const OutputAt& output) const {
    const Index r = phi_.feature_dim(K.cols());
    RowMatrix<Scalar> qf, kf(K.rows(), r);
    features(K, 0, K.rows(), kf);
    const RowMatrix<Scalar> S = kf.transpose() * V;
    const ColVector<Scalar> z = kf.colwise().sum().transpose();
    ColVector<Scalar> den;
    for (Index g = 0; g < group; ++g) {
      decltype(auto) Q = query(g);
      OutputRef out = output(g);
      qf.resize(Q.rows(), r);
      features(Q, 0, Q.rows(), qf);
      out.noalias() = qf * S;
      if (!options_.normalization.divides()) continue;
      den.noalias() = qf * z;
      for (Index i = 0; i < out.rows(); ++i)
        out.row(i) /= options_.normalization.divisor(den(i), i);
    }
  }

  template <class DQ, class DK, class DV>
  void causal_chunked(const DQ& Q, const DK& K, const DV& V, State& state, OutputRef out) const {
    if constexpr (log_scaled) {
      detail::log_domain_causal<Scalar>(phi_, Q, K, V, state.S_, state.z_, state.log_scale_,
                                        state.tokens_, options_.chunk_size, out,
                                        options_.normalization);
    } else {
      detail::causal_chunked<Scalar>(
          phi_, 1, [&](Index) -> const DQ& { return Q; }, K, V, state.S_, state.z_,
          state.tokens_, options_.chunk_size, options_.normalization,
          [&](Index) -> OutputRef { return out; });
    }
  }

  template <class Rq, class Rk, class Rv, class Ry>
  void token(State& state, const Rq& q, const Rk& k, const Rv& v, Ry&& y, Index row) const {
    static_assert(std::remove_reference_t<Ry>::InnerStrideAtCompileTime == 1,
                  "token() writes y through a pointer; pass a contiguous row");
    if constexpr (log_scaled) {
      detail::log_domain_step<Scalar>(phi_, q, k, v, state.query_features_, state.key_features_,
                                      state.S_, state.z_, state.z_next_, state.log_scale_, y,
                                      options_.normalization, row);
      ++state.tokens_;
    } else {
      static_assert(Rv::InnerStrideAtCompileTime == 1,
                    "token() reads v through a pointer; pass a contiguous row (row_view)");
      detail::prefetch_for_write(y.data(), y.size());
      Eigen::Ref<RowMatrix<Scalar>> qf(state.query_features_), kf(state.key_features_);
      phi_.apply(q, qf);
      phi_.apply(k, kf);
      // Each advances state.tokens_ once the token is absorbed.
      if (state.pending_.capacity > 0)
        detail::deferred_token<Scalar>(state.S_, state.z_, state.z_next_, state.pending_,
                                       qf.data(), kf.data(), v.data(), y.data(),
                                       options_.normalization, row, state.tokens_);
      else
        detail::recurrent_token_fused<Scalar>(state.S_, state.z_, state.z_next_, qf.data(),
                                              kf.data(), v.data(), y.data(),
                                              options_.normalization, row, state.tokens_);
    }
  }

  // The plain recurrent path over T tokens. Features are computed for blocks of tokens at a
  // time, and tokens at positions (2m, 2m + 1) share one sweep over S, which halves the state
  // traffic per token; a token without its partner in this call (the first when the state holds
  // an odd count, the last when the count ends odd) sweeps alone. The arithmetic per token is
  // the same either way (detail::sweep_tokens), so the results equal step()'s bit for bit,
  // whatever the split between calls (given a feature map whose rows do not depend on the
  // other rows of the call, as linattn's). Allocates the block scratch once per call, nothing
  // per token.
  template <class DQ, class DK, class DV>
  void recurrent_pairs(const DQ& Q, const DK& K, const DV& V, State& state, OutputRef out) const {
    const Index T = Q.rows(), r = state.feature_dim(), dv = state.value_dim();
    if (T == 0) return;
    // 32 tokens of features per block: few calls of the feature map, scratch that stays in L1.
    // A shorter call is one block (T + 1 rows leave room for the odd start below).
    const Index block = std::min<Index>(T + 1, 32);
    // Feature rows start at the alignment Eigen vectorizes for, as the 1 x r rows step() uses:
    // a vectorized feature map then takes the same packet or scalar path for every element
    // either way, so features do not differ in the last bit between the two paths.
    constexpr Index align = std::max<Index>(1, EIGEN_MAX_ALIGN_BYTES / Index{sizeof(Scalar)});
    const Index ld = (r + align - 1) / align * align;
    RowMatrix<Scalar> qf_rows(block, ld), kf_rows(block, ld);
    constexpr bool contiguous_v = DV::IsRowMajor && DV::InnerStrideAtCompileTime == 1;
    RowMatrix<Scalar> v_rows(contiguous_v ? 0 : block, dv);
    ColVector<Scalar> z_mid(r);
    using FeatureRows = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

    Index first = 0;
    while (first < T) {
      // Blocks end at even positions, so a pair never straddles two blocks.
      const Index n = std::min(block - (state.tokens_ + first) % 2, T - first);
      FeatureRows qf_map(qf_rows.data(), n, r, Eigen::OuterStride<>(ld));
      FeatureRows kf_map(kf_rows.data(), n, r, Eigen::OuterStride<>(ld));
      Eigen::Ref<RowMatrix<Scalar>> qf(qf_map), kf(kf_map);
      phi_.apply(Q.middleRows(first, n), qf);
      phi_.apply(K.middleRows(first, n), kf);
      if constexpr (!contiguous_v) v_rows.topRows(n) = V.middleRows(first, n);
      const auto v_row = [&](Index i) -> const Scalar* {
        if constexpr (contiguous_v)
          return V.row(first + i).data();
        else
          return v_rows.row(i).data();
      };
      Index i = 0;
      while (i < n) {
        const Index t = first + i;
        // Output rows of the next sweep, requested now so that they arrive during this one.
        for (Index ahead = t + 2; ahead < std::min(t + 4, T); ++ahead)
          detail::prefetch_for_write(out.row(ahead).data(), dv);
        if (state.tokens_ % 2 == 0 && i + 1 < n) {
          const Scalar* const qf2[2] = {qf.row(i).data(), qf.row(i + 1).data()};
          const Scalar* const kf2[2] = {kf.row(i).data(), kf.row(i + 1).data()};
          const Scalar* const v2[2] = {v_row(i), v_row(i + 1)};
          Scalar* const y2[2] = {out.row(t).data(), out.row(t + 1).data()};
          detail::recurrent_token_pair<Scalar>(state.S_, state.z_, z_mid, state.z_next_, qf2,
                                               kf2, v2, y2, options_.normalization, t,
                                               state.tokens_);
          i += 2;
        } else {
          detail::recurrent_token_fused<Scalar>(state.S_, state.z_, state.z_next_,
                                                qf.row(i).data(), kf.row(i).data(), v_row(i),
                                                out.row(t).data(), options_.normalization, t,
                                                state.tokens_);
          i += 1;
        }
      }
      first += n;
    }
  }

  // Features in a shifted log domain (random features): S, z kept as exp(M) (S, z).
  static constexpr bool log_scaled = LogScaledFeatureMap<Phi, Scalar>;

  Phi phi_{};
  Options options_{};
};

}  // namespace linattn
