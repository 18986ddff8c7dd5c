"""linattn.torch against plain PyTorch loops written from the formulas (docs/pytorch.md).

Every op runs in float64 (to rounding), float32 and bfloat16 (within bounds derived below),
batch-first and head-first, contiguous and strided, packed with cu_seqlens, with initial and
final states; linear_attn's gradients go through torch.autograd.gradcheck in float64 (every
op's gradients: test_autograd.py); every bad input raises a Python exception with a message.
"""

import pytest
import torch

import linattn.torch as lt
from ops_support import CHUNK, DELTA, OPS, RULES, call, random_inputs

torch.manual_seed(0)
torch.set_num_threads(2)

B, T, H, K, V = 2, 37, 3, 8, 5  # K != V; T not a multiple of the chunk size
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24}

GATED = {"simple_gla", "gla", "gated_delta_rule", "kda"}


# ---- the reference: one loop over tokens per sequence and head, float64 ---------------------

def reference(rule, q, k, v, g=None, beta=None, scale=None, h0=None, z0=None, normalize=False,
              l2norm=False, cu_seqlens=None):
    """Logical [B, T, H, D] float64 inputs -> (o, S_final [N, H, K, V], z_final [N, 1, H, K],
    bound [B, T, H]) where bound[t] bounds |o_t| by a sum of absolute values (see tolerance)."""
    q, k, v = q.double(), k.double(), v.double()
    Bq, Tq, Hq, Kq = q.shape
    Vq = v.shape[3]
    scale = Kq ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        seqs = [(b, 0, Tq) for b in range(Bq)]
    else:
        c = cu_seqlens.tolist()
        seqs = [(0, c[n], c[n + 1] - c[n]) for n in range(len(c) - 1)]
    o = torch.zeros(Bq, Tq, Hq, Vq, dtype=torch.float64)
    bound = torch.zeros(Bq, Tq, Hq, dtype=torch.float64)
    Sf = torch.zeros(len(seqs), Hq, Kq, Vq, dtype=torch.float64)
    zf = torch.zeros(len(seqs), 1, Hq, Kq, dtype=torch.float64)
    for n, (b, first, length) in enumerate(seqs):
        for h in range(Hq):
            S = h0[n, h].double().clone() if h0 is not None else torch.zeros(Kq, Vq, dtype=torch.float64)
            z = z0[n, 0, h].double().clone() if z0 is not None else torch.zeros(Kq, dtype=torch.float64)
            A = S.abs()          # sum of |terms| of S (positive-weight rules)
            growth = S.norm()    # ||S_0|| + sum |v_j| (delta rules with unit keys)
            for t in range(first, first + length):
                qt, kt, vt = q[b, t, h], k[b, t, h], v[b, t, h]
                if l2norm:
                    qt = qt / torch.sqrt(qt @ qt + 1e-6)
                    kt = kt / torch.sqrt(kt @ kt + 1e-6)
                if rule == "linear_attn":
                    S = S + torch.outer(kt, vt)
                    z = z + kt
                    A = A + torch.outer(kt.abs(), vt.abs())
                elif rule == "simple_gla":
                    a = torch.exp(g[b, t, h].double())
                    S = a * S + torch.outer(kt, vt)
                    A = a * A + torch.outer(kt.abs(), vt.abs())
                elif rule == "gla":
                    a = torch.exp(g[b, t, h].double())
                    S = a[:, None] * S + torch.outer(kt, vt)
                    A = a[:, None] * A + torch.outer(kt.abs(), vt.abs())
                else:
                    if rule == "gated_delta_rule":
                        S = torch.exp(g[b, t, h].double()) * S
                    elif rule == "kda":
                        S = torch.exp(g[b, t, h].double())[:, None] * S
                    bt = beta[b, t, h].double()
                    S = S + bt * torch.outer(kt, vt - S.t() @ kt)
                    growth = growth + vt.norm()
                if normalize:
                    o[b, t, h] = (S.t() @ qt) / (qt @ z + 1e-10 / scale)
                else:
                    o[b, t, h] = scale * (S.t() @ qt)
                if rule in DELTA:
                    bound[b, t, h] = abs(scale) * qt.norm() * growth
                else:
                    bound[b, t, h] = abs(scale) * (qt.abs() @ A).max()
            Sf[n, h] = S
            zf[n, 0, h] = z
    return o, Sf, zf, bound


