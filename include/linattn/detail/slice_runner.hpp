#pragma once
// One process's part of a sequence-parallel causal prefill, for one state head and the G query
// heads that read it, whatever carries the summaries between processes (linattn/mpi.hpp does,
// over MPI). The sequence is split into contiguous slices; this process holds slice p.
//
// Two phases around the exchange, so that no process waits for another before it computes
// (the LASP order: Sun et al. 2024):
//   run_local    before the exchange. Computes the slice's outputs as if the state before it
//                were zero, and its summary (slice_summary.hpp). Where the carried state is
//                known to be zero (the first non-empty slice of a sequence that starts empty)
//                this is the attention's own prefill and the outputs are final. Elsewhere:
//                  decayed and gated rules (and Additive): the numerators only,
//                    num_t = qf_t^T B_t   (an unnormalized prefill from zero);
//                  delta rules: one prefill of the state [I | 0] (r x (r + dv)) with values
//                    [0 | v_t], whose outputs are [qf_t^T A_t | qf_t^T B_t] and whose final
//                    state is [A_p | B_p]: the slice's map and its numerators in one pass.
//   apply_carry  after the exchange, with the carried state (S_c, z_c):
//                  y_t = (num_t + (qf_t .* d_t)^T S_c) / divisor(qf_t^T z_t)
//                  (d_t the decay from the slice's start through t; z_t from z_c by the
//                  recurrence z_t = g_t .* z_{t-1} + kf_t, in double), or, for the delta rules,
//                  y_t = qf_t^T B_t + (qf_t^T A_t) S_c.
// Cost per token beyond a single-process prefill: none where the carry is known zero; else
// 2 r dv flops per query head (one product with S_c) plus the feature maps again and O(r) for
// z (normalized rules), or a second pass of width r for A (delta rules: about twice a prefill).
// Scratch is allocated once per call; the delta rules keep qf_t^T A_t (T x r per query head,
// the size of the queries) from run_local to apply_carry.

#include <linattn/detail/slice_summary.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/errors.hpp>
#include <linattn/options.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// Rows of a matrix held elsewhere (pointer, shape, distance between rows); Element is const
/// for inputs. view() is the Eigen::Map the attention's calls take.
template <class Element>
struct RowsSpec {
  using Scalar = std::remove_const_t<Element>;
  using View = std::conditional_t<std::is_const_v<Element>, ConstRowsView<Scalar>, RowsView<Scalar>>;
  Element* data = nullptr;
  Index rows = 0, cols = 0, stride = 0;

  template <class M>
  static RowsSpec of(M&& m) {
    return {m.data(), m.rows(), m.cols(), m.outerStride()};
  }
  [[nodiscard]] View view() const { return View(data, rows, cols, Eigen::OuterStride<>(stride)); }
  [[nodiscard]] RowsSpec middle(Index first, Index n) const {
    return {n == 0 ? data : data + first * stride, n, cols, stride};
  }
};

/// One state head of one sequence on this process: its G query heads and outputs, its keys,
/// values and bound per-token inputs (all T rows of the slice), and what run_local keeps for
/// apply_carry.
template <class Scalar>
struct SliceItem {
  std::vector<RowsSpec<const Scalar>> queries;  // G heads, T x dk
  std::vector<RowsSpec<Scalar>> outputs;        // G heads, T x dv
  RowsSpec<const Scalar> keys, values;          // T x dk, T x dv
  TokenInputs<Scalar> inputs;                   // the rule's per-token inputs, bound and checked
  std::vector<RowMatrix<Scalar>> carry_reads;   // delta rules: qf_t^T A_t per query head
  bool direct = false;                          // the carried state is known to be zero
};

/// The per-token inputs of rows [first, first + n), as the arguments the attention's calls take.
template <class Rule, class Scalar>
auto input_rows(const TokenInputs<Scalar>& in, Index first, Index n) {
  if constexpr (Rule::kind == WriteKind::gated)
    return std::make_tuple(in.log_gate.middle_rows(first, n).map());
  else if constexpr (Rule::kind == WriteKind::delta)
    return std::make_tuple(in.beta.middle_rows(first, n).map());
  else if constexpr (Rule::kind == WriteKind::gated_delta)
    return std::make_tuple(in.beta.middle_rows(first, n).map(),
                           in.log_alpha.middle_rows(first, n).map());
  else
    return std::tuple<>();
}

/// Both phases for one attention (see the file comment). Holds the attention and, for the
/// rules that keep z, a copy reading unnormalized (same map, rule and chunk size: its states
/// are the attention's).
template <class Attention>
class SliceRunner {
 public:
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  static constexpr CarryMap map = carry_map_of<Rule>();

