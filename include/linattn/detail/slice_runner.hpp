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
//                  decayed and gated rules (and Additive): the features qf, kf once, then an
//                    unnormalized prefill from zero over them (the rule with the Identity map)
//                    for the numerators num_t = qf_t^T B_t, and the denominators from zero
//                    den_t = qf_t^T z_t (z_t = g_t .* z_{t-1} + kf_t);
//                  delta rules: one prefill of the state [I | 0] (r x (r + dv)) with values
//                    [0 | v_t], whose outputs are [qf_t^T A_t | qf_t^T B_t] and whose final
//                    state is [A_p | B_p]: the slice's map and its numerators in one pass.
//   apply_carry  after the exchange, with the carried state (S_c, z_c), d_t the decay from the
//                slice's start through t (1 for Additive):
//                  y_t = (num_t + (qf_t .* d_t)^T S_c) / divisor(den_t + (qf_t .* d_t)^T z_c)
//                  or, for the delta rules, y_t = qf_t^T B_t + (qf_t^T A_t) S_c.
// Cost per token beyond a single-process prefill: none where the carry is known zero; else one
// product with S_c, 2 r dv flops per query head (the register kernel of small_gemm.hpp, the
// division fused into it as in the chunked kernel), and O(r) for the denominators (normalized
// rules), or a second pass of width r for A (delta rules: about twice a prefill).
// Scratch is allocated once per call. From run_local to apply_carry each item keeps, per query
// head, a T x r matrix (qf_t or qf_t^T A_t: the size of the queries) and T denominators.

#include <linattn/attention.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/flush_subnormals.hpp>
#include <linattn/detail/slice_summary.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/options.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <string>
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

/// Rows of `x` (T x d) as row views: in place when they are contiguous rows of Scalar, else
/// a copy appended to `copies` (kept for the call).
template <class Scalar, class D>
RowsSpec<const Scalar> rows_spec_of(const Eigen::MatrixBase<D>& x,
                                    std::vector<RowMatrix<Scalar>>& copies) {
  if constexpr ((D::Flags & Eigen::DirectAccessBit) != 0 && D::IsRowMajor &&
                D::InnerStrideAtCompileTime == 1 && std::is_same_v<typename D::Scalar, Scalar>) {
    return RowsSpec<const Scalar>::of(x.derived());
  } else {
    copies.push_back(x.template cast<Scalar>());
    return RowsSpec<const Scalar>::of(copies.back());
  }
}

/// One state head of one sequence on this process: its G query heads and outputs, its keys,
/// values and bound per-token inputs (all T rows of the slice), and what run_local keeps for
/// apply_carry.
template <class Scalar>
struct SliceItem {
  std::vector<RowsSpec<const Scalar>> queries;  // G heads, T x dk
  std::vector<RowsSpec<Scalar>> outputs;        // G heads, T x dv
  RowsSpec<const Scalar> keys, values;          // T x dk, T x dv
  TokenInputs<Scalar> inputs;                   // the rule's per-token inputs, bound and checked
  bool direct = false;                          // the carried state is known to be zero
  Index first_row = 0;  // the slice's first row in its sequence (errors name rows by it)
  // Kept from run_local for apply_carry where not direct, per query head:
  std::vector<RowMatrix<Scalar>> reads;        // T x r: qf_t (decayed rules), qf_t^T A_t (delta)
  std::vector<ColVector<Scalar>> denominators;  // qf_t^T z_t from a zero carry (normalized reads)
  RowMatrix<Scalar> key_features;               // T x r, scratch of run_local
  // An item may be reused by the next call (SequenceParallel keeps its items): the buffers
  // above keep their allocations when the sizes repeat, so a repeated call touches no new
  // memory (a first touch costs a page fault per 4 KiB: measured, more than the features).
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
/// rules that keep z, the same rule over precomputed features (Identity map, unnormalized
/// read): the slice's features are computed once, for the local prefill and for the carry.
template <class Attention>
class SliceRunner {
 public:
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  using FeatureAttention = RuleAttention<Identity, Rule, Scalar>;
  static constexpr CarryMap map = carry_map_of<Rule>();

  SliceRunner(const Attention& attention, Index dk, Index dv)
      : attention_(attention),
        features_(Identity{}, attention.rule(), unnormalized(attention.options())),
        dk_(dk),
        dv_(dv),
        r_(attention.feature_dim(dk)),
        layout_(SummaryLayout::of<Rule>(r_, dv)) {}

  [[nodiscard]] const SummaryLayout& layout() const noexcept { return layout_; }

