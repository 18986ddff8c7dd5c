// Saving and restoring states: one head state on its own and a multi-head batch, every rule,
// round trips that continue bit-identically (decode blocks included), the byte layout of
// version 4, blobs saved by versions 1 to 3, rejection of every corrupted, truncated or
// mismatched blob, and validation of every restored value.

#include <linattn/multihead.hpp>
#include <linattn/random_features.hpp>
#include <linattn/serialize.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace serialize_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using R = StateFormatError::Reason;

namespace {

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

std::vector<std::byte> read_file(const std::string& name) {
  // Appended in place: g++ 12 at -O2 reports a false -Warray-bounds inside libstdc++ for
  // std::string(literal) + "/" + name.
  std::string path = LINATTN_TEST_DATA_DIR;
  path.append("/").append(name);
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  const std::vector<char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(raw.size());
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

// Patches a hand-edited blob's total size (bytes 16 to 23) and appends its checksum.
void seal_blob(std::vector<std::byte>& blob) {
  const std::uint64_t size = blob.size() + 8;
  for (std::size_t i = 0; i < 8; ++i) blob[16 + i] = static_cast<std::byte>((size >> (8 * i)) & 0xff);
  const std::uint64_t sum = detail::fnv1a64(blob);
  for (std::size_t i = 0; i < 8; ++i) blob.push_back(static_cast<std::byte>((sum >> (8 * i)) & 0xff));
}
// A sealed blob with its checksum removed, edited by `edit`, and sealed again.
template <class Edit>
std::vector<std::byte> reseal(std::vector<std::byte> blob, Edit&& edit) {
  blob.resize(blob.size() - 8);
  edit(blob);
  seal_blob(blob);
  return blob;
}
void put_u64(std::vector<std::byte>& b, std::size_t at, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
// A binary32 written little-endian at `at`.
void put_f32(std::vector<std::byte>& b, std::size_t at, float f) {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  for (std::size_t i = 0; i < 4; ++i) b[at + i] = static_cast<std::byte>((bits >> (8 * i)) & 0xff);
}
std::uint64_t get_u64(const std::vector<std::byte>& b, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(b[at + i]) << (8 * i);
  return v;
}

template <class F>
R reason_of(F&& f) {
  try {
    f();
  } catch (const StateFormatError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).rfind("linattn: cannot restore state: ", 0) == 0);
    return e.reason();
  }
  FAIL("the blob was accepted");
  return R::truncated;
}

// Offsets of a version-4 blob: the fixed header (24 bytes), the kind (4), then the identity.
struct Layout4 {
  std::size_t identity = 28, map_name, rule_len, rule_name, parameter, dims, counts, head;
  Layout4(std::size_t map_len, std::size_t rule_len_, bool batch) {
    map_name = identity + 8 + 4;
    rule_len = map_name + map_len;
    rule_name = rule_len + 4;
    parameter = rule_name + rule_len_;
    dims = parameter + 8;
    counts = dims + 3 * 8;
    head = counts + (batch ? 4 * 8 : 0);
  }
};

// T tokens of q, k, v (T x d each) stepped through `state`; returns the outputs.
template <class Attention>
RowMatrix<typename Attention::scalar_type> run_steps(const Attention& attn, typename Attention::State& state,
                                                     Index first, Index T, std::uint64_t seed) {
  using Scalar = typename Attention::scalar_type;
  const Index dk = state.key_dim(), dv = state.value_dim();
  const auto q = linattn_test::random_matrix<Scalar>(first + T, dk, seed);
  const auto k = linattn_test::random_matrix<Scalar>(first + T, dk, seed + 1);
  const auto v = linattn_test::random_matrix<Scalar>(first + T, dv, seed + 2);
  const auto gates = linattn_test::uniform_matrix<Scalar>(first + T, 2, seed + 3, -1.0, 0.0);
  const auto betas = linattn_test::uniform_matrix<Scalar>(first + T, 1, seed + 4, 0.0, 1.0);
  RowMatrix<Scalar> y(T, dv);
  using Rule = typename Attention::rule_type;
  for (Index t = first; t < first + T; ++t) {
    if constexpr (Rule::kind == WriteKind::gated)
      attn.step_into(state, q.row(t), k.row(t), v.row(t), gates(t, 0), y.row(t - first));
    else if constexpr (Rule::kind == WriteKind::delta)
      attn.step_into(state, q.row(t), k.row(t), v.row(t), betas(t, 0), y.row(t - first));
    else if constexpr (Rule::kind == WriteKind::gated_delta)
      attn.step_into(state, q.row(t), k.row(t), v.row(t), betas(t, 0), gates(t, 1), y.row(t - first));
    else
      attn.step_into(state, q.row(t), k.row(t), v.row(t), y.row(t - first));
  }
  return y;
}

// Saves a head state mid-sequence, restores it into a fresh state of `restorer`, and checks
// that both continue with the same bits.
template <class Attention>
void check_head_round_trip(const Attention& saver, const Attention& restorer) {
  auto state = saver.make_state(5, 4);
  static_cast<void>(run_steps(saver, state, 0, 7, 31));
  const auto blob = save_state(state);
  auto restored = restorer.make_state(5, 4);
  restore_state(restored, blob);
  CHECK(save_state(restored) == blob);
  CHECK(restored.tokens() == 7);
  const auto a = run_steps(saver, state, 7, 9, 31);
  const auto b = run_steps(restorer, restored, 7, 9, 31);
  CHECK(std::memcmp(a.data(), b.data(), sizeof(typename Attention::scalar_type) * a.size()) == 0);
}

}  // namespace

