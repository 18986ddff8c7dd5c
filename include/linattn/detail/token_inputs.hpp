#pragma once
// The per-token inputs of the write rules (Gated's log-gates, Delta's beta, GatedDelta's beta
// and log_alpha), bound once per call as strided views in the compute type and validated
// before any state changes. A caller's array that already holds Scalar with direct access (a
// vector, a column of a matrix, a model's [B, T, H] gate buffer seen through a Map with a
// stride of H) is read in place; anything else (another scalar type, an expression) is copied
// once per call.

#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/errors.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <tuple>
#include <type_traits>

namespace linattn::detail {

/// rows x cols values, element (t, c) at data[t * row_stride + c * col_stride]. Not owning.
template <class Scalar>
struct TokenArray {
  const Scalar* data = nullptr;
  Index rows = 0, cols = 0, row_stride = 0, col_stride = 1;

  [[nodiscard]] Scalar operator()(Index t, Index c = 0) const noexcept {
    return data[t * row_stride + c * col_stride];
  }
  [[nodiscard]] bool empty() const noexcept { return rows == 0; }
  /// Rows [first, first + n).
  [[nodiscard]] TokenArray middle_rows(Index first, Index n) const noexcept {
    return {n == 0 ? data : data + first * row_stride, n, cols, row_stride, col_stride};
  }
  /// The values as an Eigen expression (rows x cols).
  [[nodiscard]] auto map() const noexcept {
    using Strides = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
    return Eigen::Map<const RowMatrix<Scalar>, Eigen::Unaligned, Strides>(
        data, rows, cols, Strides(row_stride, col_stride));
  }
};

/// `x` (rows x cols, already checked) as a TokenArray: in place when it holds Scalar with direct
/// access, else a copy into `copy`. A vector may be given as a row or a column (rows x 1 then).
template <class Scalar, class D>
TokenArray<Scalar> bind_array(const Eigen::MatrixBase<D>& x, Index rows, Index cols,
                              RowMatrix<Scalar>& copy) {
  const bool transposed = cols == 1 && x.rows() == 1 && x.cols() == rows && rows != 1;
  if constexpr ((D::Flags & Eigen::DirectAccessBit) != 0 &&
                std::is_same_v<typename D::Scalar, Scalar>) {
    if (rows == 0) return {nullptr, 0, cols, 0, 1};
    const auto& d = x.derived();
    if (transposed) return {d.data(), rows, 1, d.colStride(), 1};
    return {d.data(), rows, cols, d.rowStride(), d.colStride()};
  } else {
    if (transposed)
      copy = x.transpose().template cast<Scalar>();
    else
      copy = x.template cast<Scalar>();
    return {copy.data(), rows, cols, cols, 1};
  }
}

/// Throws std::invalid_argument naming the token unless every value is in [0, 2] (NaN fails).
/// With a unit key the write's factor I - beta k k^T has eigenvalues 1 and 1 - beta, in
/// [-1, 1] exactly for beta in [0, 2]: the state is never amplified. Betas above 1 give the
/// negative eigenvalues of Grazzi et al. 2024 (fla's allow_neg_eigval: beta = 2 sigmoid(x)).
template <class Scalar>
void check_betas(const TokenArray<Scalar>& beta, Index first_row = 0) {
  for (Index t = 0; t < beta.rows; ++t) {
    const double b = static_cast<double>(beta(t));
    if (!(b >= 0.0 && b <= 2.0)) {
      std::ostringstream os;
      os << "linattn: beta must lie in [0, 2], got " << b << " at token " << first_row + t;
      throw std::invalid_argument(os.str());
    }
  }
}

/// Throws std::invalid_argument naming token and channel unless every log-gate is finite and
/// <= 0 (a gate in (0, 1]).
template <class Scalar>
void check_log_gates(const TokenArray<Scalar>& log_gate, const char* what, Index first_row = 0) {
  // All valid in two vectorized reductions per row (all_finite, maxCoeff); only a row that
  // fails is walked element by element for the message.
  if (log_gate.col_stride == 1) {
    bool valid = true;
    for (Index t = 0; t < log_gate.rows && valid; ++t) {
      const Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>> row(
          log_gate.data + t * log_gate.row_stride, log_gate.cols);
      valid = all_finite(row) && row.maxCoeff() <= Scalar(0);
    }
    if (valid) return;
  }
  for (Index t = 0; t < log_gate.rows; ++t)
    for (Index c = 0; c < log_gate.cols; ++c) {
      const double g = static_cast<double>(log_gate(t, c));
      if (!(g <= 0.0) || !std::isfinite(g)) {
        std::ostringstream os;
        os << "linattn: " << what << " must be finite and <= 0 (a gate in (0, 1]), got " << g
           << " at token " << first_row + t << ", channel " << c;
        throw std::invalid_argument(os.str());
      }
    }
}

/// The per-token inputs of one call of T tokens, bound and validated. Decay has none from the
/// caller: its log-gate is the constant log(gamma), per_token_gate false.
template <class Scalar>
struct TokenInputs {
  TokenArray<Scalar> log_gate;   // Gated: T x 1 (one gate per token) or T x r (per channel)
  TokenArray<Scalar> beta;       // Delta, GatedDelta: T x 1
  TokenArray<Scalar> log_alpha;  // GatedDelta: T x 1, or T x r (per channel, Kimi Delta Attention)
  Scalar constant_log_gate = 0;  // Decay: log(gamma)
  RowMatrix<Scalar> copies[2];   // owned copies of inputs that could not be read in place

