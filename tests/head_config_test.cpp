// head_config.hpp: the head counts and dimensions of a layer, and the configurations refused.

#include <linattn/head_config.hpp>
#include <linattn/multihead.hpp>

#include <catch2/catch.hpp>

#include <string>

namespace head_config_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

TEST_CASE("a layer takes H_q a multiple of H_kv and positive dimensions", "[head_config]") {
  using Layer = MultiHeadAttention<LinearAttention<EluPlusOne>>;
  const Layer gqa(HeadConfig{8, 2, 16, 32});
  CHECK(gqa.group_size() == 4);
  CHECK(gqa.state_heads() == 2);
  CHECK(gqa.feature_dim() == 16);
  const Layer mqa(HeadConfig{4, 1, 8, 8});
  CHECK(mqa.group_size() == 4);
  const auto refused = [](HeadConfig h, const std::string& part) {
    try {
      const Layer layer(h);
      FAIL("accepted");
    } catch (const ShapeError& e) {
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  refused({3, 2, 4, 4}, "multiple of");
  refused({2, 1, 0, 4}, "positive");
  refused({2, 1, 4, 0}, "positive");
  refused({0, 1, 4, 4}, "positive");
  refused(HeadConfig{}, "positive");  // the defaults name no dimensions
}

}  // namespace head_config_test