TEST_CASE("FNV-1a 64 matches its published test vectors", "[serialize]") {
  // Vectors from the FNV reference test suite (Fowler, Noll, Vo).
  CHECK(detail::fnv1a64(bytes_of("")) == 0xcbf29ce484222325ull);
  CHECK(detail::fnv1a64(bytes_of("a")) == 0xaf63dc4c8601ec8cull);
  CHECK(detail::fnv1a64(bytes_of("foobar")) == 0x85944171f73967e8ull);
}

TEMPLATE_TEST_CASE("one head state of every rule saves alone and continues identically",
                   "[serialize]", float, double) {
  using S = TestType;
  check_head_round_trip(LinearAttention<EluPlusOne, S>(), LinearAttention<EluPlusOne, S>());
  check_head_round_trip(RuleAttention<EluPlusOne, Decay, S>(EluPlusOne{}, Decay(0.9)),
                        RuleAttention<EluPlusOne, Decay, S>(EluPlusOne{}, Decay(0.9)));
  check_head_round_trip(RuleAttention<EluPlusOne, Gated, S>(), RuleAttention<EluPlusOne, Gated, S>());
  check_head_round_trip(RuleAttention<L2Normalize, Delta, S>(), RuleAttention<L2Normalize, Delta, S>());
  check_head_round_trip(RuleAttention<L2Normalize, GatedDelta, S>(),
                        RuleAttention<L2Normalize, GatedDelta, S>());
  // The decode block is part of the saved state: a state saved with B = 4 (pending tokens in
  // the blob) continues with the same bits under an attention whose Options say 0 or 16.
  for (const Index restorer_block : {Index{0}, Index{16}}) {
    Options saving, restoring;
    saving.decode_block = 4;
    restoring.decode_block = restorer_block;
    const LinearAttention<EluPlusOne, S> a(EluPlusOne{}, saving), b(EluPlusOne{}, restoring);
    auto state = a.make_state(5, 4);
    static_cast<void>(run_steps(a, state, 0, 7, 41));
    REQUIRE(state.pending_tokens() == 3);  // tokens 4, 5, 6: the block of 4, 5, 6, 7 waits
    auto restored = b.make_state(5, 4);
    restore_state(restored, save_state(state));
    CHECK(restored.decode_block() == 4);
    CHECK(restored.pending_tokens() == 3);
    const auto ya = run_steps(a, state, 7, 9, 41), yb = run_steps(b, restored, 7, 9, 41);
    CHECK(ya == yb);
  }
}

