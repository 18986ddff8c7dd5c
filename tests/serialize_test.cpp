// Saving and restoring batch state: round trips that continue bit-identically, the byte
// layout (little-endian, documented offsets), and rejection of every corrupted, truncated or
// mismatched blob.

#include <linattn/random_features.hpp>
#include <linattn/serialize.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

using namespace linattn;

namespace {

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

template <class Scalar>
std::vector<Scalar> random_buffer(Index n, std::uint64_t seed) {
  const auto m = linattn_test::random_matrix<Scalar>(1, n, seed);
  return {m.data(), m.data() + n};
}

// A small layer and a few decode steps of B sequences, all batch-first.
template <class Phi, class Scalar>
struct Session {
  static constexpr Index B = 2, Hq = 2, Hkv = 1, dk = 3, dv = 2, T = 8;
  MultiHeadAttention<Phi, Scalar> mha;
  std::vector<Scalar> q = random_buffer<Scalar>(B * T * Hq * dk, 71);
  std::vector<Scalar> k = random_buffer<Scalar>(B * T * Hkv * dk, 72);
  std::vector<Scalar> v = random_buffer<Scalar>(B * T * Hkv * dv, 73);

  // `input_scale` multiplies q and k (large values make a log-scaled state's M matter).
  explicit Session(Phi phi = Phi{}, Scalar input_scale = 1, Options options = {})
      : mha(HeadConfig{Hq, Hkv, dk, dv}, std::move(phi), options) {
    for (auto& x : q) x *= input_scale;
    for (auto& x : k) x *= input_scale;
  }

  // Token t of every sequence, stepped; returns the [B, Hq, dv] output.
  std::vector<Scalar> step(BatchState<Scalar>& state, Index t) const {
    auto pick = [&](const std::vector<Scalar>& buf, Index H, Index d) {
      std::vector<Scalar> out;
      for (Index b = 0; b < B; ++b) {
        const auto first = buf.begin() + (b * T + t) * H * d;
        out.insert(out.end(), first, first + H * d);
      }
      return out;
    };
    const auto q1 = pick(q, Hq, dk), k1 = pick(k, Hkv, dk), v1 = pick(v, Hkv, dv);
    std::vector<Scalar> out(static_cast<std::size_t>(B * Hq * dv));
    mha.step(TensorView<const Scalar>::batch_first(q1.data(), B, 1, Hq, dk),
             TensorView<const Scalar>::batch_first(k1.data(), B, 1, Hkv, dk),
             TensorView<const Scalar>::batch_first(v1.data(), B, 1, Hkv, dv),
             TensorView<Scalar>::batch_first(out.data(), B, 1, Hq, dv), state);
    return out;
  }
};

// Patches a hand-made blob's total size (bytes 16 to 23) and appends its checksum.
void seal_blob(std::vector<std::byte>& blob) {
  const std::uint64_t size = blob.size() + 8;
  for (std::size_t i = 0; i < 8; ++i)
    blob[16 + i] = static_cast<std::byte>((size >> (8 * i)) & 0xff);
  const std::uint64_t sum = detail::fnv1a64(blob);
  for (std::size_t i = 0; i < 8; ++i)
    blob.push_back(static_cast<std::byte>((sum >> (8 * i)) & 0xff));
}

template <class F>
StateFormatError::Reason reason_of(F&& f) {
  try {
    f();
  } catch (const StateFormatError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).rfind("linattn: cannot restore state: ", 0) == 0);
    return e.reason();
  }
  FAIL("the blob was accepted");
  return StateFormatError::Reason::truncated;
}

}  // namespace

TEST_CASE("FNV-1a 64 matches its published test vectors", "[serialize]") {
  // Vectors from the FNV reference test suite (Fowler, Noll, Vo).
  CHECK(detail::fnv1a64(bytes_of("")) == 0xcbf29ce484222325ull);
  CHECK(detail::fnv1a64(bytes_of("a")) == 0xaf63dc4c8601ec8cull);
  CHECK(detail::fnv1a64(bytes_of("foobar")) == 0x85944171f73967e8ull);
}