  /// The columns of the gates' gradient: r for per-channel gates (Gated's log-gates or
  /// GatedDelta's log_alpha), else 1 (0 without gates: no such gradient).
  [[nodiscard]] Index gate_columns() const noexcept {
    return std::max(log_gate.cols, log_alpha.cols);
  }

  TokenInputs() = default;
  TokenInputs(const TokenInputs&) = delete;  // the arrays may point into `copies`
  TokenInputs& operator=(const TokenInputs&) = delete;
};

/// A length-T vector input (row or column) bound into `array`; ShapeError names `what`.
template <class Scalar, class D>
void bind_vector(const Eigen::MatrixBase<D>& x, Index T, const char* what,
                 TokenArray<Scalar>& array, RowMatrix<Scalar>& copy) {
  if (!(x.rows() == 1 || x.cols() == 1) || x.size() != T)
    throw_shape_error(what, " must be a vector with one entry per token (", T, "), got ",
                      shape_of(x));
  array = bind_array<Scalar>(x, T, 1, copy);
}

/// Gates given as logs, one per token (T x 1, or a 1 x T row) or one per feature channel
/// (T x r), bound into `array` with each token's channels contiguous (the kernels read a token's
/// per-channel gates as one row); ShapeError names `what`.
template <class Scalar, class D>
void bind_gates(const Eigen::MatrixBase<D>& g, Index T, Index r, const char* what,
                TokenArray<Scalar>& array, RowMatrix<Scalar>& copy) {
  // One gate per token may also come as a row (1 x T, T > 1): per-channel gates have T rows.
  const bool row_of_gates = T > 1 && g.rows() == 1 && g.cols() == T;
  if (!row_of_gates && (g.rows() != T || !(g.cols() == 1 || g.cols() == r)))
    throw_shape_error(what, " must be T x 1 (or 1 x T) or T x r = ", T, "x1 or ", T, "x", r,
                      ", got ", shape_of(g));
  array = bind_array<Scalar>(g, T, row_of_gates ? 1 : g.cols(), copy);
  if (array.cols > 1 && array.col_stride != 1) {
    copy = array.map();
    array = {copy.data(), T, array.cols, array.cols, 1};
  }
}

/// Token values from `first` on of a bound one-column input (beta, log-alpha, scalar gates).
template <class Scalar>
TokenValues<Scalar> values_from(const TokenArray<Scalar>& a, Index first) {
  if (a.empty()) return {};
  return {a.data + first * a.row_stride, a.row_stride};
}

/// Binds and validates the inputs of a call of T tokens with feature dim r for `rule` into
/// `out`. `inputs` is the tuple of the caller's arguments (their count was checked at compile
/// time). O(T r) to validate; nothing is copied unless it must be.
template <class Scalar, class Rule, class Tuple>
void bind_token_inputs(const Rule& rule, const Tuple& inputs, Index T, Index r,
                       TokenInputs<Scalar>& out) {
  if constexpr (Rule::kind == WriteKind::decay) {
    out.constant_log_gate = static_cast<Scalar>(std::log(rule.gamma()));
  } else if constexpr (Rule::kind == WriteKind::gated) {
    bind_gates(std::get<0>(inputs), T, r, "log-gates", out.log_gate, out.copies[0]);
    check_log_gates(out.log_gate, "a log-gate");
  } else if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta) {
    bind_vector(std::get<0>(inputs), T, "beta", out.beta, out.copies[0]);
    check_betas(out.beta);
    if constexpr (Rule::kind == WriteKind::gated_delta) {
      bind_gates(std::get<1>(inputs), T, r, "log_alpha", out.log_alpha, out.copies[1]);
      check_log_gates(out.log_alpha, "log_alpha");
    }
  } else {
    static_cast<void>(rule);
    static_cast<void>(inputs);
    static_cast<void>(T);
    static_cast<void>(r);
  }
}