  /// Phase 1: the slice's outputs from a zero carry (final where item.direct) and its summary,
  /// written to `summary` (layout().scalars() values).
  void run_local(SliceItem<Scalar>& item, Scalar* summary) const {
    const SummaryRef<Scalar> s{summary, layout_};
    const Index T = item.keys.rows;
    if (T == 0) {
      s.B().setZero();
      s.b().setZero();
      write_map(item, s);
      return;
    }
    if (item.direct) {
      auto work = attention_.make_state(dk_, dv_);
      prefill(attention_, work, item.queries, item.keys, item.values, item.inputs, 0, T,
              item.outputs, 0);
      s.B() = work.S();
      if constexpr (Rule::keeps_normalizer) s.b() = work.z();
      write_map(item, s);
      return;
    }
    if constexpr (map == CarryMap::matrix) {
      run_extended(item, s);
    } else {
      // Features once: the local prefill reads them through the Identity map, and apply_carry
      // reads the query features again (kept in item.reads).
      const auto& phi = attention_.feature_map();
      const std::size_t G = item.queries.size();
      RowMatrix<Scalar>& kf = item.key_features;
      kf.resize(T, r_);
      {
        Eigen::Ref<RowMatrix<Scalar>> f(kf);
        phi.apply(item.keys.view(), f);
      }
      item.reads.resize(G);
      std::vector<RowsSpec<const Scalar>> qf(G);
      for (std::size_t g = 0; g < G; ++g) {
        item.reads[g].resize(T, r_);
        Eigen::Ref<RowMatrix<Scalar>> f(item.reads[g]);
        phi.apply(item.queries[g].view(), f);
        qf[g] = RowsSpec<const Scalar>::of(item.reads[g]);
      }
      auto work = features_.make_state(r_, dv_);
      prefill(features_, work, qf, RowsSpec<const Scalar>::of(kf), item.values, item.inputs, 0, T,
              item.outputs, 0);
      s.B() = work.S();
      s.b() = work.z();
      if (attention_.options().normalization.divides()) local_denominators(item, kf);
      write_map(item, s);
    }
  }

  /// The pipeline schedule's step (mpi_pipeline.hpp): the attention's own prefill of the
  /// slice from `state`, the state the slice starts from (left as the state after it); the
  /// outputs are final. A DenominatorError names the row in the whole sequence (`first_row`,
  /// the slice's first row, added to the row within the slice).
  void run_from(const SliceItem<Scalar>& item, typename Attention::State& state,
                Index first_row) const {
    const Index T = item.keys.rows;
    if (T == 0) return;
    try {
      prefill(attention_, state, item.queries, item.keys, item.values, item.inputs, 0, T,
              item.outputs, 0);
    } catch (const DenominatorError& e) {
      throw shifted_row(e, first_row);
    }
  }

  /// Phase 2: the carried state (S_c, z_c) added to the outputs of a slice whose first row is
  /// row `first_row` of the sequence (for DenominatorError). Nothing to do where item.direct.
  /// S_c and z_c are views (the summaries' scan, or a message of the hybrid schedule).
  void apply_carry(SliceItem<Scalar>& item, const Eigen::Ref<const RowMatrix<Scalar>>& S_c,
                   const Eigen::Ref<const ColVector<Scalar>>& z_c, Index first_row) const {
    const Index T = item.keys.rows;
    if (T == 0 || item.direct) return;
    if constexpr (map == CarryMap::scalar || map == CarryMap::diagonal) decay_reads(item);
    const Normalization& norm = attention_.options().normalization;
    const bool divides = Rule::keeps_normalizer && norm.divides();
    const Index L = std::min(T, kCarryBlock);
    ColVector<Scalar> inverse(divides ? L : 0), late(divides ? L : 0);
    for (std::size_t g = 0; g < item.reads.size(); ++g) {
      const RowMatrix<Scalar>& read = item.reads[g];
      for (Index first = 0; first < T; first += L) {
        const Index n = std::min(L, T - first);
        auto out = item.outputs[g].middle(first, n).view();
        // Row scales 1 / divisor, as the chunked kernel applies them (1 where the reciprocal
        // of a subnormal divisor overflows: those rows are divided afterwards).
        bool any_late = false;
        for (Index i = 0; divides && i < n; ++i) {
          const Index t = first + i;
          const Scalar divisor =
              norm.divisor(item.denominators[g](t) + read.row(t).dot(z_c.transpose()), first_row + t);
          const Scalar inv = Scalar(1) / divisor;
          const bool is_late = !std::isfinite(inv);
          inverse(i) = is_late ? Scalar(1) : inv;
          late(i) = is_late ? divisor : Scalar(0);
          any_late = any_late || is_late;
        }
        add_product(read.middleRows(first, n), S_c, out, divides ? inverse.data() : nullptr);
        for (Index i = 0; any_late && i < n; ++i)
          if (late(i) != Scalar(0)) out.row(i) /= late(i);
      }
    }
  }

