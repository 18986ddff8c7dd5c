#pragma once
// The entry points of RuleAttention behind its public declarations: they split the trailing
// arguments (per-token inputs, then the mask and/or the output), check every shape and the
// state's identity, bind the per-token inputs, and dispatch to the additive or rule paths.
// RuleAttention derives from AttentionCalls<RuleAttention> and befriends it, so the class
// header holds the interface and its documentation, and this one the plumbing.

#include <linattn/detail/additive_paths.hpp>
#include <linattn/detail/call_args.hpp>
#include <linattn/detail/checks.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/erased_rows.hpp>
#include <linattn/detail/head_group.hpp>
#include <linattn/detail/rule_paths.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <span>
#include <tuple>
#include <type_traits>
#include <utility>

namespace linattn::detail {

template <class Derived>
class AttentionCalls {
 protected:
  [[nodiscard]] const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  template <int Inputs, std::size_t Given, int Trailing>
  static constexpr void check_arity() {
    static_assert(Given == Inputs + Trailing,
                  "wrong arguments for this write rule: after Q, K, V (or q, k, v) come its "
                  "per-token inputs (Additive, Decay: none; Gated: log-gates; Delta: beta; "
                  "GatedDelta: beta then log_alpha), then the mask of a stateless parallel "
                  "call, then the output of an *_into call");
  }

  template <class State>
  void check_state(const State& state, Index dk, Index dv) const {
    state.check_shape(self().feature_dim(dk), dk, dv);
    state.check_identity(self().state_identity());
  }

  // ---- stateless parallel ------------------------------------------------------------------

  template <class DQ, class DK, class DV, class... Args>
  void parallel_into(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    using Rule = typename Derived::rule_type;
    using OutputRef = typename Derived::OutputRef;
    check_arity<Rule::token_inputs, sizeof...(Args), 2>();
    with_last_two(
        [&](const auto& inputs, const auto& mask, auto&& out_arg) {
          OutputRef out(out_arg);
          const bool causal = mask_is_causal(mask);
          check_inputs(Q, K, V, causal);
          check_output(out, Q.rows(), V.cols());
          const auto& Qm = materialize(Q);
          const auto& Km = materialize(K);
          const auto& Vm = materialize(V);
          const auto query = [&](Index) -> const auto& { return Qm; };
          const auto output = [&](Index) -> OutputRef { return out; };
          if (!causal) {
            if constexpr (Rule::has_full_form) run_full(1, query, Km, Vm, output);
            return;
          }
          auto state = self().make_state(K.cols(), V.cols());
          run_causal<false>(state, 1, query, Km, Vm, inputs, output);
        },
        std::forward<Args>(args)...);
  }

  template <class Queries, class DK, class DV, class... Args>
  void parallel_group_into(Queries queries, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    using Rule = typename Derived::rule_type;
    using OutputRef = typename Derived::OutputRef;
    require_groups();
    check_arity<Rule::token_inputs, sizeof...(Args), 2>();
    with_last_two(
        [&](const auto& inputs, const auto& mask, auto&& outputs_arg) {
          const auto outputs = output_group<typename Derived::scalar_type>(outputs_arg);
          const bool causal = mask_is_causal(mask);
          const Index Tq = queries.empty() ? 0 : queries[0].rows();
          static_cast<void>(Tq);
          check_kv(queries, K, V, causal ? K.rows() : Tq, outputs);
          const auto& Km = materialize(K);
          const auto& Vm = materialize(V);
          const auto query = [&](Index g) { return queries[g]; };
          const auto output = [&](Index g) -> OutputRef { return outputs[g]; };
          const auto G = static_cast<Index>(queries.size());
          if (!causal) {
            if constexpr (Rule::has_full_form) run_full(G, query, Km, Vm, output);
            return;
          }
          auto state = self().make_state(K.cols(), V.cols());
          run_causal<false>(state, G, query, Km, Vm, inputs, output);
        },
        std::forward<Args>(args)...);
  }

  // ---- a carried state -----------------------------------------------------------------------