/// A per-token input of one step: a number, or an Eigen vector (per-channel log-gates).
template <class T>
concept StepInput = std::is_arithmetic_v<std::remove_cvref_t<T>> ||
                    requires(const T& x) { []<class D>(const Eigen::MatrixBase<D>&) {}(x); };

/// The inputs of one decode step: the gates g = exp(log_gate) (Gated) or exp(log_alpha)
/// (GatedDelta) as r values (written into the state's 1 x r `gates` row; all equal, and
/// per_channel false, for one gate) and beta, alpha (GatedDelta's gate when it is one number).
template <class Scalar>
struct StepInputs {
  Scalar beta = 1;
  Scalar alpha = 1;
  bool per_channel = false;
};

/// One number as a checked double: finite log-gate <= 0, or beta in [0, 2].
inline double checked_log_gate(double g, const char* what) {
  const Eigen::Matrix<double, 1, 1> m = Eigen::Matrix<double, 1, 1>::Constant(g);
  check_log_gates(TokenArray<double>{m.data(), 1, 1, 1, 1}, what);
  return g;
}
inline double checked_beta(double b) {
  const Eigen::Matrix<double, 1, 1> m = Eigen::Matrix<double, 1, 1>::Constant(b);
  check_betas(TokenArray<double>{m.data(), 1, 1, 1, 1});
  return b;
}

/// One step's gates from their logs: a number, or a vector of length 1 or r = gates.cols(),
/// validated (`name` names the input in shape errors, `what` one value in range errors) before
/// any is written, as exp into `gates` (all equal for one gate). Returns whether they are per
/// channel.
template <class Scalar, class G>
bool bind_step_gates(const G& g, const char* name, const char* what, RowMatrix<Scalar>& gates) {
  const Index r = gates.cols();
  if constexpr (std::is_arithmetic_v<G>) {
    gates.setConstant(
        static_cast<Scalar>(std::exp(checked_log_gate(static_cast<double>(g), what))));
    return false;
  } else {
    static_assert(StepInput<G>, "a step's gates are a number or an Eigen vector of log-gates");
    if (!(g.rows() == 1 || g.cols() == 1) || !(g.size() == 1 || g.size() == r))
      throw_shape_error("a step's ", name, " must be a number or a vector of length 1 or r = ",
                        r, ", got ", shape_of(g));
    // Validate every gate before writing any (the row is the state's scratch either way).
    for (Index c = 0; c < g.size(); ++c) {
      const double x = static_cast<double>(g.rows() == 1 ? g(0, c) : g(c, 0));
      if (!(x <= 0.0) || !std::isfinite(x)) {
        std::ostringstream os;
        os << "linattn: " << what << " must be finite and <= 0 (a gate in (0, 1]), got " << x
           << " at channel " << c << " of the step";
        throw std::invalid_argument(os.str());
      }
    }
    for (Index c = 0; c < g.size(); ++c)
      gates(0, c) = std::exp(static_cast<Scalar>(g.rows() == 1 ? g(0, c) : g(c, 0)));
    if (g.size() == 1) gates.setConstant(gates(0, 0));
    return g.size() > 1;
  }
}

/// Binds and validates one step's inputs for `rule`: gates into `gates` (1 x r; Decay: gamma),
/// beta and alpha returned. Allocates nothing. Throws before anything changes.
template <class Scalar, class Rule, class... In>
StepInputs<Scalar> bind_step_inputs(const Rule& rule, RowMatrix<Scalar>& gates, const In&... in) {
  StepInputs<Scalar> out;
  if constexpr (Rule::kind == WriteKind::decay) {
    gates.setConstant(static_cast<Scalar>(rule.gamma()));
  } else if constexpr (Rule::kind == WriteKind::gated) {
    out.per_channel = bind_step_gates(std::get<0>(std::forward_as_tuple(in...)), "log-gates",
                                      "a log-gate", gates);
  } else if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta) {
    const auto all = std::forward_as_tuple(in...);
    using B = std::remove_cvref_t<std::tuple_element_t<0, decltype(all)>>;
    static_assert(std::is_arithmetic_v<B>,
                  "a delta-rule step takes beta as a number (and log_alpha as a number or a "
                  "length-r vector)");
    out.beta = static_cast<Scalar>(checked_beta(static_cast<double>(std::get<0>(all))));
    if constexpr (Rule::kind == WriteKind::gated_delta) {
      out.per_channel = bind_step_gates(std::get<1>(all), "log_alpha", "log_alpha", gates);
      if (!out.per_channel) out.alpha = gates(0, 0);
    }
  } else {
    static_cast<void>(rule);
  }
  return out;
}

}  // namespace linattn::detail