TEST_CASE("a head state is refused by another attention, kind or shape", "[serialize]") {
  const LinearAttention<EluPlusOne> elu;
  auto state = elu.make_state(3, 2);
  static_cast<void>(run_steps(elu, state, 0, 2, 51));
  const auto blob = save_state(state);
  auto ident = LinearAttention<Identity>().make_state(3, 2);
  CHECK(reason_of([&] { restore_state(ident, blob); }) == R::feature_map_mismatch);
  auto decay = RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.5)).make_state(3, 2);
  CHECK(reason_of([&] { restore_state(decay, blob); }) == R::rule_mismatch);
  // Another gamma is another rule parameter.
  const RuleAttention<EluPlusOne, Decay> d9(EluPlusOne{}, Decay(0.9));
  auto decay9 = d9.make_state(3, 2);
  CHECK(reason_of([&] { restore_state(decay9, save_state(decay)); }) == R::rule_mismatch);
  // A parameter of -0.0 where the rule has +0.0 (Gated records 0) compares equal but is other
  // bits: refused, as a restored state must save back to the blob's bytes (found by fuzzing).
  {
    const RuleAttention<EluPlusOne, Gated> gated;
    auto g = gated.make_state(3, 2);
    const auto gblob = save_state(g);
    const Layout4 at(std::string("elu_plus_one").size(), std::string("gated").size(), false);
    const auto minus_zero =
        reseal(gblob, [&](auto& b) { put_u64(b, at.parameter, std::bit_cast<std::uint64_t>(-0.0)); });
    CHECK(reason_of([&] { restore_state(g, minus_zero); }) == R::rule_mismatch);
    // The log-scale field, 0 for every rule state: -0.0 is refused as well.
    const auto minus_zero_scale = reseal(gblob, [&](auto& b) { put_f32(b, at.head + 24, -0.0f); });
    CHECK(reason_of([&] { restore_state(g, minus_zero_scale); }) == R::bad_value);
    restore_state(g, gblob);  // the untouched blob still restores
    CHECK(save_state(g) == gblob);
  }
  auto wide = elu.make_state(3, 3);
  CHECK(reason_of([&] { restore_state(wide, blob); }) == R::shape_mismatch);
  auto dbl = LinearAttention<EluPlusOne, double>().make_state(3, 2);
  CHECK(reason_of([&] { restore_state(dbl, blob); }) == R::scalar_type_mismatch);
  // A failed restore leaves the target as it was.
  CHECK(wide.tokens() == 0);
  // A batch blob is not a head state, and the reverse.
  const MultiHeadAttention<LinearAttention<EluPlusOne>> layer({1, 1, 3, 2});
  const auto batch_blob = save_state(layer, layer.make_state(1));
  CHECK(reason_of([&] { restore_state(state, batch_blob); }) == R::shape_mismatch);
  auto batch = layer.make_state();
  CHECK(reason_of([&] { static_cast<void>(restore_sequences(layer, batch, blob)); }) == R::shape_mismatch);
}

TEMPLATE_TEST_CASE("a batch saved mid-sequence restores in a fresh layer and continues identically",
                   "[serialize]", float, double) {
  // Decode blocks: 16 (the 3 saved tokens are all pending), 2 (the first token folded into S,
  // the other two pending; more folds after the restore) and 1 (fused steps, none pending).
  using Scalar = TestType;
  const Index B = 2, Hq = 2, Hkv = 1, dk = 3, dv = 2, T = 8;
  const auto q = linattn_test::random_matrix<Scalar>(B * T, Hq * dk, 71);
  const auto k = linattn_test::random_matrix<Scalar>(B * T, Hkv * dk, 72);
  const auto v = linattn_test::random_matrix<Scalar>(B * T, Hkv * dv, 73);
  using Layer = MultiHeadAttention<LinearAttention<EluPlusOne, Scalar>>;
  // Token t of every sequence ([B, T, H, d] as rows b * T + t), stepped.
  const auto step = [&](const Layer& layer, typename Layer::State& state, Index t) {
    RowMatrix<Scalar> out(B, Hq * dv);
    const auto at = [&](const RowMatrix<Scalar>& m, Index H, Index d) {
      return TensorView<const Scalar>(m.row(t).data(), {B, 1, H, d}, {T * H * d, 0, d, 1});
    };
    layer.step_into(state, at(q, Hq, dk), at(k, Hkv, dk), at(v, Hkv, dv),
                    TensorView<Scalar>::batch_first(out.data(), B, 1, Hq, dv));
    return out;
  };
  for (Index block : {Index{16}, Index{2}, Index{1}}) {
    CAPTURE(block);
    Options options;
    options.decode_block = block;
    const Layer layer({Hq, Hkv, dk, dv}, LinearAttention<EluPlusOne, Scalar>(EluPlusOne{}, options));
    auto state = layer.make_state(B);
    for (Index t = 0; t < 3; ++t) static_cast<void>(step(layer, state, t));
    const Index pending = block > 1 ? (3 - 1) % block + 1 : 0;  // folds wait for the next token
    REQUIRE(state.sequence(0).head(0).pending_tokens() == pending);
    const std::vector<std::byte> blob = save_state(layer, state);
    const Layout4 at(std::string("elu_plus_one").size(), std::string("additive").size(), true);
    CHECK(blob.size() == at.head + static_cast<std::size_t>(B * Hkv) *
                                       (24 + (dk * dv + dk + 1 + pending * (dk + dv)) * sizeof(Scalar)) +
                             8);
    const Layer fresh({Hq, Hkv, dk, dv}, LinearAttention<EluPlusOne, Scalar>(EluPlusOne{}, options));
    auto restored = load_state(fresh, blob);
    REQUIRE(restored.size() == B);
    CHECK(restored.sequence(1).tokens() == 3);
    CHECK(restored.sequence(1).head(0).pending_tokens() == pending);
    for (Index t = 3; t < T; ++t) REQUIRE(step(layer, state, t) == step(fresh, restored, t));
    // One sequence alone: park sequence 1, restore it into another batch.
    const auto one = save_sequence(layer, state, state.id_at(1));
    auto other = layer.make_state(1);
    const auto ids = restore_sequences(layer, other, one);
    REQUIRE(ids.size() == 1);
    CHECK(other.index_of(ids[0]) == 1);
    CHECK(other.sequence(1).head(0).S() == state.sequence(1).head(0).S());
    CHECK(other.sequence(1).head(0).z() == state.sequence(1).head(0).z());
    CHECK(other.sequence(1).head(0).tokens() == T);
    // An empty batch round-trips too.
    CHECK(load_state(layer, save_state(layer, layer.make_state())).size() == 0);
  }
}