 private:
  // Rows per pass of the delta rules' extended prefill: enough for the products to run near
  // full rate, few enough that its scratch stays small.
  static constexpr Index kDeltaBlock = 1024;
  // Rows per block of apply_carry: the block of reads (kCarryBlock x r) stays in L1 while the
  // register kernel sweeps the column panels of S_c (one product over all T rows re-streams
  // the reads from memory once per panel: measured half the rate).
  static constexpr Index kCarryBlock = 64;

  // `e` with its row moved by `first_row`, in the message too (Normalization's text names the
  // row as "at query row N").
  static DenominatorError shifted_row(const DenominatorError& e, Index first_row) {
    std::string message = e.what();
    const std::string from = "at query row " + std::to_string(e.row()) + " ",
                      to = "at query row " + std::to_string(e.row() + first_row) + " ";
    if (const auto at = message.find(from); at != std::string::npos)
      message.replace(at, from.size(), to);
    return DenominatorError(message, e.row() + first_row, e.value());
  }

  static Options unnormalized(Options options) {
    options.normalization = Normalization::unnormalized();
    return options;
  }

  // attention.prefill_into over rows [first, first + n) of `queries` and `keys` with `values`
  // (n rows) and the inputs' rows, into rows [out_first, out_first + n) of `outputs`: the
  // single-head call for one query head, the grouped call otherwise, as MultiHeadAttention
  // calls them.
  template <class A>
  void prefill(const A& attention, typename A::State& state,
               const std::vector<RowsSpec<const Scalar>>& queries, const RowsSpec<const Scalar>& keys,
               const RowsSpec<const Scalar>& values, const TokenInputs<Scalar>& inputs, Index first,
               Index n, const std::vector<RowsSpec<Scalar>>& outputs, Index out_first) const {
    const auto K = keys.middle(first, n).view();
    const auto V = values.view();
    const auto in = input_rows<Rule>(inputs, first, n);
    const std::size_t G = queries.size();
    if (G == 1) {
      std::apply(
          [&](const auto&... x) {
            attention.prefill_into(state, queries[0].middle(first, n).view(), K, V, x...,
                                   outputs[0].middle(out_first, n).view());
          },
          in);
      return;
    }
    std::vector<ConstRowsView<Scalar>> qs;
    std::vector<RowsView<Scalar>> os;
    qs.reserve(G);
    os.reserve(G);
    for (std::size_t g = 0; g < G; ++g) {
      qs.push_back(queries[g].middle(first, n).view());
      os.push_back(outputs[g].middle(out_first, n).view());
    }
    std::apply([&](const auto&... x) { attention.prefill_into(state, qs, K, V, x..., os); }, in);
  }

  // The delta rules from a carry: one prefill of [I | 0] with values [0 | V], in blocks of
  // rows; the outputs' left part (qf_t^T A_t) is kept, the right part is the numerators.
  // A_t's entries fall through the subnormal range on their way to zero: flushed (see
  // flush_subnormals.hpp; on Intel cores the subnormals made this pass up to 24 x slower).
  void run_extended(SliceItem<Scalar>& item, const SummaryRef<Scalar>& s) const {
    const FlushSubnormalsScope flush;
    const Index T = item.keys.rows, r = r_, width = r_ + dv_, L = std::min(T, kDeltaBlock);
    const std::size_t G = item.queries.size();
    auto ext = attention_.make_state(dk_, width);
    {
      RowMatrix<Scalar> start = RowMatrix<Scalar>::Zero(r, width);
      start.leftCols(r).setIdentity();
      ext.assign(start, ColVector<Scalar>(), 0);
    }
    RowMatrix<Scalar> values = RowMatrix<Scalar>::Zero(L, width);
    std::vector<RowMatrix<Scalar>> outs(G, RowMatrix<Scalar>(L, width));
    std::vector<RowsSpec<Scalar>> out_rows(G);
    item.reads.resize(G);
    for (auto& read : item.reads) read.resize(T, r);
    for (Index first = 0; first < T; first += L) {
      const Index n = std::min(L, T - first);
      values.topRows(n).rightCols(dv_) = item.values.middle(first, n).view();
      for (std::size_t g = 0; g < G; ++g) out_rows[g] = RowsSpec<Scalar>::of(outs[g].topRows(n));
      prefill(attention_, ext, item.queries, item.keys, RowsSpec<const Scalar>::of(values.topRows(n)),
              item.inputs, first, n, out_rows, 0);
      for (std::size_t g = 0; g < G; ++g) {
        item.reads[g].middleRows(first, n) = outs[g].topRows(n).leftCols(r);
        item.outputs[g].middle(first, n).view() = outs[g].topRows(n).rightCols(dv_);
      }
    }
    s.A() = ext.S().leftCols(r);
    s.B() = ext.S().rightCols(dv_);
  }

