#pragma once
// The argument checks every entry point shares, each contract with its message written once:
// single-head Q, K, V and output shapes, grouped heads, and one decode token.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <span>

namespace linattn::detail {

/// Q (Tq x dk) and K (Tk x dk) share dk, K and V (Tk x dv) one row per token; `causal` also
/// needs Tq = Tk. The pairing every call checks (the references and the backward too).
template <class DQ, class DK, class DV>
void check_qkv_pairing(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                       const Eigen::MatrixBase<DV>& V, bool causal) {
  if (Q.cols() != K.cols())
    throw_shape_error("Q and K need the same key dimension, got Q ", shape_of(Q), " and K ",
                      shape_of(K));
  if (K.rows() != V.rows())
    throw_shape_error("K and V need one row per token, got K ", shape_of(K), " and V ",
                      shape_of(V));
  if (causal && Q.rows() != K.rows())
    throw_shape_error("causal attention needs as many queries as keys, got Q ", shape_of(Q),
                      " and K ", shape_of(K));
}

/// Q (Tq x dk), K (Tk x dk), V (Tk x dv) with dk, dv >= 1; `causal` also needs Tq = Tk.
template <class DQ, class DK, class DV>
void check_inputs(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                  const Eigen::MatrixBase<DV>& V, bool causal) {
  check_qkv_pairing(Q, K, V, false);  // the same messages, in the same order, as the others
  if (K.cols() < 1 || V.cols() < 1)
    throw_shape_error("a head needs dk >= 1 and dv >= 1, got K ", shape_of(K), " and V ",
                      shape_of(V));
  check_qkv_pairing(Q, K, V, causal);
}

/// An output of `rows` x `cols`.
template <class DO>
void check_output(const DO& out, Index rows, Index cols, const char* what = "output") {
  if (out.rows() != rows || out.cols() != cols)
    throw_shape_error(what, " is ", shape_of(out), ", expected ", rows, "x", cols);
}

/// One decode token: q and k vectors of length dk, v of length dv, output y of length dv.
template <class Dq, class Dk, class Dv>
void check_token(const Eigen::MatrixBase<Dq>& q, const Eigen::MatrixBase<Dk>& k,
                 const Eigen::MatrixBase<Dv>& v, Index dk, Index dv) {
  const auto is_vector = [](const auto& x, Index n) {
    return (x.rows() == 1 || x.cols() == 1) && x.size() == n;
  };
  if (!is_vector(q, dk) || !is_vector(k, dk) || !is_vector(v, dv))
    throw_shape_error("a decode token needs q and k of length dk = ", dk, " and v of length dv = ",
                      dv, ", got q ", shape_of(q), ", k ", shape_of(k), ", v ", shape_of(v));
}

/// Grouped heads (detail::HeadGroup): G >= 1 queries and G outputs, each query Tq x dk and
/// output Tq x dv.
template <class Queries, class Outputs>
void check_group(const Queries& queries, const Outputs& outputs, Index Tq, Index dk, Index dv) {
  if (queries.empty() || queries.size() != outputs.size())
    throw_shape_error("a query group needs at least one head and one output per head, got ",
                      queries.size(), " queries and ", outputs.size(), " outputs");
  for (Index g = 0; g < queries.size(); ++g) {
    if (queries[g].rows() != Tq || queries[g].cols() != dk)
      throw_shape_error("query ", g, " of the group is ", shape_of(queries[g]), ", expected ", Tq,
                        "x", dk);
    check_output(outputs[g], Tq, dv, "a group's output");
  }
}

}  // namespace linattn::detail