TEMPLATE_TEST_CASE("save mid-sequence, restore in a fresh object, continue identically",
                   "[serialize]", float, double) {
  // Decode blocks: 16 (the 3 saved tokens are all pending), 2 (the first token folded into S,
  // the other two pending; more folds after the restore) and 1 (fused steps, none pending).
  for (Index block : {Index{16}, Index{2}, Index{1}}) {
    CAPTURE(block);
    const Options options{{}, 32, block};
    const Session<EluPlusOne, TestType> s(EluPlusOne{}, 1, options);
    auto state = s.mha.make_state(s.B);
    for (Index t = 0; t < 3; ++t) static_cast<void>(s.step(state, t));
    const Index pending = block > 1 ? (3 - 1) % block + 1 : 0;  // folds wait for the next token
    REQUIRE(state.sequence(0).head(0).pending_tokens() == pending);
    const std::vector<std::byte> blob = save_state(s.mha, state);
    // One state per key/value head (H_s = H_kv = 1 here, for H_q = 2 query heads).
    REQUIRE(s.mha.state_heads() == s.Hkv);
    CHECK(blob.size() ==
          8 + 4 + 4 + 8 + 8 + 4 + std::string("elu_plus_one").size() + 7 * 8 +
              s.B * s.Hkv *
                  (16 + (s.dk * s.dv + s.dk + 1 + pending * (s.dk + s.dv)) * sizeof(TestType)) +
              8);

    // A different layer object of the same configuration restores it, pending tokens as they
    // were, so every later step gives the same bits.
    const Session<EluPlusOne, TestType> fresh(EluPlusOne{}, 1, options);
    auto restored = load_state(fresh.mha, blob);
    REQUIRE(restored.size() == s.B);
    CHECK(restored.sequence(1).tokens() == 3);
    CHECK(restored.sequence(1).head(0).pending_tokens() == pending);
    for (Index t = 3; t < s.T; ++t) {
      const auto a = s.step(state, t);
      const auto b = fresh.step(restored, t);
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(TestType)) == 0);
    }
  }
  const Session<EluPlusOne, TestType> s;
  auto state = s.mha.make_state(s.B);
  for (Index t = 0; t < s.T; ++t) static_cast<void>(s.step(state, t));

  // One sequence alone: park sequence 1, restore it into another batch.
  const auto one = save_sequence(s.mha, state, state.id_at(1));
  auto other = s.mha.make_state(1);
  const auto ids = restore_sequences(s.mha, other, one);
  REQUIRE(ids.size() == 1);
  CHECK(other.size() == 2);
  CHECK(other.index_of(ids[0]) == 1);
  for (Index h = 0; h < s.mha.state_heads(); ++h) {
    CHECK(other.sequence(1).head(h).S() == state.sequence(1).head(h).S());
    CHECK(other.sequence(1).head(h).z() == state.sequence(1).head(h).z());
    CHECK(other.sequence(1).head(h).tokens() == s.T);
  }
  // An empty batch round-trips too.
  CHECK(load_state(s.mha, save_state(s.mha, s.mha.make_state())).size() == 0);
}