  // The log-gate of token t, channel c (Decay: its constant).
  double log_gate(const TokenInputs<Scalar>& in, Index t, Index c) const {
    if constexpr (map == CarryMap::scalar) {
      static_cast<void>(t);
      static_cast<void>(c);
      return static_cast<double>(in.constant_log_gate);
    } else {
      return static_cast<double>(in.log_gate(t, in.log_gate.cols == 1 ? 0 : c));
    }
  }
  [[nodiscard]] Index gate_channels(const TokenInputs<Scalar>& in) const {
    return map == CarryMap::diagonal && in.log_gate.cols > 1 ? r_ : 1;
  }

  // The slice's normalizers from a zero carry, z_t = g_t .* z_{t-1} + kf_t, read by each query
  // head: denominators[g](t) = qf_t^T z_t (in Scalar, as the chunked kernels keep z).
  void local_denominators(SliceItem<Scalar>& item, const RowMatrix<Scalar>& kf) const {
    const Index T = kf.rows(), channels = gate_channels(item.inputs);
    item.denominators.resize(item.reads.size());
    for (auto& den : item.denominators) den.resize(T);
    RowVector<Scalar> z = RowVector<Scalar>::Zero(r_);
    for (Index t = 0; t < T; ++t) {
      if constexpr (map != CarryMap::identity) {
        if (channels == 1)
          z *= static_cast<Scalar>(std::exp(log_gate(item.inputs, t, 0)));
        else
          for (Index c = 0; c < r_; ++c) z(c) *= static_cast<Scalar>(std::exp(log_gate(item.inputs, t, c)));
      }
      z += kf.row(t);
      for (std::size_t g = 0; g < item.reads.size(); ++g)
        item.denominators[g](t) = item.reads[g].row(t).dot(z);
    }
  }

  // out = (out + read S) row i times row_scale[i] (when given): the register kernel where it
  // applies (one pass over out), else Eigen's product and the scaling.
  template <class Read, class Out>
  static void add_product(const Read& read, const Eigen::Ref<const RowMatrix<Scalar>>& S,
                          Out& out, const Scalar* row_scale) {
    const Index T = read.rows(), r = read.cols(), dv = S.cols();
    if constexpr (has_gemm_kernel<Scalar>) {
      if (dv % GemmTile<Scalar>::lanes == 0) {
        small_gemm<Scalar, true>(T, dv, r, read.data(), read.outerStride(), S.data(),
                                 S.outerStride(), out.data(), out.outerStride(), Triangle::none,
                                 row_scale);
        return;
      }
    }
    product_into<true>(out, read, S);
    if (row_scale != nullptr)
      for (Index t = 0; t < T; ++t) out.row(t) *= row_scale[t];
  }

  // Query features scaled by the decay since the slice's start, d_t = exp(sum_{s<=t} log g_s)
  // (the exponent summed in double), for the read of the carry. Rows whose decay falls below
  // the smallest normal Scalar are flushed to zero rather than made subnormal.
  void decay_reads(SliceItem<Scalar>& item) const {
    const FlushSubnormalsScope flush;
    const Index T = item.keys.rows, channels = gate_channels(item.inputs);
    Eigen::VectorXd exponent = Eigen::VectorXd::Zero(channels);
    RowVector<Scalar> d(channels);
    for (Index t = 0; t < T; ++t) {
      for (Index c = 0; c < channels; ++c) {
        exponent(c) += log_gate(item.inputs, t, c);
        d(c) = static_cast<Scalar>(std::exp(exponent(c)));
      }
      for (auto& read : item.reads) {
        if (channels == 1)
          read.row(t) *= d(0);
        else
          read.row(t).array() *= d.array();
      }
    }
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

  Attention attention_;
  FeatureAttention features_;
  Index dk_, dv_, r_;
  SummaryLayout layout_;
};

}  // namespace linattn::detail