  template <bool Recurrent, class State, class DQ, class DK, class DV, class... Args>
  void causal_into(State& state, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                   const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    using Rule = typename Derived::rule_type;
    using OutputRef = typename Derived::OutputRef;
    check_arity<Rule::token_inputs, sizeof...(Args), 1>();
    with_last(
        [&](const auto& inputs, auto&& out_arg) {
          OutputRef out(out_arg);
          check_inputs(Q, K, V, true);
          check_output(out, Q.rows(), V.cols());
          check_state(state, K.cols(), V.cols());
          state.check_room(K.rows());
          const auto& Qm = materialize(Q);
          const auto& Km = materialize(K);
          const auto& Vm = materialize(V);
          if constexpr (Recurrent) {
            run_recurrent(state, Qm, Km, Vm, inputs, out);
          } else {
            run_causal<false>(state, 1, [&](Index) -> const auto& { return Qm; }, Km, Vm, inputs,
                              [&](Index) -> OutputRef { return out; });
          }
        },
        std::forward<Args>(args)...);
  }

  template <class State, class Queries, class DK, class DV, class... Args>
  void prefill_group_into(State& state, Queries queries, const Eigen::MatrixBase<DK>& K,
                          const Eigen::MatrixBase<DV>& V, Args&&... args) const {
    using Rule = typename Derived::rule_type;
    using OutputRef = typename Derived::OutputRef;
    require_groups();
    check_arity<Rule::token_inputs, sizeof...(Args), 1>();
    with_last(
        [&](const auto& inputs, auto&& outputs_arg) {
          const auto outputs = output_group<typename Derived::scalar_type>(outputs_arg);
          check_kv(queries, K, V, K.rows(), outputs);
          check_state(state, K.cols(), V.cols());
          state.check_room(K.rows());
          const auto& Km = materialize(K);
          const auto& Vm = materialize(V);
          run_causal<false>(
              state, static_cast<Index>(queries.size()),
              [&](Index g) { return queries[g]; }, Km, Vm,
              inputs, [&](Index g) -> OutputRef { return outputs[g]; });
        },
        std::forward<Args>(args)...);
  }

  // ---- decode ---------------------------------------------------------------------------------

  template <class State, class Dq, class Dk, class Dv, class... Args>
  void step_into(State& state, const Eigen::MatrixBase<Dq>& q, const Eigen::MatrixBase<Dk>& k,
                 const Eigen::MatrixBase<Dv>& v, Args&&... args) const {
    using Rule = typename Derived::rule_type;
    using Scalar = typename Derived::scalar_type;
    check_arity<Rule::token_inputs, sizeof...(Args), 1>();
    with_last(
        [&](const auto& inputs, auto&& y_arg) {
          Eigen::Ref<RowVector<Scalar>> y(y_arg);
          const Index dk = state.key_dim(), dv = state.value_dim();
          check_state(state, dk, dv);
          check_token(q, k, v, dk, dv);
          check_output(y, 1, dv, "step output");
          state.check_room(1);
          auto& scratch = StateAccess::scratch(state);
          // Read in place where the caller's vectors are contiguous and are not y (an in-place
          // update y = v, say), else from copies in the state's scratch.
          const auto q_row = row_view(q, scratch.query_row, "q", y.data(), y.size());
          const auto k_row = row_view(k, scratch.key_row, "k", y.data(), y.size());
          const auto v_row = row_view(v, scratch.value_row, "v", y.data(), y.size());
          if constexpr (Rule::kind == WriteKind::additive) {
            additive_token(self().feature_map(), norm(), state, q_row, k_row, v_row, y,
                           state.tokens());
          } else {
            const auto in = bind_step(state, inputs);
            rule_token(self().feature_map(), norm(), state, q_row, k_row, v_row, in, y,
                       state.tokens());
          }
        },
        std::forward<Args>(args)...);
  }