TEST_CASE("the version 4 layout has the documented fields, little-endian", "[serialize]") {
  const RuleAttention<EluPlusOne, Decay> attn(EluPlusOne{}, Decay(0.75));
  auto state = attn.make_state(2, 1);
  static_cast<void>(run_steps(attn, state, 0, 3, 61));
  const auto blob = save_state(state);
  auto u8 = [&](std::size_t i) { return static_cast<unsigned>(blob.at(i)); };
  CHECK(std::string(reinterpret_cast<const char*>(blob.data()), 8) == "LNATTNST");
  CHECK((u8(8) == 4 && u8(9) == 0 && u8(10) == 0 && u8(11) == 0));  // version 4
  CHECK(u8(12) == 1);                                                // binary32
  CHECK(get_u64(blob, 16) == blob.size());
  CHECK(u8(24) == 1);                                                // one head state
  const Layout4 at(std::string("elu_plus_one").size(), std::string("decay").size(), false);
  CHECK(u8(at.identity + 8) == 12);
  CHECK(std::string(reinterpret_cast<const char*>(&blob[at.map_name]), 12) == "elu_plus_one");
  CHECK(std::string(reinterpret_cast<const char*>(&blob[at.rule_name]), 5) == "decay");
  CHECK(std::bit_cast<double>(get_u64(blob, at.parameter)) == 0.75);
  CHECK(get_u64(blob, at.dims) == 2);       // r
  CHECK(get_u64(blob, at.dims + 8) == 2);   // dk
  CHECK(get_u64(blob, at.dims + 16) == 1);  // dv
  CHECK(get_u64(blob, at.head) == 3);       // tokens
  CHECK(get_u64(blob, at.head + 8) == 0);   // decode block: none for Decay
  CHECK(get_u64(blob, at.head + 16) == 0);  // pending
  const std::size_t s_at = at.head + 24 + 4;  // after M (one binary32)
  for (Index i = 0; i < 2; ++i) {
    std::uint32_t bits = 0;
    for (std::size_t j = 0; j < 4; ++j)
      bits |= static_cast<std::uint32_t>(u8(s_at + static_cast<std::size_t>(i) * 4 + j)) << (8 * j);
    CHECK(std::bit_cast<float>(bits) == state.S()(i, 0));
  }
  CHECK(blob.size() == s_at + 2 * 4 + 2 * 4 + 8);  // S (2 x 1), z (2), checksum
}