TEST_CASE("the byte layout is little-endian with the documented offsets", "[serialize]") {
  const MultiHeadAttention<EluPlusOne, float> mha({1, 1, 1, 1});
  auto state = mha.make_state(1);
  state.sequence(0).head(0).mutable_S()(0, 0) = 1.0f;   // binary32 0x3f800000
  state.sequence(0).head(0).mutable_z()(0) = -2.0f;     // binary32 0xc0000000
  state.sequence(0).head(0).set_tokens(0x0102);
  state.sequence(0).head(0).set_log_scale(0.5f);        // binary32 0x3f000000
  const auto blob = save_state(mha, state);
  auto u8 = [&](std::size_t i) { return static_cast<unsigned>(blob.at(i)); };
  CHECK(std::string(reinterpret_cast<const char*>(blob.data()), 8) == "LNATTNST");
  CHECK((u8(8) == 3 && u8(9) == 0 && u8(10) == 0 && u8(11) == 0));  // version 3
  CHECK(u8(12) == 1);                                                // float
  CHECK(u8(16) == blob.size());                                      // total size, low byte
  const std::size_t name_at = 36, name_len = std::string("elu_plus_one").size();
  CHECK(u8(32) == name_len);
  const std::size_t dims_at = name_at + name_len, head_at = dims_at + 7 * 8;
  CHECK(u8(dims_at + 5 * 8) == 1);                   // N = 1
  CHECK(u8(dims_at + 6 * 8) == 1);                   // H_s = 1 state head per sequence
  CHECK((u8(head_at) == 0x02 && u8(head_at + 1) == 0x01));  // tokens 0x0102, low byte first
  const std::size_t m_at = head_at + 8;                     // log-scale M
  CHECK((u8(m_at) == 0x00 && u8(m_at + 2) == 0x00 && u8(m_at + 3) == 0x3f));
  const std::size_t p_at = m_at + 4;                        // pending tokens: none
  for (std::size_t i = 0; i < 8; ++i) CHECK(u8(p_at + i) == 0);
  const std::size_t s_at = p_at + 8;
  CHECK((u8(s_at) == 0x00 && u8(s_at + 1) == 0x00 && u8(s_at + 2) == 0x80 && u8(s_at + 3) == 0x3f));
  CHECK((u8(s_at + 4) == 0x00 && u8(s_at + 7) == 0xc0));
  CHECK(blob.size() == s_at + 8 + 8);

  // The same state written as versions 1 and 2, which this build still reads: drop the H_s
  // field (both) and the pending field (version 1), then patch the version, the size and the
  // checksum.
  const auto at = [&](std::size_t i) { return blob.begin() + static_cast<std::ptrdiff_t>(i); };
  for (const unsigned version : {1u, 2u}) {
    CAPTURE(version);
    std::vector<std::byte> old_blob(blob.begin(), at(dims_at + 6 * 8));
    old_blob.insert(old_blob.end(), at(head_at), at(version == 1 ? p_at : s_at));
    old_blob.insert(old_blob.end(), at(s_at), blob.end() - 8);
    old_blob[8] = static_cast<std::byte>(version);
    seal_blob(old_blob);
    const auto old = load_state(mha, old_blob);
    REQUIRE(old.size() == 1);
    CHECK(old.sequence(0).head(0).S() == state.sequence(0).head(0).S());
    CHECK(old.sequence(0).head(0).z() == state.sequence(0).head(0).z());
    CHECK(old.sequence(0).head(0).tokens() == 0x0102);
    CHECK(old.sequence(0).head(0).log_scale() == 0.5f);
  }
}