  SliceRunner(const Attention& attention, Index dk, Index dv)
      : attention_(attention),
        local_(attention.feature_map(), attention.rule(), unnormalized(attention.options())),
        dk_(dk),
        dv_(dv),
        r_(attention.feature_dim(dk)),
        layout_(SummaryLayout::of<Rule>(r_, dv)) {}

  [[nodiscard]] const SummaryLayout& layout() const noexcept { return layout_; }

  /// Phase 1: the slice's outputs from a zero carry (final where item.direct) and its summary,
  /// written to `summary` (layout().scalars() values).
  void run_local(SliceItem<Scalar>& item, Scalar* summary) const {
    const SummaryRef<Scalar> s{summary, layout_};
    const Index T = item.keys.rows, G = static_cast<Index>(item.queries.size());
    if (T == 0 || item.direct || map != CarryMap::matrix) {
      if (T > 0) {
        const Attention& attention = item.direct ? attention_ : local_;
        auto work = attention.make_state(dk_, dv_);
        prefill(attention, work, item, 0, T, item.values, item.outputs, 0);
        s.B() = work.S();
        if constexpr (Rule::keeps_normalizer) s.b() = work.z();
      } else {
        s.B().setZero();
        s.b().setZero();
      }
      write_map(item, s);
      return;
    }
    // Delta rules with a carry: one pass of [I | 0] with values [0 | V].
    const Index r = r_, width = r_ + dv_, L = std::min(T, kDeltaBlock);
    auto ext = attention_.make_state(dk_, width);
    {
      RowMatrix<Scalar> start = RowMatrix<Scalar>::Zero(r, width);
      start.leftCols(r).setIdentity();
      ext.assign(start, ColVector<Scalar>(), 0);
    }
    RowMatrix<Scalar> values = RowMatrix<Scalar>::Zero(L, width);
    std::vector<RowMatrix<Scalar>> reads(static_cast<std::size_t>(G), RowMatrix<Scalar>(L, width));
    std::vector<RowsSpec<Scalar>> read_rows(static_cast<std::size_t>(G));
    item.carry_reads.assign(static_cast<std::size_t>(G), RowMatrix<Scalar>(T, r));
    for (Index first = 0; first < T; first += L) {
      const Index n = std::min(L, T - first);
      values.topRows(n).rightCols(dv_) = item.values.middle(first, n).view();
      for (Index g = 0; g < G; ++g)
        read_rows[std::size_t(g)] = RowsSpec<Scalar>::of(reads[std::size_t(g)].topRows(n));
      prefill(attention_, ext, item, first, n, RowsSpec<const Scalar>::of(values.topRows(n)),
              read_rows, 0);
      for (Index g = 0; g < G; ++g) {
        const auto& out = reads[std::size_t(g)];
        item.carry_reads[std::size_t(g)].middleRows(first, n) = out.topRows(n).leftCols(r);
        item.outputs[std::size_t(g)].middle(first, n).view() = out.topRows(n).rightCols(dv_);
      }
    }
    s.A() = ext.S().leftCols(r);
    s.B() = ext.S().rightCols(dv_);
  }

  /// Phase 2: the carried state (S_c, z_c) added to the outputs of a slice whose first row is
  /// row `first_row` of the sequence (for DenominatorError). Nothing to do where item.direct.
  void apply_carry(SliceItem<Scalar>& item, const RowMatrix<Scalar>& S_c,
                   const ColVector<Scalar>& z_c, Index first_row) const {
    const Index T = item.keys.rows;
    if (T == 0 || item.direct) return;
    if constexpr (map == CarryMap::matrix) {
      for (std::size_t g = 0; g < item.queries.size(); ++g)
        item.outputs[g].view().noalias() += item.carry_reads[g] * S_c;
      item.carry_reads.clear();
      static_cast<void>(z_c);
      static_cast<void>(first_row);
    } else {
      apply_decayed_carry(item, S_c, z_c, first_row);
    }
  }

 private:
  // Rows per pass of the delta rules' extended prefill and of apply_carry's blocks: enough
  // rows for the products to run near full rate, few enough that the scratch stays in L2.
  static constexpr Index kDeltaBlock = 1024;
  static constexpr Index kCarryBlock = 128;

  static Options unnormalized(Options options) {
    options.normalization = Normalization::unnormalized();
    return options;
  }