TEST_CASE("blobs saved by version 3 load, and versions 1 and 2 made from them", "[serialize]") {
  // tests/data holds blobs written by the last version-3 build (see tests/data/README.md for
  // how); their inputs are x_i = 1.1 sin(0.37 i + seed) in [B, T, H, d] order.
  const auto input = [](Index n, double seed) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = std::sin(0.37 * double(i) + seed) * 1.1;
    return x;
  };
  SECTION("ELU+1, float, grouped heads, two pending decode tokens: the states match a fresh run") {
    Options options;
    options.decode_block = 4;
    using Layer = MultiHeadAttention<LinearAttention<EluPlusOne>>;
    const Layer layer({4, 2, 8, 4}, LinearAttention<EluPlusOne>(EluPlusOne{}, options));
    const auto loaded = load_state(layer, read_file("v3_elu_float_gqa.bin"));
    REQUIRE(loaded.size() == 2);
    // The same 11 + 6 tokens through this build, one head state at a time.
    const Index T = 17, Hkv = 2, dk = 8, dv = 4;
    const auto kd = input(2 * T * Hkv * dk, 2.0), vd = input(2 * T * Hkv * dv, 3.0);
    for (Index b = 0; b < 2; ++b)
      for (Index g = 0; g < Hkv; ++g) {
        const auto& st = loaded.sequence(b).head(g);
        CHECK(st.tokens() == T);
        CHECK(st.pending_tokens() == 2);
        CHECK(st.decode_block() == 4);  // the restoring layer's: version 3 did not record it
        // S = sum_t phi(k_t) v_t^T and z = sum_t phi(k_t) in double: sums of 17 terms, so the
        // float state errs by at most (17 + 4) u times the sums of magnitudes (elu's few ulps
        // and the additions).
        Eigen::MatrixXd S = Eigen::MatrixXd::Zero(dk, dv), mag = S;
        Eigen::VectorXd z = Eigen::VectorXd::Zero(dk);
        for (Index t = 0; t < T; ++t)
          for (Index i = 0; i < dk; ++i) {
            const double f = linattn_test::elu_plus_one(kd[static_cast<std::size_t>(((b * T + t) * Hkv + g) * dk + i)]);
            z(i) += f;
            for (Index j = 0; j < dv; ++j) {
              const double vv = vd[static_cast<std::size_t>(((b * T + t) * Hkv + g) * dv + j)];
              S(i, j) += f * vv;
              mag(i, j) += std::abs(f * vv);
            }
          }
        const double u = linattn_test::unit_roundoff<float>();
        const RowMatrix<float> got = st.S();
        for (Index i = 0; i < dk; ++i) {
          CHECK(std::abs(double(st.z()(i)) - z(i)) <= 21 * u * z(i));
          for (Index j = 0; j < dv; ++j) CHECK(std::abs(double(got(i, j)) - S(i, j)) <= 21 * u * mag(i, j));
        }
      }
    // A version-2 blob (one block per query head) made from it: every block written twice.
    const auto v3 = read_file("v3_elu_float_gqa.bin");
    const std::size_t dims_at = 24 + 8 + 4 + 12, heads_at = dims_at + 7 * 8;
    std::vector<std::size_t> starts{heads_at};
    std::size_t at = heads_at;
    for (int i = 0; i < 4; ++i) {  // 2 sequences x 2 state heads: tokens, M, p, S, z, pending
      const std::uint64_t p = get_u64(v3, at + 8 + 4);
      at += 8 + 4 + 8 + (8 * 4 + 8) * 4 + p * (8 + 4) * 4;
      starts.push_back(at);
    }
    REQUIRE(starts.back() == v3.size() - 8);
    std::vector<std::byte> v2(v3.begin(), v3.begin() + static_cast<std::ptrdiff_t>(dims_at + 6 * 8));
    v2[8] = std::byte{2};
    for (int i = 0; i < 4; ++i)
      for (int copy = 0; copy < 2; ++copy)
        v2.insert(v2.end(), v3.begin() + static_cast<std::ptrdiff_t>(starts[i]),
                  v3.begin() + static_cast<std::ptrdiff_t>(starts[i + 1]));
    seal_blob(v2);
    const auto merged = load_state(layer, v2);
    REQUIRE(merged.size() == 2);
    for (Index b = 0; b < 2; ++b)
      for (Index g = 0; g < 2; ++g) CHECK(detail::same_state(merged.sequence(b).head(g), loaded.sequence(b).head(g)));
    // Query heads of one key/value head that disagree cannot become one state.
    auto differ = v2;
    differ.resize(differ.size() - 8);
    const std::size_t second_copy = dims_at + 6 * 8 + (starts[1] - starts[0]);
    differ[second_copy + 8 + 4 + 8] ^= std::byte{0x01};  // its S(0, 0)
    seal_blob(differ);
    auto target = layer.make_state();
    CHECK(reason_of([&] { static_cast<void>(restore_sequences(layer, target, differ)); }) == R::shape_mismatch);
    CHECK(target.size() == 0);
  }
  SECTION("Identity, double, unnormalized; and as versions 1 and 2") {
    using Layer = MultiHeadAttention<LinearAttention<Identity, double>>;
    const Layer layer({2, 2, 3, 5}, LinearAttention<Identity, double>(Identity{}, Options{Normalization::unnormalized()}));
    const auto v3 = read_file("v3_identity_double.bin");
    const auto loaded = load_state(layer, v3);
    REQUIRE(loaded.size() == 1);
    CHECK(loaded.sequence(0).tokens() == 9);
    // Version 2: drop H_s; version 1: also drop each head's pending count (none are pending).
    const std::size_t dims_at = 24 + 8 + 4 + 8, heads_at = dims_at + 7 * 8;
    const std::size_t block = 8 + 8 + 8 + (3 * 5 + 3) * 8;
    REQUIRE(v3.size() == heads_at + 2 * block + 8);
    for (const unsigned version : {1u, 2u}) {
      CAPTURE(version);
      std::vector<std::byte> old(v3.begin(), v3.begin() + static_cast<std::ptrdiff_t>(dims_at + 6 * 8));
      old[8] = static_cast<std::byte>(version);
      for (std::size_t h = 0; h < 2; ++h) {
        const std::size_t b0 = heads_at + h * block;
        old.insert(old.end(), v3.begin() + static_cast<std::ptrdiff_t>(b0), v3.begin() + static_cast<std::ptrdiff_t>(b0 + 16));
        if (version == 2)
          old.insert(old.end(), v3.begin() + static_cast<std::ptrdiff_t>(b0 + 16), v3.begin() + static_cast<std::ptrdiff_t>(b0 + 24));
        old.insert(old.end(), v3.begin() + static_cast<std::ptrdiff_t>(b0 + 24), v3.begin() + static_cast<std::ptrdiff_t>(b0 + block));
      }
      seal_blob(old);
      const auto from_old = load_state(layer, old);
      for (Index h = 0; h < 2; ++h) CHECK(detail::same_state(from_old.sequence(0).head(h), loaded.sequence(0).head(h)));
    }
  }
  SECTION("random features, double: the log-scale and the draw are kept") {
    using Phi = PositiveRandomFeatures<double>;
    using Layer = MultiHeadAttention<LinearAttention<Phi, double>>;
    const Layer layer({2, 1, 4, 3}, LinearAttention<Phi, double>(Phi(4, 8, 7)));
    const auto loaded = load_state(layer, read_file("v3_favor_double.bin"));
    REQUIRE(loaded.size() == 2);
    REQUIRE(loaded.heads() == 2);  // one state per query head for a log-scaled map
    CHECK(std::isfinite(loaded.sequence(1).head(1).log_scale()));
    const Layer other_draw({2, 1, 4, 3}, LinearAttention<Phi, double>(Phi(4, 8, 8)));
    CHECK(reason_of([&] { static_cast<void>(load_state(other_draw, read_file("v3_favor_double.bin"))); }) ==
          R::feature_map_mismatch);
  }
}

