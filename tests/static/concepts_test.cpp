// Compile-time checks of the concepts: this file compiling is the test.

#include <linattn/linattn.hpp>

#include <string>

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