  template <class State, class Queries, class Dk, class Dv, class... Args>
  void step_group_into(State& state, Queries queries, const Eigen::MatrixBase<Dk>& k,
                       const Eigen::MatrixBase<Dv>& v, Args&&... args) const {
    using Rule = typename Derived::rule_type;
    using Scalar = typename Derived::scalar_type;
    require_groups();
    check_arity<Rule::token_inputs, sizeof...(Args), 1>();
    with_last(
        [&](const auto& inputs, auto&& outputs_arg) {
          const auto outputs = output_group<typename Derived::scalar_type>(outputs_arg);
          const Index dk = state.key_dim(), dv = state.value_dim();
          check_state(state, dk, dv);
          check_token(k, k, v, dk, dv);
          check_group(queries, outputs, 1, dk, dv);
          state.check_room(1);
          auto& scratch = StateAccess::scratch(state);
          const Scalar* none = nullptr;
          const auto k_row = row_view(k, scratch.key_row, "k", none, 0);
          const auto v_row = row_view(v, scratch.value_row, "v", none, 0);
          if constexpr (Rule::kind == WriteKind::additive) {
            additive_step_group(self().feature_map(), norm(), state, queries, k_row, v_row, outputs);
          } else {
            const auto in = bind_step(state, inputs);
            rule_step_group(self().feature_map(), norm(), state, queries, k_row, v_row, in, outputs);
          }
        },
        std::forward<Args>(args)...);
  }

  // ---- one state, several readers (additive) ---------------------------------------------------

  template <class State, class Dk, class Dv>
  void absorb(State& state, const Eigen::MatrixBase<Dk>& k, const Eigen::MatrixBase<Dv>& v) const {
    using Scalar = typename Derived::scalar_type;
    require_shared_reads();
    const Index dk = state.key_dim(), dv = state.value_dim();
    check_state(state, dk, dv);
    check_token(k, k, v, dk, dv);
    state.check_room(1);
    auto& scratch = StateAccess::scratch(state);
    const Scalar* none = nullptr;
    const auto k_row = row_view(k, scratch.key_row, "k", none, 0);
    const auto v_row = row_view(v, scratch.value_row, "v", none, 0);
    Eigen::Ref<RowMatrix<Scalar>> kf(scratch.key_features);
    self().feature_map().apply(k_row, kf);
    additive_absorb_features(state, kf, v_row);
  }

  template <class State, class Dq, class Y, class ReadScratchT>
  void read_into(const State& state, const Eigen::MatrixBase<Dq>& q, Y& y,
                 ReadScratchT& read_scratch) const {
    using Scalar = typename Derived::scalar_type;
    require_shared_reads();
    const Index dk = state.key_dim(), dv = state.value_dim(), r = state.feature_dim();
    check_state(state, dk, dv);
    check_token(q, q, y, dk, dv);
    auto& scratch = StateAccess::scratch(read_scratch);
    auto& scores = StateAccess::scores(read_scratch);
    if (scratch.query_row.cols() != dk || scratch.query_features.cols() != r ||
        scores.size() < state.pending_tokens())
      throw_shape_error("read scratch was made for dk=", scratch.query_row.cols(),
                        " r=", scratch.query_features.cols(), " and ", scores.size(),
                        " pending tokens, the state has dk=", dk, " r=", r, " and ",
                        state.pending_tokens(), "; make it with ReadScratch(state)");
    const auto q_row = row_view(q, scratch.query_row, "q", y.data(), y.size());
    Eigen::Ref<RowMatrix<Scalar>> qf(scratch.query_features);
    self().feature_map().apply(q_row, qf);
    additive_read_features(norm(), state, qf.data(), y.data(), scores.data());
  }

 private:
  [[nodiscard]] const Normalization& norm() const noexcept { return self().options().normalization; }

  static constexpr void require_groups() {
    static_assert(!Derived::log_scaled,
                  "grouped heads share a state with ordinary feature maps only; a log-scaled "
                  "map (random features) keeps one state per query head");
  }
  static constexpr void require_shared_reads() {
    static_assert(Derived::rule_type::kind == WriteKind::additive && !Derived::log_scaled,
                  "absorb() and read_into() take the additive rule with an ordinary feature "
                  "map; a log-scaled map (random features) rescales S per token: use step(), "
                  "and other rules read groups through step_into(state, queries, ...)");
  }

  template <class M>
  static bool mask_is_causal(const M& mask) {
    static_assert(MaskArgument<M>,
                  "the argument before the output must be the mask: Mask::none or Mask::causal");
    if constexpr (is_causal_constant<M>) {
      return true;
    } else {
      static_assert(Derived::rule_type::has_full_form,
                    "this write rule has no full (non-causal) form: its state decays or "
                    "corrects in token order; pass Mask::causal");
      return Mask(mask).is_causal();
    }
  }