TEST_CASE("every corrupted, truncated or mismatched blob is rejected", "[serialize]") {
  using Layer = MultiHeadAttention<LinearAttention<EluPlusOne>>;
  const Layer layer({2, 1, 3, 2});
  auto state = layer.make_state(2);
  {
    std::vector<float> x(2 * 2 * 3, 0.25f), o(2 * 2 * 2);
    layer.step_into(state, TensorView<const float>::batch_first(x.data(), 2, 1, 2, 3),
                    TensorView<const float>::batch_first(x.data(), 2, 1, 1, 3),
                    TensorView<const float>::batch_first(x.data(), 2, 1, 1, 2),
                    TensorView<float>::batch_first(o.data(), 2, 1, 2, 2));
  }
  const auto blob = save_state(layer, state);

  SECTION("every single flipped byte") {
    for (std::size_t i = 0; i < blob.size(); ++i) {
      auto bad = blob;
      bad[i] ^= std::byte{0x5a};
      auto target = layer.make_state();
      INFO("byte " << i);
      const R r = reason_of([&] { static_cast<void>(restore_sequences(layer, target, bad)); });
      CHECK(target.size() == 0);  // nothing restored from a rejected blob
      if (i >= 24) CHECK(r == R::checksum_mismatch);
    }
  }
  SECTION("every truncation") {
    for (std::size_t n = 0; n < blob.size(); ++n) {
      INFO("first " << n << " bytes");
      CHECK(reason_of([&] { static_cast<void>(load_state(layer, std::span(blob).first(n))); }) == R::truncated);
    }
  }
  SECTION("trailing bytes, a wrong magic, a future version") {
    auto longer = blob;
    longer.push_back(std::byte{0});
    CHECK(reason_of([&] { static_cast<void>(load_state(layer, longer)); }) == R::size_mismatch);
    auto bad = blob;
    bad[0] = std::byte{'X'};
    CHECK(reason_of([&] { static_cast<void>(load_state(layer, bad)); }) == R::bad_magic);
    bad = blob;
    bad[8] = std::byte{5};
    CHECK(reason_of([&] { static_cast<void>(load_state(layer, bad)); }) == R::unsupported_version);
  }
  SECTION("another shape, scalar type, feature map or rule") {
    CHECK(reason_of([&] { static_cast<void>(load_state(Layer({2, 1, 3, 3}), blob)); }) == R::shape_mismatch);
    CHECK(reason_of([&] { static_cast<void>(load_state(Layer({2, 2, 3, 2}), blob)); }) == R::shape_mismatch);
    try {
      static_cast<void>(load_state(Layer({2, 1, 3, 3}), blob));
    } catch (const StateFormatError& e) {
      CHECK(std::string(e.what()).find("dv=2, this state has") != std::string::npos);
    }
    CHECK(reason_of([&] { static_cast<void>(load_state(MultiHeadAttention<LinearAttention<EluPlusOne, double>>({2, 1, 3, 2}), blob)); }) ==
          R::scalar_type_mismatch);
    CHECK(reason_of([&] { static_cast<void>(load_state(MultiHeadAttention<LinearAttention<Identity>>({2, 1, 3, 2}), blob)); }) ==
          R::feature_map_mismatch);
    const MultiHeadAttention<RuleAttention<EluPlusOne, Gated>> gated({2, 1, 3, 2});
    CHECK(reason_of([&] { static_cast<void>(load_state(gated, blob)); }) == R::rule_mismatch);
  }
  SECTION("a state that is not the layer's is a shape or identity error") {
    const Layer wider({2, 1, 3, 3});
    auto foreign = wider.make_state();
    CHECK_THROWS_AS(restore_sequences(layer, foreign, blob), ShapeError);
    CHECK_THROWS_AS(save_state(layer, foreign), ShapeError);
    const MultiHeadAttention<LinearAttention<Identity>> ident({2, 1, 3, 2});
    auto other = ident.make_state(1);
    CHECK_THROWS_AS(save_state(layer, other), StateMismatchError);
    // A head replaced through sequence().head() by one of another shape is refused, not read
    // out of bounds.
    auto mixed = layer.make_state(1);
    mixed.sequence(0).head(0) = wider.attention().make_state(3, 3);
    CHECK_THROWS_AS(save_state(layer, mixed), ShapeError);
  }
}