def tolerance(dtype, length, bound):
    """Rounding bound for outputs computed in `dtype` (float32 for bf16 inputs, whose values
    are exact in float64 so the reference sees the same inputs). Each output is a sum of at
    most length + K products per token (the state update and the read), each of them rounded
    with relative error u; linattn's chunked form adds and multiplies the same terms in another
    order (sums within a chunk, then across chunks), so |error| <= c (length + K) u |terms|
    with a small c; we take c = 8 (two passes, update and read, and a factor 4 for the
    chunk-local products). |terms| is `bound`: the sum of absolute values for the positive
    rules, |q| (|S_0| + sum |v_j|) for the delta rules with unit keys (I - beta k k^T is then a
    contraction). bf16 outputs are also rounded once to 8 bits: 2^-8 |o| <= 2^-8 bound."""
    u = UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    tol = 8 * (length + K) * u * bound
    if dtype in (torch.bfloat16, torch.float16):
        tol = tol + (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11) * bound
    return tol


# ---- inputs ---------------------------------------------------------------------------------

def make_inputs(rule, dtype=torch.float64, Bn=B, Tn=T, l2norm=False, positive=False):
    """q, k, v, g, beta of ops_support.random_inputs, a fixed seed per rule."""
    seed = 100 + RULES.index(rule)
    return random_inputs(rule, Bn, Tn, H, K, V, seed, dtype, l2norm, positive)[:5]