  // attention.prefill_into over rows [first, first + n) of the item's queries and keys, with
  // `values` (n rows) and into rows [out_first, out_first + n) of `outputs`: the single-head
  // call for one query head, the grouped call otherwise, as MultiHeadAttention calls them.
  void prefill(const Attention& attention, typename Attention::State& state,
               const SliceItem<Scalar>& item, Index first, Index n,
               const RowsSpec<const Scalar>& values, const std::vector<RowsSpec<Scalar>>& outputs,
               Index out_first) const {
    const auto K = item.keys.middle(first, n).view();
    const auto V = values.view();
    const auto in = input_rows<Rule>(item.inputs, first, n);
    const std::size_t G = item.queries.size();
    const auto out_rows = [&](std::size_t g) { return outputs[g].middle(out_first, n); };
    if (G == 1) {
      std::apply(
          [&](const auto&... x) {
            attention.prefill_into(state, item.queries[0].middle(first, n).view(), K, V, x...,
                                   out_rows(0).view());
          },
          in);
      return;
    }
    std::vector<ConstRowsView<Scalar>> qs;
    std::vector<RowsView<Scalar>> os;
    qs.reserve(G);
    os.reserve(G);
    for (std::size_t g = 0; g < G; ++g) {
      qs.push_back(item.queries[g].middle(first, n).view());
      os.push_back(out_rows(g).view());
    }
    std::apply([&](const auto&... x) { attention.prefill_into(state, qs, K, V, x..., os); }, in);
  }

  // A of the summary: nothing (Additive), the slice's decay (Decay, Gated), or the identity
  // where the slice is empty or starts from a zero carry (delta rules: A is then never read).
  void write_map(const SliceItem<Scalar>& item, const SummaryRef<Scalar>& s) const {
    const Index T = item.keys.rows;
    if constexpr (map == CarryMap::scalar || map == CarryMap::diagonal) {
      const TokenInputs<Scalar>& in = item.inputs;
      slice_decay(in.log_gate, T, in.log_gate.cols, map == CarryMap::diagonal,
                  static_cast<double>(in.constant_log_gate), s.a());
    } else if constexpr (map == CarryMap::matrix) {
      s.A().setIdentity();
    } else {
      static_cast<void>(T);
    }
  }

  // apply_carry for Additive, Decay and Gated, in blocks of rows: features again, the decay
  // d_t and the normalizer z_t by their recurrences (double), then per query head
  // out += (qf .* d) S_c and the division.
  void apply_decayed_carry(SliceItem<Scalar>& item, const RowMatrix<Scalar>& S_c,
                           const ColVector<Scalar>& z_c, Index first_row) const {
    const Index T = item.keys.rows, r = r_, L = std::min(T, kCarryBlock);
    const Normalization& norm = attention_.options().normalization;
    const TokenInputs<Scalar>& in = item.inputs;
    const bool per_channel = map == CarryMap::diagonal && in.log_gate.cols > 1;
    const bool divides = norm.divides();
    RowMatrix<Scalar> kf(L, r), qf(L, r), Z(divides ? L : 0, r);
    RowMatrix<Scalar> D(map == CarryMap::identity ? 0 : L, per_channel ? r : 1);
    Eigen::VectorXd z = z_c.template cast<double>(), log_decay = Eigen::VectorXd::Zero(D.cols());
    Eigen::VectorXd den(L);
    const auto& phi = attention_.feature_map();
    for (Index first = 0; first < T; first += L) {
      const Index n = std::min(L, T - first);
      if (divides) {
        Eigen::Ref<RowMatrix<Scalar>> kf_rows(kf.topRows(n));
        phi.apply(item.keys.middle(first, n).view(), kf_rows);
      }
      for (Index t = 0; t < n; ++t) {
        if constexpr (map != CarryMap::identity) {
          for (Index c = 0; c < D.cols(); ++c) {
            const double lg = map == CarryMap::scalar ? double(in.constant_log_gate)
                                                      : double(in.log_gate(first + t, c));
            log_decay(c) += lg;
            D(t, c) = static_cast<Scalar>(std::exp(log_decay(c)));
            if (divides) {
              const double g = std::exp(lg);
              if (per_channel)
                z(c) *= g;
              else
                z *= g;
            }
          }
        }
        if (divides) {
          z += kf.row(t).transpose().template cast<double>();
          Z.row(t) = z.transpose().template cast<Scalar>();
        }
      }
      for (std::size_t g = 0; g < item.queries.size(); ++g) {
        Eigen::Ref<RowMatrix<Scalar>> qf_rows(qf.topRows(n));
        phi.apply(item.queries[g].middle(first, n).view(), qf_rows);
        if (divides)
          for (Index t = 0; t < n; ++t)
            den(t) = qf.row(t).template cast<double>().dot(Z.row(t).template cast<double>());
        if constexpr (map != CarryMap::identity) {
          if (per_channel)
            qf.topRows(n).array() *= D.topRows(n).array();
          else
            qf.topRows(n).array().colwise() *= D.topRows(n).col(0).array();
        }
        auto out = item.outputs[g].middle(first, n).view();
        out.noalias() += qf.topRows(n) * S_c;
        if (divides)
          for (Index t = 0; t < n; ++t)
            out.row(t) /= norm.divisor(static_cast<Scalar>(den(t)), first_row + first + t);
      }
    }
  }

  Attention attention_;
  Attention local_;
  Index dk_, dv_, r_;
  SummaryLayout layout_;
};

}  // namespace linattn::detail