TEST_CASE("restored values are validated: what no state can hold is refused", "[serialize]") {
  // Blobs edited and resealed (a valid checksum over invalid contents): the checksum protects
  // against damage, the value checks against everything else.
  const LinearAttention<EluPlusOne> attn;
  auto state = attn.make_state(2, 2);
  static_cast<void>(run_steps(attn, state, 0, 3, 91));
  const auto blob = save_state(state);
  const Layout4 at(std::string("elu_plus_one").size(), std::string("additive").size(), false);
  const std::size_t s_at = at.head + 24 + 4;
  auto target = attn.make_state(2, 2);
  const auto refused = [&](const std::vector<std::byte>& bad) {
    return reason_of([&] { restore_state(target, bad); });
  };
  // A token count at which the next step would overflow.
  CHECK(refused(reseal(blob, [&](auto& b) { put_u64(b, at.head, std::uint64_t(std::numeric_limits<std::int64_t>::max())); })) == R::bad_value);
  CHECK(refused(reseal(blob, [&](auto& b) { put_u64(b, at.head, std::uint64_t(detail::kMaxTokens) + 1); })) == R::bad_value);
  // NaN and Inf in S and z.
  CHECK(refused(reseal(blob, [&](auto& b) { put_f32(b, s_at, std::numeric_limits<float>::quiet_NaN()); })) == R::bad_value);
  CHECK(refused(reseal(blob, [&](auto& b) { put_f32(b, s_at + 4 * 4, std::numeric_limits<float>::infinity()); })) == R::bad_value);
  // A log-scale other than 0 for an ordinary map, or NaN.
  CHECK(refused(reseal(blob, [&](auto& b) { put_f32(b, at.head + 24, 3.0f); })) == R::bad_value);
  CHECK(refused(reseal(blob, [&](auto& b) { put_f32(b, at.head + 24, std::numeric_limits<float>::quiet_NaN()); })) == R::bad_value);
  CHECK(refused(reseal(blob, [&](auto& b) { put_f32(b, at.head + 24, -0.0f); })) == R::bad_value);
  // More pending tokens than the decode block (0 here) holds; an absurd decode block.
  CHECK(refused(reseal(blob, [&](auto& b) { put_u64(b, at.head + 16, 1); })) == R::bad_value);
  CHECK(refused(reseal(blob, [&](auto& b) { put_u64(b, at.head + 8, std::uint64_t(1) << 40); })) == R::bad_value);
  // The untouched blob still restores, and the target is unchanged by every refusal above.
  CHECK(target.tokens() == 0);
  restore_state(target, blob);
  CHECK(target.tokens() == 3);
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
  [[nodiscard]] std::uint64_t fingerprint() const noexcept { return std::bit_cast<std::uint64_t>(scale); }
};
}  // namespace