def assert_close_to(o, ref, bound, dtype, length, what):
    tol = tolerance(dtype, length, bound)[..., None]
    err = (o.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1, f"{what}: error {err.max().item():.3g} exceeds the bound by {worst:.3g}x"


# ---- values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rule,kind", OPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_op_matches_reference_with_states(rule, kind, dtype):
    q, k, v, g, beta = make_inputs(rule, dtype)
    h0 = (torch.randn(B, H, K, V, dtype=torch.float64) * 0.5).to(dtype)
    o, ht = call(rule, kind, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert ht.dtype == compute and ht.shape == (B, H, K, V)
    ref, S, _, bound = reference(rule, q, k, v, g, beta, h0=h0)
    assert_close_to(o, ref, bound, dtype, T, f"{rule} {kind} {dtype}")
    # The final state's entries are sums like the outputs' without the read: same bound shape.
    s_tol = tolerance(dtype, T, S.abs().amax(dim=(2, 3), keepdim=True) + bound.max())
    assert ((ht.double() - S).abs() <= s_tol).all(), f"{rule} {kind}: final state"


@pytest.mark.parametrize("rule,kind", OPS)
def test_scale_and_default_scale(rule, kind):
    q, k, v, g, beta = make_inputs(rule)
    o_default, _ = call(rule, kind, q, k, v, g, beta)
    o_scaled, _ = call(rule, kind, q, k, v, g, beta, scale=0.3)
    ref_default = reference(rule, q, k, v, g, beta)[0]
    ref_scaled, _, _, bound = reference(rule, q, k, v, g, beta, scale=0.3)
    assert_close_to(o_default, ref_default, bound / 0.3 * K ** -0.5, torch.float64, T, "default")
    assert_close_to(o_scaled, ref_scaled, bound, torch.float64, T, "scale=0.3")


@pytest.mark.parametrize("rule", sorted(DELTA))
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_betas_up_to_two_give_negative_eigenvalues(rule, kind, dtype):
    # fla's allow_neg_eigval layers pass beta = 2 sigmoid(x): with a unit key I - beta k k^T
    # has eigenvalues 1 and 1 - beta in [-1, 1], so the state is never amplified and the
    # reference's bound holds with each step's terms (beta k k^T S, beta k v^T) up to twice as
    # large: twice the bound. One beta of exactly 2 (a reflection) per sequence.
    q, k, v, g, beta = make_inputs(rule, dtype)
    beta = 2 * beta
    beta[:, T // 2] = 2.0
    h0 = (torch.randn(B, H, K, V, dtype=torch.float64) * 0.5).to(dtype)
    o, ht = call(rule, kind, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref, S, _, bound = reference(rule, q, k, v, g, beta, h0=h0)
    assert_close_to(o, ref, 2 * bound, dtype, T, f"{rule} {kind} {dtype}, beta in [0, 2]")
    s_tol = tolerance(dtype, T, 2 * (S.abs().amax(dim=(2, 3), keepdim=True) + bound.max()))
    assert ((ht.double() - S).abs() <= s_tol).all(), f"{rule} {kind}: final state"
    # Above 2 the state can grow: refused, naming the token.
    beta[1, 5, 2] = 2.0 + 1e-6
    with pytest.raises(ValueError, match="beta must lie in \\[0, 2\\], got .* at token 5"):
        call(rule, kind, q, k, v, g, beta)


@pytest.mark.parametrize("rule", list(CHUNK))
def test_chunk_and_recurrent_agree(rule):
    q, k, v, g, beta = make_inputs(rule)
    oc, hc = call(rule, "chunk", q, k, v, g, beta, output_final_state=True)
    orr, hr = call(rule, "recurrent", q, k, v, g, beta, output_final_state=True)
    bound = reference(rule, q, k, v, g, beta)[3]
    assert_close_to(oc, orr.double(), 2 * bound, torch.float64, T, "chunk vs recurrent")


@pytest.mark.parametrize("rule,kind", OPS)
def test_head_first_and_strided_inputs_give_the_same_bits(rule, kind):
    q, k, v, g, beta = make_inputs(rule, torch.float32)
    o, ht = call(rule, kind, q, k, v, g, beta, output_final_state=True)
    # head-first: [B, H, T, D] tensors (and [B, H, T] gates), output in that layout too
    hf = lambda x: None if x is None else x.transpose(1, 2).contiguous()  # noqa: E731
    o_hf, ht_hf = call(rule, kind, hf(q), hf(k), hf(v), hf(g), hf(beta), output_final_state=True,
                       head_first=True)
    assert o_hf.shape == (B, H, T, V)
    assert torch.equal(o_hf.transpose(1, 2), o) and torch.equal(ht_hf, ht)
    # q, k, v as slices of one fused projection (row stride 2K + V, read in place)
    qkv = torch.cat([q, k, v], dim=-1)
    qs, ks, vs = qkv[..., :K], qkv[..., K:2 * K], qkv[..., 2 * K:]
    assert not qs.is_contiguous()
    o_s, _ = call(rule, kind, qs, ks, vs, g, beta)
    assert torch.equal(o_s, o)
    # a non-unit feature stride (converted per block) gives the same bits too
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qt.stride(-1) != 1
    o_t, _ = call(rule, kind, qt, k, v, g, beta)
    assert torch.equal(o_t, o)


@pytest.mark.parametrize("rule,kind", OPS)
def test_cu_seqlens_packs_independent_sequences(rule, kind):
    lengths = [5, 0, 17, 1, 14]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.long)
    total, N = int(cu[-1]), len(lengths)
    q, k, v, g, beta = make_inputs(rule, Bn=1, Tn=total)
    h0 = torch.randn(N, H, K, V, dtype=torch.float64) * 0.5
    o, ht = call(rule, kind, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                 cu_seqlens=cu)
    ref, S, _, bound = reference(rule, q, k, v, g, beta, h0=h0, cu_seqlens=cu)
    assert_close_to(o, ref, bound, torch.float64, max(lengths), f"{rule} {kind} packed")
    assert torch.allclose(ht, S, rtol=0, atol=1e-12 * (1 + S.abs().max().item()))
    assert torch.equal(ht[1], h0[1])  # the empty sequence keeps its initial state
    # int32 offsets give the same result
    o32, _ = call(rule, kind, q, k, v, g, beta, initial_state=h0, cu_seqlens=cu.int())
    assert torch.equal(o32, o)


@pytest.mark.parametrize("rule,kind", OPS)
def test_carried_state_continues_a_sequence(rule, kind):
    q, k, v, g, beta = make_inputs(rule)
    cut = 20
    part = lambda x, s: None if x is None else x[:, s]  # noqa: E731
    first, second = slice(0, cut), slice(cut, T)
    o_all, h_all = call(rule, kind, q, k, v, g, beta, output_final_state=True)
    o1, h1 = call(rule, kind, *(part(x, first) for x in (q, k, v, g, beta)), output_final_state=True)
    o2, h2 = call(rule, kind, *(part(x, second) for x in (q, k, v, g, beta)), initial_state=h1,
                  output_final_state=True)
    bound = reference(rule, q, k, v, g, beta)[3]
    assert_close_to(torch.cat([o1, o2], dim=1), o_all.double(), bound, torch.float64, T, "carry")
    assert torch.allclose(h2, h_all, rtol=0, atol=1e-12 * (1 + h_all.abs().max().item()))


@pytest.mark.parametrize("rule,kind", OPS)
def test_initial_state_in_any_strides_and_dtype_gives_the_same_bits(rule, kind):
    # The state is read in place when its rows are contiguous, through general strides when
    # they are not, and converted when its dtype is not the compute type: the three readers
    # must give the bits of a contiguous state of the compute type.
    q, k, v, g, beta = (None if x is None else x.float() for x in make_inputs(rule))
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(5))
    o, ht = call(rule, kind, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    wide = torch.zeros(B, H, K, V + 3)
    wide[..., :V] = h0
    column_major = h0.transpose(2, 3).contiguous().transpose(2, 3)
    for variant in (wide[..., :V], column_major):
        o2, ht2 = call(rule, kind, q, k, v, g, beta, initial_state=variant, output_final_state=True)
        assert torch.equal(o2, o) and torch.equal(ht2, ht)
    for variant in (h0.double(), h0.bfloat16(), column_major.double()):
        # converted to float32 (rounded to nearest, as torch's .float()): the bits of that copy
        o2, ht2 = call(rule, kind, q, k, v, g, beta, initial_state=variant, output_final_state=True)
        o3, ht3 = call(rule, kind, q, k, v, g, beta, initial_state=variant.float().contiguous(),
                       output_final_state=True)
        assert torch.equal(o2, o3) and torch.equal(ht2, ht3)


@pytest.mark.parametrize("rule,kind", OPS)
def test_non_finite_initial_state_raises(rule, kind):
    # Every position is checked (NaN and Inf at the first and last entry of the last head), and a
    # float64 state beyond float32's range is refused for float32 inputs instead of becoming Inf.
    q, k, v, g, beta = make_inputs(rule)
    for value in (float("nan"), float("inf"), -float("inf")):
        for index in ((0, 0, 0, 0), (B - 1, H - 1, K - 1, V - 1)):
            h0 = torch.zeros(B, H, K, V, dtype=torch.float64)
            h0[index] = value
            bad(call, rule, kind, q, k, v, g, beta, initial_state=h0,
                match=f"sequence {index[0]}, head {index[1]} must be finite")
    h0 = torch.zeros(B, H, K, V, dtype=torch.float64)
    h0[B - 1, H - 1, K - 1, V - 1] = 1e39
    f32 = (None if x is None else x.float() for x in (q, k, v, g, beta))
    bad(call, rule, kind, *f32, initial_state=h0, match=f"head {H - 1} must be finite in Float")


@pytest.mark.parametrize("rule,kind", OPS)
def test_thread_count_changes_no_bit(rule, kind):
    # Each (sequence, head) is one task with its own state: the split between threads cannot
    # change the arithmetic.
    q, k, v, g, beta = make_inputs(rule, torch.float32)
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        results.append(call(rule, kind, q, k, v, g, beta, output_final_state=True))
    torch.set_num_threads(2)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("rule,kind", OPS)
def test_empty_sequences(rule, kind):
    q, k, v, g, beta = make_inputs(rule, Tn=0)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o, ht = call(rule, kind, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (B, 0, H, V) and torch.equal(ht, h0)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_normalized_linear_attn_with_z_states(kind):
    q, k, v, _, _ = make_inputs("linear_attn", positive=True)
    fn = lt.chunk_linear_attn if kind == "chunk" else lt.fused_recurrent_linear_attn
    h0 = torch.rand(B, H, K, V, dtype=torch.float64)
    z0 = torch.rand(B, 1, H, K, dtype=torch.float64)
    o, (ht, zt) = fn(q, k, v, initial_state=(h0, z0), output_final_state=True, normalize=True)
    ref, S, z, _ = reference("linear_attn", q, k, v, h0=h0, z0=z0, normalize=True)
    # Numerator and denominator are sums of positive terms, each within 8 (T + K) u relative
    # (see tolerance); their quotient, a weighted average of v's rows, within twice that of
    # max |v|.
    assert (o - ref).abs().max() <= 16 * (T + K) * 2.0 ** -53 * v.abs().max()
    assert torch.allclose(ht, S, rtol=1e-13) and torch.allclose(zt, z, rtol=1e-13)
    # chunk_linear_attn normalizes by default, fused_recurrent_linear_attn does not (as fla)
    assert torch.allclose(lt.chunk_linear_attn(q, k, v)[0], reference("linear_attn", q, k, v, normalize=True)[0], rtol=1e-12)
    assert torch.allclose(lt.fused_recurrent_linear_attn(q, k, v)[0], reference("linear_attn", q, k, v)[0], rtol=1e-12)


@pytest.mark.parametrize("rule", sorted(DELTA))
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_qk_l2norm_in_kernel(rule, kind):
    q, k, v, g, beta = make_inputs(rule, l2norm=True)
    k = k * 3  # not unit: the op normalizes
    o, _ = call(rule, kind, q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    ref, _, _, bound = reference(rule, q, k, v, g, beta, l2norm=True)
    assert_close_to(o, ref, bound, torch.float64, T, f"{rule} l2norm")


def test_simple_gla_g_gamma_and_no_gate():
    q, k, v, g, _ = make_inputs("simple_gla")
    gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64)))
    o, _ = lt.chunk_simple_gla(q, k, v, g_gamma=gamma)
    ref, _, _, bound = reference("simple_gla", q, k, v, g=gamma.view(1, 1, H).expand(B, T, H))
    assert_close_to(o, ref, bound, torch.float64, T, "g_gamma")
    o0, _ = lt.chunk_simple_gla(q, k, v)
    ref0, _, _, bound0 = reference("linear_attn", q, k, v)
    assert_close_to(o0, ref0, bound0, torch.float64, T, "no gate")


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_retention_decays_head_h_by_one_minus_two_to_the_minus_five_minus_h(kind, dtype):
    # RetNet's decays written out here, gamma_h = 1 - 2^(-5 - h), not taken from the op.
    q, k, v, _, _ = make_inputs("simple_gla", dtype)
    h0 = (torch.randn(B, H, K, V, dtype=torch.float64) * 0.5).to(dtype)
    gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=torch.float64)
    fn = lt.chunk_retention if kind == "chunk" else lt.fused_recurrent_retention
    o, ht = fn(q, k, v, initial_state=h0, output_final_state=True)
    ref, S, _, bound = reference("simple_gla", q, k, v, g=torch.log(gamma).view(1, 1, H).expand(B, T, H),
                                 h0=h0)
    # The op rounds log(gamma) in its compute type (relative error u, |log gamma| < 1/31), so a
    # product of up to T decays is off by at most T u relative: T u |terms| more than the
    # reference comparison's own bound 8 (T + K) u |terms|, i.e. at most 1/8 more.
    widen = 9 / 8
    assert_close_to(o, ref, widen * bound, dtype, T, f"{kind} retention {dtype}")
    s_tol = tolerance(dtype, T, S.abs().amax(dim=(2, 3), keepdim=True) + bound.max())
    assert ((ht.double() - S).abs() <= widen * s_tol).all(), f"{kind} retention: final state"
    # head-first inputs give the same bits; grouped value heads are refused (one decay per head)
    hf = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    o_hf, _ = fn(hf(q), hf(k), hf(v), initial_state=h0, head_first=True)
    assert torch.equal(o_hf.transpose(1, 2), o)
    with pytest.raises(ValueError, match="grouped value heads"):
        fn(q, k, torch.cat([v, v], dim=2))


def test_retention_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 9, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    h0 = torch.randn(1, 2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    for fn in (lt.chunk_retention, lt.fused_recurrent_retention):
        assert torch.autograd.gradcheck(
            lambda *x: fn(*x[:3], initial_state=x[3], output_final_state=True), (q, k, v, h0))


def test_ones_beta_default_of_fused_recurrent_delta_rule():
    q, k, v, _, _ = make_inputs("delta_rule")
    o, _ = lt.fused_recurrent_delta_rule(q, k, v)
    ref, _, _, bound = reference("delta_rule", q, k, v, beta=torch.ones(B, T, H, dtype=torch.float64))
    assert_close_to(o, ref, bound, torch.float64, T, "beta=None")


# ---- autograd ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [lt.chunk_linear_attn, lt.fused_recurrent_linear_attn])
@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attn_gradcheck(fn, normalize):
    gen = torch.Generator().manual_seed(3)
    Bs, Ts, Hs, Ks, Vs = 2, 6, 2, 3, 2
    pos = lambda *s: (torch.rand(*s, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()  # noqa: E731
    q, k, v = pos(Bs, Ts, Hs, Ks), pos(Bs, Ts, Hs, Ks), pos(Bs, Ts, Hs, Vs)
    h0 = pos(Bs, Hs, Ks, Vs)
    if normalize:
        z0 = pos(Bs, 1, Hs, Ks)
        def f(q, k, v, h0, z0):
            o, (ht, zt) = fn(q, k, v, scale=0.7, initial_state=(h0, z0), output_final_state=True,
                             normalize=True)
            return o, ht, zt
        assert torch.autograd.gradcheck(f, (q, k, v, h0, z0))
    else:
        def f(q, k, v, h0):
            o, ht = fn(q, k, v, initial_state=h0, output_final_state=True, normalize=False)
            return o, ht
        assert torch.autograd.gradcheck(f, (q, k, v, h0))


def test_linear_attn_gradcheck_packed_head_first():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 3, 3, 7])
    x = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = x(1, 2, 7, 3), x(1, 2, 7, 3), x(1, 2, 7, 2)
    h0 = x(3, 2, 3, 2)
    def f(q, k, v, h0):
        return lt.chunk_linear_attn(q, k, v, initial_state=h0, output_final_state=True,
                                    normalize=False, cu_seqlens=cu, head_first=True)
    assert torch.autograd.gradcheck(f, (q, k, v, h0))


def test_linear_attn_float32_gradients_match_float64():
    q, k, v, _, _ = make_inputs("linear_attn")
    weights = torch.linspace(-1, 1, V, dtype=torch.float64)

    def grads(xs, w, dtype):
        xs = [x.detach().to(dtype).clone().requires_grad_() for x in xs]
        o, _ = lt.chunk_linear_attn(*xs, normalize=False)
        (o * w.to(dtype)).sum().backward()
        return [x.grad for x in xs]

    g64 = grads((q, k, v), weights, torch.float64)
    g32 = grads((q, k, v), weights, torch.float32)
    # Every gradient entry is a polynomial in q, k, v, dy whose terms carry coefficients +1:
    # evaluated at |q|, |k|, |v| and |dy| it is the sum of the terms' absolute values, and a
    # float32 sum of at most T (K + V) such products errs by <= 8 (T + K + V) u times that.
    magnitude = grads((q.abs(), k.abs(), v.abs()), weights.abs(), torch.float64)
    for a, b, m in zip(g64, g32, magnitude):
        assert b.dtype == torch.float32
        assert ((b.double() - a).abs() <= 8 * (T + K + V) * 2.0 ** -24 * m).all()


# The other rules' gradients: tests/torch/test_autograd.py.


@pytest.mark.parametrize("rule", ["linear_attn", "simple_gla", "gla"])
@pytest.mark.parametrize("packed", [False, True])
def test_reverse_reads_every_sequence_backwards(rule, packed):
    # fla's reverse=True (fused_recurrent_linear_attn / simple_gla / gla): the recursion runs
    # from each sequence's last token to its first. The reference runs the same loop over the
    # tokens of each sequence taken in reverse order.
    lengths = [5, 0, 17, 1, 14] if packed else [T]
    Bn = 1 if packed else B
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0))) if packed else None
    q, k, v, g, beta = make_inputs(rule, Bn=Bn, Tn=sum(lengths))
    h0 = torch.randn(len(lengths) if packed else Bn, H, K, V, dtype=torch.float64) * 0.5
    starts = [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    backwards = lambda x: None if x is None else torch.cat(  # noqa: E731
        [x[:, a:e].flip(1) for a, e in zip(starts[:-1], starts[1:])], dim=1)
    ref, S, _, bound = reference(rule, *(backwards(x) for x in (q, k, v, g, beta)), h0=h0,
                                 cu_seqlens=cu)
    o, ht = call(rule, "recurrent", q, k, v, g, beta, initial_state=h0, output_final_state=True,
                 cu_seqlens=cu, reverse=True)
    assert_close_to(o, backwards(ref), backwards(bound[..., None])[..., 0], torch.float64,
                    max(lengths), f"{rule} reverse")
    assert torch.allclose(ht, S, rtol=0, atol=1e-12 * (1 + S.abs().max().item()))
    # head-first gives the same bits
    hf = lambda x: None if x is None else x.transpose(1, 2).contiguous()  # noqa: E731
    o_hf, _ = call(rule, "recurrent", hf(q), hf(k), hf(v), hf(g), hf(beta), initial_state=h0,
                   cu_seqlens=cu, reverse=True, head_first=True)
    assert torch.equal(o_hf.transpose(1, 2), o)


# ---- bad input ----------------------------------------------------------------------------------

def bad(fn, *args, match, **kw):
    with pytest.raises((ValueError, TypeError, RuntimeError, NotImplementedError), match=match):
        fn(*args, **kw)


def test_bad_inputs_raise_with_a_message():
    q, k, v, g, beta = make_inputs("gated_delta_rule")
    la = lambda *a, **kw: lt.chunk_linear_attn(*a, normalize=False, **kw)  # noqa: E731
    bad(la, q.to("meta"), k, v, match="CPU only")
    bad(la, q[0], k[0], v[0], match="4-D")
    bad(la, q, k[:, :, :2], v, match="k has shape")
    bad(la, q, k, v[:, :-1], match="does not match q")
    bad(la, q, k, v.float(), match="one dtype")
    bad(la, q.long(), k.long(), v.long(), match="dtype")
    bad(la, q.to_sparse(), k, v, match="dense")
    bad(la, q, k, v, initial_state=torch.zeros(B, H, V, K, dtype=torch.float64), match="initial_state")
    bad(la, q, k, v, scale=float("nan"), match="scale must be finite")
    bad(lt.chunk_linear_attn, q, k, v, scale=-1.0, match="scale > 0")
    bad(la, "q", k, v, match="must be a torch.Tensor")
    q1, k1, v1 = q[:1], k[:1], v[:1]
    bad(la, q1, k1, v1, cu_seqlens=torch.tensor([0, 20, 10, T]), match="must not decrease")
    bad(la, q1, k1, v1, cu_seqlens=torch.tensor([0, 10]), match="end at T")
    bad(la, q1, k1, v1, cu_seqlens=torch.tensor([1, T]), match="start at 0")
    bad(la, q1, k1, v1, cu_seqlens=torch.tensor([0.0, T]), match="int32/int64")
    bad(la, q, k, v, cu_seqlens=torch.tensor([0, T]), match="batch size must be 1")
    bad(la, q1, k1, v1, cu_seqlens=torch.tensor([0, 5, T]), initial_state=torch.zeros(1, H, K, V),
        match="N sequences")
    bad(lt.chunk_gated_delta_rule, q, k, v, g[..., :1], beta, match="g")
    bad(lt.chunk_gated_delta_rule, q, k, v, g, beta[:, :5], match="beta")
    bad(lt.chunk_gla, q, k, v, g, match=r"\[B, T, HV, K\]")
    bad(lt.chunk_kda, q, k, v, g, beta, match=r"\[B, T, HV, K\]")  # one gate per token
    g4 = g[..., None].expand(B, T, H, K)
    bad(lt.chunk_kda, q, k, v, g4.abs() + 0.1, beta, match="log_alpha")  # a gate above 1
    bad(lt.chunk_kda, q, k, v, g4, beta + 2.5, match="beta")
    bad(lt.chunk_kda, q, k, v, g4, beta, use_gate_in_kernel=True, match="use_gate_in_kernel")
    bad(lt.chunk_kda, q, k, v, g4, beta, A_log=torch.zeros(H), match="A_log")
    bad(lt.fused_recurrent_kda, q, k, v, g4, beta, use_beta_sigmoid_in_kernel=True,
        match="use_beta_sigmoid_in_kernel")
    bad(lt.chunk_kda, q, k, v, g4, beta, no_such_option=1, match="no_such_option")
    bad(lt.chunk_simple_gla, q, k, v, g.abs() + 0.1, match="log")  # a gate above 1
    bad(lt.chunk_delta_rule, q, k, v, beta + 2.5, match="beta")
    bad(lt.chunk_simple_gla, q, k, v, g_gamma=torch.zeros(H + 1), match="g_gamma")
    bad(lt.fused_recurrent_gla, q, k, v, gk=None, gv=v, match="gv")
    bad(lt.fused_recurrent_linear_attn, q1, k1, v1, reverse=True, cu_seqlens=torch.tensor([0, 5]),
        match="end at T")
    bad(lt.fused_recurrent_simple_gla, q1, k1, v1, g[:1], reverse=True,
        cu_seqlens=torch.tensor([0.0, T]), match="int32/int64")
    bad(lt.chunk_linear_attn, -q, k.abs(), v, match="denominator")  # q.z + eps <= 0
    bad(la, q, k, v, initial_state=(torch.zeros(B, H, K, V), torch.zeros(B, 1, H, K)),
        match="normalize=True")
