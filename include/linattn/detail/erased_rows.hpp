#pragma once
// One argument type per scalar for the kernels, whatever matrix types the caller passed.
//
// The chunked and recurrent kernels are templates over their inputs' types. Called with each
// caller's own types (Matrix, Map, Ref, Block, a lambda per call site for the query heads), a
// program compiles one copy of a kernel per combination: one test file of this project held
// 161 copies of the rules' chunked kernel, most of its compile time. Inputs that are rows of
// Scalar in place (direct access, row-major, inner stride 1: the common case, and the layout
// the kernels read anyway) reach the kernels as ConstRowsView / RowsView and named accessor
// types instead, so each kernel is compiled once per attention type for all such callers.
// Other inputs (column-major, strided, expressions) keep their own types, as before.
// A view reads the same memory in the same order as the object it views: the results are the
// same bits either way.

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// Whether X is rows of Scalar in place: direct access, row-major, inner stride 1.
template <class Scalar, class X>
constexpr bool is_rows_of() {
  using D = std::remove_cvref_t<X>;
  if constexpr (std::is_base_of_v<Eigen::EigenBase<D>, D>)
    return (D::Flags & Eigen::DirectAccessBit) != 0 && bool(D::IsRowMajor) &&
           D::InnerStrideAtCompileTime == 1 && std::is_same_v<typename D::Scalar, Scalar>;
  else
    return false;
}

/// x (rows of Scalar in place) as a ConstRowsView.
template <class Scalar, class X>
ConstRowsView<Scalar> const_rows_view(const X& x) {
  return ConstRowsView<Scalar>(x.data(), x.rows(), x.cols(), Eigen::OuterStride<>(x.outerStride()));
}

/// query(g) over views made once per call.
template <class Scalar>
struct QueryViews {
  const ConstRowsView<Scalar>* views;
  const ConstRowsView<Scalar>& operator()(Index g) const { return views[g]; }
};

/// output(g) over views made once per call, as the Ref the kernels write through.
template <class Scalar>
struct OutputViews {
  RowsView<Scalar>* views;
  Eigen::Ref<RowMatrix<Scalar>> operator()(Index g) const { return views[g]; }
};

/// Calls f(query, K, V, output) for `group` query heads, with ConstRowsView, QueryViews and
/// OutputViews in place of the caller's types where query(g), K and V are all rows of Scalar in
/// place, else with the arguments as given. O(group) views, allocated once per call.
template <class Scalar, class QueryAt, class DK, class DV, class OutputAt, class F>
void with_row_views(Index group, const QueryAt& query, const DK& K, const DV& V,
                    const OutputAt& output, F&& f) {
  using Query = decltype(query(Index{0}));
  if constexpr (is_rows_of<Scalar, DK>() && is_rows_of<Scalar, DV>() &&
                is_rows_of<Scalar, Query>()) {
    std::vector<ConstRowsView<Scalar>> queries;
    std::vector<RowsView<Scalar>> outputs;
    queries.reserve(static_cast<std::size_t>(group));
    outputs.reserve(static_cast<std::size_t>(group));
    for (Index g = 0; g < group; ++g) {
      queries.push_back(const_rows_view<Scalar>(query(g)));
      Eigen::Ref<RowMatrix<Scalar>> out = output(g);
      outputs.emplace_back(out.data(), out.rows(), out.cols(),
                           Eigen::OuterStride<>(out.outerStride()));
    }
    f(QueryViews<Scalar>{queries.data()}, const_rows_view<Scalar>(K), const_rows_view<Scalar>(V),
      OutputViews<Scalar>{outputs.data()});
  } else {
    f(query, K, V, output);
  }
}

}  // namespace linattn::detail