TEST_CASE("a feature map's fingerprint is part of its identity", "[serialize]") {
  const LinearAttention<ScaledElu> one(ScaledElu{1.0}), two(ScaledElu{2.0});
  const auto blob = save_state(one.make_state(2, 2));
  auto same = one.make_state(2, 2);
  restore_state(same, blob);
  auto other = two.make_state(2, 2);
  CHECK(reason_of([&] { restore_state(other, blob); }) == R::feature_map_mismatch);
}

TEMPLATE_TEST_CASE("log-scaled random-feature states round-trip, and the draw is checked",
                   "[serialize]", float, double) {
  // Inputs of size ~20 make the key log-scales large, so the state's M is far from 0 and a
  // restore that dropped it would change every later output.
  using Phi = PositiveRandomFeatures<TestType>;
  const LinearAttention<Phi, TestType> attn(Phi(3, 16, 5));
  auto state = attn.make_state(3, 2);
  const auto q = RowMatrix<TestType>(20 * linattn_test::random_matrix<TestType>(8, 3, 101));
  const auto k = RowMatrix<TestType>(20 * linattn_test::random_matrix<TestType>(8, 3, 102));
  const auto v = linattn_test::random_matrix<TestType>(8, 2, 103);
  for (Index t = 0; t < 3; ++t) static_cast<void>(attn.step(state, q.row(t), k.row(t), v.row(t)));
  REQUIRE(std::abs(state.log_scale()) > 10);
  const auto blob = save_state(state);
  const LinearAttention<Phi, TestType> fresh(Phi(3, 16, 5));  // same draw, another object
  auto restored = fresh.make_state(3, 2);
  restore_state(restored, blob);
  CHECK(restored.log_scale() == state.log_scale());
  for (Index t = 3; t < 8; ++t)
    REQUIRE(attn.step(state, q.row(t), k.row(t), v.row(t)) == fresh.step(restored, q.row(t), k.row(t), v.row(t)));
  const LinearAttention<Phi, TestType> other_draw(Phi(3, 16, 6));
  auto other = other_draw.make_state(3, 2);
  CHECK(reason_of([&] { restore_state(other, blob); }) == R::feature_map_mismatch);
  // An empty log-scaled state (M = -infinity) round-trips.
  auto empty = attn.make_state(3, 2);
  auto empty_restored = attn.make_state(3, 2);
  restore_state(empty_restored, save_state(empty));
  CHECK(empty_restored.log_scale() == -std::numeric_limits<TestType>::infinity());
}

}  // namespace serialize_test