  // K (Tk x dk), V (Tk x dv) and a group of queries of Tq rows with their outputs.
  template <class Queries, class DK, class DV, class Outputs>
  static void check_kv(const Queries& queries, const Eigen::MatrixBase<DK>& K,
                       const Eigen::MatrixBase<DV>& V, Index Tq, const Outputs& outputs) {
    if (K.rows() != V.rows() || K.cols() < 1 || V.cols() < 1)
      throw_shape_error("K and V need one row per token and dk, dv >= 1, got K ", shape_of(K),
                        " and V ", shape_of(V));
    check_group(queries, outputs, Tq, K.cols(), V.cols());
  }

  // Binds the per-token inputs of a T-token call for the rule (the forward paths take
  // GatedDelta's per-channel log_alpha).
  template <class Tuple, class Scalar>
  void bind(const Tuple& inputs, Index T, Index r, TokenInputs<Scalar>& out) const {
    bind_token_inputs<Scalar>(self().rule(), inputs, T, r, out);
  }
  template <class State, class Tuple>
  auto bind_step(State& state, const Tuple& inputs) const {
    using Scalar = typename Derived::scalar_type;
    return std::apply(
        [&](const auto&... in) {
          return bind_step_inputs<Scalar>(self().rule(), StateAccess::scratch(state).gates, in...);
        },
        inputs);
  }

  // The kernels get views (erased_rows.hpp) where the inputs allow, so that they are compiled
  // once per attention type, not once per caller's argument types.
  template <bool Recurrent, class State, class QueryAt, class DK, class DV, class Tuple, class OutputAt>
  void run_causal(State& state, Index group, const QueryAt& query, const DK& K, const DV& V,
                  const Tuple& inputs, const OutputAt& output) const {
    using Rule = typename Derived::rule_type;
    using Scalar = typename Derived::scalar_type;
    const Index r = state.feature_dim(), C = self().chunk_size(r, state.value_dim());
    TokenInputs<Scalar> in;
    if constexpr (Rule::kind != WriteKind::additive) bind(inputs, K.rows(), r, in);
    with_row_views<Scalar>(group, query, K, V, output,
                           [&](const auto& q, const auto& k, const auto& v, const auto& o) {
                             if constexpr (Rule::kind == WriteKind::additive)
                               additive_chunked(self().feature_map(), norm(), C, group, q, k, v,
                                                state, o);
                             else
                               rule_chunked(self().feature_map(), norm(), C, group, q, k, v, in,
                                            state, o);
                           });
  }

  template <class QueryAt, class DK, class DV, class OutputAt>
  void run_full(Index group, const QueryAt& query, const DK& K, const DV& V,
                const OutputAt& output) const {
    using Scalar = typename Derived::scalar_type;
    with_row_views<Scalar>(group, query, K, V, output,
                           [&](const auto& q, const auto& k, const auto& v, const auto& o) {
                             additive_full<Scalar>(self().feature_map(), norm(), group, q, k, v,
                                                   o);
                           });
  }

  template <class State, class DQ, class DK, class DV, class Tuple, class Out>
  void run_recurrent(State& state, const DQ& Q, const DK& K, const DV& V, const Tuple& inputs,
                     Out& out) const {
    using Rule = typename Derived::rule_type;
    using Scalar = typename Derived::scalar_type;
    TokenInputs<Scalar> in;
    if constexpr (Rule::kind != WriteKind::additive) bind(inputs, K.rows(), state.feature_dim(), in);
    const auto run = [&](const auto& q, const auto& k, const auto& v) {
      if constexpr (Rule::kind == WriteKind::additive)
        additive_recurrent(self().feature_map(), norm(), q, k, v, state, out);
      else
        rule_recurrent(self().feature_map(), norm(), q, k, v, in, state, out);
    };
    if constexpr (is_rows_of<Scalar, DQ>() && is_rows_of<Scalar, DK>() && is_rows_of<Scalar, DV>())
      run(const_rows_view<Scalar>(Q), const_rows_view<Scalar>(K), const_rows_view<Scalar>(V));
    else
      run(Q, K, V);
  }
};

}  // namespace linattn::detail
