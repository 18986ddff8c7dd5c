// Compile-time checks of the concepts: this file compiling is the test.

#include <linattn/linattn.hpp>

#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace {

struct MissingApply {
  static constexpr bool strictly_positive = true;
  linattn::Index feature_dim(linattn::Index d) const { return d; }
};

struct MissingPositivity {
  linattn::Index feature_dim(linattn::Index d) const { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const { out = x; }
};

struct RuntimePositivity {  // strictly_positive must be a constant expression
  bool strictly_positive = true;
  linattn::Index feature_dim(linattn::Index d) const { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const { out = x; }
};

}  // namespace

static_assert(linattn::FeatureMap<linattn::Identity>);
static_assert(linattn::FeatureMap<linattn::EluPlusOne>);
static_assert(linattn::FeatureMap<linattn::EluPlusOne, double>);
static_assert(!linattn::FeatureMap<int>);
static_assert(!linattn::FeatureMap<std::string>);
static_assert(!linattn::FeatureMap<MissingApply>);
static_assert(!linattn::FeatureMap<MissingPositivity>);
static_assert(!linattn::FeatureMap<RuntimePositivity>);
// Random feature maps: feature maps with the log-domain extension, for their own Scalar only.
static_assert(linattn::FeatureMap<linattn::PositiveRandomFeatures<double>, double>);
static_assert(linattn::FeatureMap<linattn::TrigRandomFeatures<float>, float>);
static_assert(linattn::LogScaledFeatureMap<linattn::PositiveRandomFeatures<float>, float>);
static_assert(linattn::LogScaledFeatureMap<linattn::TrigRandomFeatures<double>, double>);
static_assert(!linattn::FeatureMap<linattn::PositiveRandomFeatures<double>, float>);
static_assert(!linattn::LogScaledFeatureMap<linattn::EluPlusOne>);
static_assert(!linattn::LogScaledFeatureMap<linattn::Identity, double>);
static_assert(linattn::SupportedScalar<float> && linattn::SupportedScalar<double>);
static_assert(!linattn::SupportedScalar<int>);
static_assert(std::is_base_of_v<std::invalid_argument, linattn::ShapeError>);
static_assert(std::is_base_of_v<std::domain_error, linattn::DenominatorError>);
static_assert(std::is_default_constructible_v<linattn::LinearAttention<linattn::EluPlusOne>>);
// One attention class: LinearAttention is RuleAttention under the additive rule (the same type,
// so the same bits), and each rule's state type.
static_assert(
    std::is_same_v<linattn::LinearAttention<linattn::EluPlusOne>,
                   linattn::RuleAttention<linattn::EluPlusOne, linattn::Additive, float>>);
static_assert(std::is_same_v<linattn::RuleAttention<linattn::EluPlusOne>::State,
                             linattn::AttentionState<float>>);
static_assert(std::is_same_v<linattn::state_t<linattn::Gated, double>,
                             linattn::RuleState<linattn::Gated, double>>);
static_assert(linattn::WriteRule<linattn::Additive> && linattn::WriteRule<linattn::GatedDelta>);
static_assert(linattn::Additive::has_full_form && !linattn::Decay::has_full_form &&
              !linattn::Gated::has_full_form && !linattn::Delta::has_full_form &&
              !linattn::GatedDelta::has_full_form);
// What the grouped calls take: spans or vectors of row views, or a tensor view slice; not a
// vector of owning matrices (that would copy every head).
static_assert(linattn::detail::QueryGroup<std::vector<linattn::ConstRowsView<float>>, float>);
static_assert(linattn::detail::QueryGroup<std::span<const linattn::ConstRowsView<double>>, double>);
static_assert(linattn::detail::QueryGroup<linattn::TensorView<const float>, float>);
static_assert(linattn::detail::QueryGroup<linattn::TensorView<float>, float>);
static_assert(!linattn::detail::QueryGroup<std::vector<linattn::RowMatrix<float>>, float>);
static_assert(!linattn::detail::QueryGroup<std::vector<linattn::ConstRowsView<float>>, double>);
static_assert(linattn::detail::OutputGroup<std::vector<linattn::RowsView<float>>, float>);
static_assert(linattn::detail::OutputGroup<linattn::TensorView<float>, float>);
static_assert(!linattn::detail::OutputGroup<linattn::TensorView<const float>, float>);
static_assert(!linattn::detail::OutputGroup<std::vector<linattn::ConstRowsView<float>>, float>);