TEMPLATE_TEST_CASE("a version 2 blob with a state per query head loads into one per key/value head",
                   "[serialize][group]", float, double) {
  // Before version 3 the layer kept a state per query head: the G = 2 query heads of the
  // Session's one key/value head each held the same S and z. Such a blob is made here from a
  // version 3 one by writing each sequence's block twice (no pending tokens: decode_block 1).
  using R = StateFormatError::Reason;
  const Options options{{}, 32, 1};
  const Session<EluPlusOne, TestType> s(EluPlusOne{}, 1, options);
  auto state = s.mha.make_state(s.B);
  for (Index t = 0; t < 3; ++t) static_cast<void>(s.step(state, t));
  const auto blob = save_state(s.mha, state);
  const std::size_t dims_at = 36 + std::string("elu_plus_one").size();
  const std::size_t head_at = dims_at + 7 * 8;
  const std::size_t block = 16 + (s.dk * s.dv + s.dk + 1) * sizeof(TestType);
  REQUIRE(blob.size() == head_at + s.B * block + 8);
  const auto at = [&](std::size_t i) { return blob.begin() + static_cast<std::ptrdiff_t>(i); };
  std::vector<std::byte> v2(blob.begin(), at(dims_at + 6 * 8));
  for (Index b = 0; b < s.B; ++b)
    for (Index h = 0; h < s.Hq; ++h)
      v2.insert(v2.end(), at(head_at + b * block), at(head_at + (b + 1) * block));
  v2[8] = std::byte{2};
  auto sealed = v2;
  seal_blob(sealed);
  auto restored = load_state(s.mha, sealed);
  REQUIRE(restored.size() == s.B);
  REQUIRE(restored.heads() == 1);
  for (Index t = 3; t < s.T; ++t) {
    const auto a = s.step(state, t);
    const auto b = s.step(restored, t);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(TestType)) == 0);
  }
  // Query heads of one key/value head that disagree cannot become one state: change the
  // second copy's S(0, 0) of sequence 1 (its first scalar after tokens, M and p).
  const std::size_t second_S = dims_at + 6 * 8 + 3 * block + 8 + sizeof(TestType) + 8;
  auto differ = v2;
  differ[second_S] ^= std::byte{0x01};
  seal_blob(differ);
  auto target = s.mha.make_state();
  CHECK(reason_of([&] { static_cast<void>(restore_sequences(s.mha, target, differ)); }) ==
        R::shape_mismatch);
  CHECK(target.size() == 0);
}

TEST_CASE("every corrupted, truncated or mismatched blob is rejected", "[serialize]") {
  using R = StateFormatError::Reason;
  const Session<EluPlusOne, float> s;
  auto state = s.mha.make_state(s.B);
  static_cast<void>(s.step(state, 0));
  const auto blob = save_state(s.mha, state);

  SECTION("every single flipped byte") {
    for (std::size_t i = 0; i < blob.size(); ++i) {
      auto bad = blob;
      bad[i] ^= std::byte{0x5a};
      auto target = s.mha.make_state();
      INFO("byte " << i);
      const R r = reason_of([&] { static_cast<void>(restore_sequences(s.mha, target, bad)); });
      CHECK(target.size() == 0);  // nothing restored from a rejected blob
      if (i >= 24) CHECK(r == R::checksum_mismatch);
    }
  }
  SECTION("every truncation") {
    for (std::size_t n = 0; n < blob.size(); ++n) {
      INFO("first " << n << " bytes");
      CHECK(reason_of([&] { static_cast<void>(load_state(s.mha, std::span(blob).first(n))); }) ==
            R::truncated);
    }
  }
  SECTION("trailing bytes") {
    auto longer = blob;
    longer.push_back(std::byte{0});
    CHECK(reason_of([&] { static_cast<void>(load_state(s.mha, longer)); }) == R::size_mismatch);
  }
  SECTION("not a state, or a future version") {
    auto bad = blob;
    bad[0] = std::byte{'X'};
    CHECK(reason_of([&] { static_cast<void>(load_state(s.mha, bad)); }) == R::bad_magic);
    bad = blob;
    bad[8] = std::byte{4};
    CHECK(reason_of([&] { static_cast<void>(load_state(s.mha, bad)); }) == R::unsupported_version);
  }
  SECTION("wrong dimensions") {
    const MultiHeadAttention<EluPlusOne, float> wide({s.Hq, s.Hkv, s.dk, s.dv + 1});
    CHECK(reason_of([&] { static_cast<void>(load_state(wide, blob)); }) == R::shape_mismatch);
    const MultiHeadAttention<EluPlusOne, float> grouped({s.Hq, s.Hq, s.dk, s.dv});
    CHECK(reason_of([&] { static_cast<void>(load_state(grouped, blob)); }) == R::shape_mismatch);
    try {
      static_cast<void>(load_state(wide, blob));
    } catch (const StateFormatError& e) {
      CHECK(std::string(e.what()).find("dv=2, this layer has") != std::string::npos);
    }
  }
  SECTION("wrong scalar type") {
    const MultiHeadAttention<EluPlusOne, double> dbl({s.Hq, s.Hkv, s.dk, s.dv});
    CHECK(reason_of([&] { static_cast<void>(load_state(dbl, blob)); }) == R::scalar_type_mismatch);
  }
  SECTION("wrong feature map") {
    const MultiHeadAttention<Identity, float> ident({s.Hq, s.Hkv, s.dk, s.dv});
    CHECK(reason_of([&] { static_cast<void>(load_state(ident, blob)); }) ==
          R::feature_map_mismatch);
  }
  SECTION("a state that is not the layer's is a shape error") {
    auto foreign = BatchState<float>(s.Hq, s.dk, s.dk, s.dv + 1);
    CHECK_THROWS_AS(restore_sequences(s.mha, foreign, blob), ShapeError);
    CHECK_THROWS_AS(save_state(s.mha, foreign), ShapeError);
  }
}

namespace {
// A feature map with a parameter: the fingerprint tells two instances apart.
struct ScaledElu {
  static constexpr bool strictly_positive = true;
  static constexpr const char* name = "scaled_elu";
  double scale = 1.0;
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    EluPlusOne{}.apply(x, out);
    out *= static_cast<typename Out::Scalar>(scale);
  }
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    return std::bit_cast<std::uint64_t>(scale);
  }
};
}  // namespace

TEST_CASE("a feature map's fingerprint is part of its identity", "[serialize]") {
  const MultiHeadAttention<ScaledElu, float> one({1, 1, 2, 2}, ScaledElu{1.0});
  const MultiHeadAttention<ScaledElu, float> two({1, 1, 2, 2}, ScaledElu{2.0});
  const auto blob = save_state(one, one.make_state(1));
  CHECK(load_state(one, blob).size() == 1);
  CHECK(reason_of([&] { static_cast<void>(load_state(two, blob)); }) ==
        StateFormatError::Reason::feature_map_mismatch);
}

TEMPLATE_TEST_CASE("log-scaled random-feature states round-trip, and the draw is checked",
                   "[serialize]", float, double) {
  // Inputs of size ~20 make the key log-scales large, so the state's M is far from 0 and a
  // restore that dropped it would change every later output.
  using Phi = PositiveRandomFeatures<TestType>;
  using S = Session<Phi, TestType>;
  const S s(Phi(S::dk, 16, 5), TestType(20));
  auto state = s.mha.make_state(S::B);
  REQUIRE(state.log_domain());
  for (Index t = 0; t < 3; ++t) static_cast<void>(s.step(state, t));
  REQUIRE(std::abs(state.sequence(0).head(0).log_scale()) > 10);
  const auto blob = save_state(s.mha, state);

  const S fresh(Phi(S::dk, 16, 5), TestType(20));  // same draw, another object
  auto restored = load_state(fresh.mha, blob);
  CHECK(restored.sequence(1).head(1).log_scale() == state.sequence(1).head(1).log_scale());
  for (Index t = 3; t < S::T; ++t) {
    const auto a = s.step(state, t);
    const auto b = fresh.step(restored, t);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(TestType)) == 0);
  }
  // Same name and shapes but another seed: a different kernel, so the blob is refused.
  const S other_draw(Phi(S::dk, 16, 6), TestType(20));
  CHECK(reason_of([&] { (void)load_state(other_draw.mha, blob); }) ==
        StateFormatError::Reason::feature_map_mismatch);
  // A log-scaled sequence cannot join a batch of ordinary states.
  BatchState<TestType> plain(S::Hq, 16, S::dk, S::dv, 0, false);
  CHECK_THROWS_AS(plain.add_sequence(state.take_sequence(state.id_at(0))), ShapeError);
}
