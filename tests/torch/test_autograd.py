"""Gradients of every linattn.torch op (docs/pytorch.md, "Autograd").

Three independent checks of linattn's backward:
  * torch.autograd.gradcheck (central finite differences of linattn's own forward, float64) for
    every op, chunk_* and fused_recurrent_*, with an initial state and a loss that uses the
    final state, for T = 37 (two chunks, not a multiple of the chunk size), T = 1, and uneven
    packed sequences (cu_seqlens, an empty one among them) in the head-first layout;
  * torch's autograd through a plain float64 loop written from the formulas (`reference`),
    where finite differences cannot go: log-gates of -30 and -1e-6 and betas of exactly 0 and 1
    (a step below a beta of 0 or above a log-gate of 0 is refused by the forward);
  * float32, bfloat16 and float16 gradients against the float64 ones, within bounds derived
    from the arithmetic (`majorants`);
and the gradients of g_gamma, of reverse=True, of betas in (1, 2) (negative eigenvalues), of a
loss that leaves the final state out, and the errors of the backward.
"""

import pytest
import torch

import linattn.torch as lt
from linattn.torch import _ext
from ops_support import DELTA, OPS, RULES, call, random_inputs

torch.set_num_threads(2)

U64, U32 = 2.0 ** -53, 2.0 ** -24


def make_inputs(rule, Bn, Tn, H, K, V, seed, dtype=torch.float64):
    """q, k, v, g, beta, h0 (ops_support.random_inputs)."""
    return random_inputs(rule, Bn, Tn, H, K, V, seed, dtype)


# ---- the reference: a differentiable float64 loop over tokens -------------------------------

def reference(rule, q, k, v, g, beta, h0, scale, l2norm=False, cu_seqlens=None, majorant=False,
              states=None):
    """Logical [B, T, H, D] inputs -> (o [B, T, H, V], final state [N, H, K, V]), written from
    the formulas of docs/pytorch.md with differentiable torch ops. majorant=True runs the
    recursion with every subtraction replaced by an addition; given the absolute values of the
    inputs (gates exp(g) are positive anyway), each output is then the sum of the absolute
    values of the terms (monomials) of the true output. `states` (a dict), when given, gets
    the list [S_0, S_1, ...] of each (sequence, head) under the key (n, h)."""
    B, T, H, K = q.shape
    seqs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, a, e - a) for a, e in zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:])])
    sign = 1.0 if majorant else -1.0
    rows = {}
    finals = []
    for n, (b, first, length) in enumerate(seqs):
        heads = []
        for h in range(H):
            S = h0[n, h]
            if states is not None:
                states[(n, h)] = [S]
            for t in range(first, first + length):
                qt, kt, vt = q[b, t, h], k[b, t, h], v[b, t, h]
                if l2norm:
                    qt = qt / torch.sqrt(qt @ qt + 1e-6)
                    kt = kt / torch.sqrt(kt @ kt + 1e-6)
                if rule == "linear_attn":
                    S = S + torch.outer(kt, vt)
                elif rule == "simple_gla":
                    S = torch.exp(g[b, t, h]) * S + torch.outer(kt, vt)
                elif rule == "gla":
                    S = torch.exp(g[b, t, h])[:, None] * S + torch.outer(kt, vt)
                else:
                    if rule == "gated_delta_rule":
                        S = torch.exp(g[b, t, h]) * S
                    elif rule == "kda":
                        S = torch.exp(g[b, t, h])[:, None] * S
                    S = S + beta[b, t, h] * torch.outer(kt, vt + sign * (S.t() @ kt))
                rows[(b, t, h)] = scale * (S.t() @ qt)
                if states is not None:
                    states[(n, h)].append(S)
            heads.append(S)
        finals.append(torch.stack(heads))
    V = v.shape[3]
    zero = q.new_zeros(V)
    o = torch.stack([torch.stack([torch.stack([rows.get((b, t, h), zero) for h in range(H)])
                                  for t in range(T)]) for b in range(B)])
    return o, torch.stack(finals)


def loss_weights(o_shape, s_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*o_shape, generator=gen, dtype=torch.float64),
            torch.randn(*s_shape, generator=gen, dtype=torch.float64))


def gradients(fn, inputs, w_o, w_s):
    """d/d inputs of sum(w_o * o) + sum(w_s * final_state), where (o, final) = fn(*inputs);
    None inputs stay None."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    o, ht = fn(*leaves)
    loss = (o.double() * w_o).sum() + (ht.double() * w_s).sum()
    present = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return [None if x is None else next(grads) for x in leaves]


def majorants(rule, q, k, v, g, beta, h0, scale, w_o, w_s, cu_seqlens=None):
    """Per-entry bounds on the sum of absolute values of the terms of each gradient that
    linattn's backward adds up (see test_float32_gradients_match_float64)."""
    ref = lambda q, k, v, g, beta, h0: reference(rule, q, k, v, g, beta, h0, abs(scale),  # noqa: E731
                                                 cu_seqlens=cu_seqlens, majorant=True)
    signed = (q, k, v, g, beta, h0)
    # Differentiated at |x| as leaves (not through abs(), whose derivative would carry signs).
    q, k, v, h0 = q.abs(), k.abs(), v.abs(), h0.abs()
    Mq, Mk, Mv, Mg, Mbeta, Mh0 = gradients(ref, (q, k, v, g, beta, h0), w_o.abs(), w_s.abs())
    # The gate (and, for the delta rules, beta) gradients are contractions of the inputs with
    # their gradients, summed in reverse over the tokens of a sequence: linattn's formula
    # d log g_s = sum_{t >= s} (q_t . dq_t - k_t . dk_t) (+ the final state's term) cancels
    # terms that the true polynomial never holds. Their total is bounded, per sequence and
    # head, by the sum over all tokens of |q| Mq + |k| Mk + |v| Mv plus |S_T| |w_s|.
    S_major = reference(rule, q, k, v, g, beta, h0, abs(scale), cu_seqlens=cu_seqlens,
                        majorant=True)[1]
    mass = ((q.abs() * Mq).sum(-1) + (k.abs() * Mk).sum(-1) + (v.abs() * Mv).sum(-1))  # [B, T, H]
    seqs = ([(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu_seqlens is None else
            [(0, a, e - a) for a, e in zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:])])
    token_bound = torch.zeros_like(mass)
    for n, (b, first, length) in enumerate(seqs):
        total = mass[b, first:first + length].sum(0) + (S_major[n] * w_s[n].abs()).sum((-1, -2))
        token_bound[b, first:first + length] = total
    if g is not None:
        Mg = Mg + (token_bound[..., None] if g.dim() == 4 else token_bound)
    if beta is not None:
        Mbeta = Mbeta + token_bound
    if rule in DELTA:  # the monomial sums grow like 2^T; the contraction gives a far tighter bound
        nq, nk, nv, ntok, nh0 = delta_norm_bounds(rule, *signed, scale, w_o, w_s, seqs,
                                                  cu_seqlens)
        Mq, Mk, Mv, Mbeta, Mh0 = (torch.minimum(a, b) for a, b in
                                  zip((Mq, Mk, Mv, Mbeta, Mh0), (nq, nk, nv, ntok, nh0)))
        if g is not None:  # per-channel gates (kda): each channel's share is within the total
            Mg = torch.minimum(Mg, ntok[..., None] if g.dim() == 4 else ntok)
    return Mq, Mk, Mv, Mg, Mbeta, Mh0


def delta_norm_bounds(rule, q, k, v, g, beta, h0, scale, w_o, w_s, seqs, cu_seqlens, chunk=32):
    """Normwise bounds on the sums of |terms| of the delta rules' gradients, for unit keys,
    beta in [0, 1] and gates <= 1. Every factor alpha (I - beta k k^T) is then a contraction: rounding errors made at
    one token are not amplified later, so the terms that matter are those of one token's (or
    one chunk's) formulas. Per sequence and head, from the float64 reference: G bounds every
    state ||S_t|| and value |v_t|, so the WY form's corrected values u_t = beta_t (v_t -
    S_{t-1}^T k_t) are <= 2 G; D bounds every state gradient ||dS_t|| and |scale| |q_t| |dy_t|,
    so the gradients of the u_t are <= D. linattn's backward (rule_backward.hpp) sums, per
    token, at most C = min(T, chunk size 32) such products per family: dq_t = scale (dy_t S +
    sum_j (dy_t . u_j) k_j) <= |scale| |dy_t| (1 + 2C) G; dv <= dU = K H + P^T dO <= (1 + C) D;
    dk, dbeta and d log alpha gather four families (the read of S, P, the in-chunk A, the
    chunk end's H) of C products of a gradient and a state or value: <= 4 (1 + 2C) D G;
    dS_0 = gamma H + Q^T dO - K^T dR <= (1 + 2C) D."""
    recorded = {}
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ST = reference(rule, *leaves, scale, cu_seqlens=cu_seqlens, states=recorded)
    for chain in recorded.values():
        for S in chain:
            S.retain_grad()
    ((o * w_o).sum() + (ST * w_s).sum()).backward()
    Mq, Mk, Mv, Mtok = (torch.zeros_like(x) for x in (q, k, v, q[..., 0]))
    Mh0 = torch.zeros_like(h0)
    for n, (b, first, length) in enumerate(seqs):
        rows = slice(first, first + length)
        C = min(max(length, 1), chunk)
        for h in range(q.shape[2]):
            chain = recorded[(n, h)]
            G = max([S.detach().norm() for S in chain] + [v[b, rows, h].norm(dim=-1).max()
                                                         if length else torch.tensor(0.0)])
            dS = [S.grad.norm() for S in chain if S.grad is not None] + [w_s[n, h].norm()]
            reads = abs(scale) * q[b, rows, h].norm(dim=-1) * w_o[b, rows, h].norm(dim=-1)
            D = max(dS + ([reads.max()] if length else []))
            Mq[b, rows, h] = (abs(scale) * w_o[b, rows, h].norm(dim=-1) * (1 + 2 * C) * G)[:, None]
            Mv[b, rows, h] = (1 + C) * D
            Mk[b, rows, h] = 4 * (1 + 2 * C) * D * G
            Mtok[b, rows, h] = 4 * (1 + 2 * C) * D * G
            Mh0[n, h] = (1 + 2 * C) * D
    return Mq, Mk, Mv, Mtok, Mh0


def assert_within(got, want, tol, what):
    """|got - want| <= tol entrywise (a zero bound demands an exact zero: the entry is then a
    sum of no terms); NaN fails."""
    assert (tol >= 0).all(), f"{what}: a negative bound"
    err = (got.double() - want.double()).abs()
    ok = err <= tol
    assert ok.all(), (f"{what}: {int((~ok).sum())} entries exceed the bound, worst error "
                      f"{err[~ok].max().item():.3g} against a bound of {tol[~ok].min().item():.3g}")


# ---- gradcheck ---------------------------------------------------------------------------------

def hf(x):
    """[B, T, H, ...] -> [B, H, T, ...] (head-first), contiguous."""
    return None if x is None else x.transpose(1, 2).contiguous()


@pytest.mark.parametrize("rule,kind", OPS)
@pytest.mark.parametrize("case", ["two_chunks", "one_token", "packed_head_first"])
def test_gradcheck(rule, kind, case):
    H, K, V = 2, 3, 2
    if case == "packed_head_first":
        lengths = [5, 0, 33, 1]  # uneven, one empty, one across a chunk boundary (C = 32)
        cu = torch.tensor([0, 5, 5, 38, 39])
        q, k, v, g, beta, _ = make_inputs(rule, 1, 39, H, K, V, seed=11)
        h0 = make_inputs(rule, len(lengths), 1, H, K, V, seed=12)[5]
        q, k, v, g, beta = (hf(x) for x in (q, k, v, g, beta))
        kw = dict(cu_seqlens=cu, head_first=True)
    else:
        Tn = 37 if case == "two_chunks" else 1
        q, k, v, g, beta, h0 = make_inputs(rule, 2, Tn, H, K, V, seed=10)
        kw = {}
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
    names = [n for n, x in zip("q k v g beta h0".split(), (q, k, v, g, beta, h0)) if x is not None]

    def f(*xs):
        d = dict(zip(names, xs))
        return call(rule, kind, d["q"], d["k"], d["v"], d.get("g"), d.get("beta"),
                    initial_state=d["h0"], output_final_state=True, scale=0.8, **kw)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("rule", sorted(DELTA))
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_gradcheck_through_the_in_kernel_l2_norm(rule, kind):
    q, k, v, g, beta, h0 = make_inputs(rule, 2, 37, 2, 3, 2, seed=13)
    k = 3 * k  # not unit: the kernel normalizes
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]

    def f(q, k, v, *rest):
        g_, beta_, h0_ = (rest[0], rest[1], rest[2]) if len(rest) == 3 else (None, rest[0], rest[1])
        return call(rule, kind, q, k, v, g_, beta_, initial_state=h0_, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("rule", sorted(DELTA))
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_gradcheck_with_betas_above_one(rule, kind):
    # Betas in (1, 2): the negative eigenvalues of fla's allow_neg_eigval layers (finite
    # differences stay inside the accepted [0, 2]).
    q, k, v, g, beta, h0 = make_inputs(rule, 2, 37, 2, 3, 2, seed=14)
    beta = 1 + beta
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]

    def f(q, k, v, *rest):
        g_, beta_, h0_ = (rest[0], rest[1], rest[2]) if len(rest) == 3 else (None, rest[0], rest[1])
        return call(rule, kind, q, k, v, g_, beta_, initial_state=h0_, output_final_state=True)

    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_of_g_gamma_and_of_no_gate():
    q, k, v, g, _, h0 = make_inputs("simple_gla", 2, 20, 2, 3, 2, seed=14)
    gamma = torch.tensor([-0.1, -0.5], dtype=torch.float64, requires_grad=True)
    for x in (q, k, v, g, h0):
        x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, g, gamma, h0: lt.chunk_simple_gla(q, k, v, g, g_gamma=gamma, initial_state=h0,
                                                    output_final_state=True), (q, g, gamma, h0))
    assert torch.autograd.gradcheck(  # g_gamma alone: a stride-0 broadcast read in place
        lambda q, gamma: lt.fused_recurrent_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0,
                                                       output_final_state=True), (q, gamma))
    assert torch.autograd.gradcheck(
        lambda q, k, v: lt.fused_recurrent_gla(q, k, v, output_final_state=True), (q, k, v))


@pytest.mark.parametrize("rule", ["linear_attn", "simple_gla", "gla"])
def test_gradcheck_reverse_packed_head_first(rule):
    cu = torch.tensor([0, 5, 5, 38, 39])
    q, k, v, g, beta, _ = make_inputs(rule, 1, 39, 2, 3, 2, seed=25)
    h0 = make_inputs(rule, 4, 1, 2, 3, 2, seed=26)[5]
    q, k, v, g = (hf(x) for x in (q, k, v, g))
    inputs = [x.requires_grad_() for x in (q, k, v, g, h0) if x is not None]

    def f(q, k, v, *rest):
        g_, h0_ = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
        return call(rule, "recurrent", q, k, v, g_, None, initial_state=h0_, cu_seqlens=cu,
                    output_final_state=True, head_first=True, reverse=True)

    assert torch.autograd.gradcheck(f, inputs)


# ---- against autograd through the formulas, at the edges of the inputs' domain -------------------

@pytest.mark.parametrize("rule,kind", [op for op in OPS if op[0] != "linear_attn"])
def test_gradients_at_extreme_gates_and_betas(rule, kind):
    Bn, Tn, H, K, V = 2, 37, 2, 3, 2
    q, k, v, g, beta, h0 = make_inputs(rule, Bn, Tn, H, K, V, seed=15)
    # Every token alternates between the extremes: gates exp(-30) ~ 1e-13 and exp(-1e-6) ~ 1,
    # betas exactly 0 and 1 (a third of the tokens each, the rest random).
    if g is not None:
        pattern = torch.tensor([-30.0, -1e-6, -0.5], dtype=torch.float64)
        edge = pattern[torch.arange(Tn) % 3].view(1, Tn, 1, *([1] * (g.dim() - 3)))
        g = edge.expand_as(g).clone()
        if rule in ("gla", "kda"):  # channels differ too
            g[..., 1] = g[..., 1].flip(1)
    if beta is not None:
        edge = torch.tensor([0.0, 1.0, 0.3], dtype=torch.float64)[(torch.arange(Tn) + 1) % 3]
        beta = edge.view(1, Tn, 1).expand_as(beta).clone()
    scale = 0.8
    w_o, w_s = loss_weights((Bn, Tn, H, V), (Bn, H, K, V), seed=16)
    inputs = (q, k, v, g, beta, h0)
    got = gradients(lambda q, k, v, g, beta, h0: call(rule, kind, q, k, v, g, beta, scale=scale,
                                                      initial_state=h0, output_final_state=True),
                    inputs, w_o, w_s)
    want = gradients(lambda *xs: reference(rule, *xs, scale), inputs, w_o, w_s)
    bounds = majorants(rule, *inputs, scale, w_o, w_s)
    # Both sides are float64 evaluations of the same polynomials (in different orders): each
    # errs by at most 8 (T + K + V) u64 times the sum of the absolute values of its terms (the
    # majorant; factor 8 as in test_ops.tolerance), so they differ by at most twice that.
    for name, a, b, m in zip("q k v g beta h0".split(), got, want, bounds):
        if a is None:
            continue
        assert_within(a, b, 2 * 8 * (Tn + K + V) * U64 * m, f"{rule} {kind} d{name}")


# ---- float32 and bfloat16 against float64 -------------------------------------------------------

@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("packed", [False, True])
def test_float32_gradients_match_float64(rule, packed):
    Bn, Tn, H, K, V = (1, 70, 2, 8, 5) if packed else (2, 70, 2, 8, 5)
    cu = torch.tensor([0, 17, 17, 70]) if packed else None
    N = 3 if packed else Bn
    q, k, v, g, beta, _ = make_inputs(rule, Bn, Tn, H, K, V, seed=17)
    h0 = make_inputs(rule, N, 1, H, K, V, seed=18)[5]
    w_o, w_s = loss_weights((Bn, Tn, H, V), (N, H, K, V), seed=19)
    inputs = (q, k, v, g, beta, h0)

    def op(dtype):
        def f(q, k, v, g, beta, h0):
            return call(rule, "chunk", q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        cu_seqlens=cu)
        return gradients(f, [None if x is None else x.to(dtype) for x in inputs], w_o, w_s)

    g64, g32 = op(torch.float64), op(torch.float32)
    bounds = majorants(rule, *inputs, K ** -0.5, w_o, w_s, cu_seqlens=cu)
    # Every gradient entry linattn computes is a sum of products of the inputs (a polynomial in
    # q, k, v, h0, beta, exp(g) and the loss weights), evaluated in another order than the
    # reference, and the float32 one also starts from inputs rounded to float32 (relative error
    # u32 each). A sum of n products of m factors, each rounded, errs by at most
    # (n + m) u |terms| to first order; n <= T + K + V terms enter every contraction along a
    # path through the chunks, and we allow a factor 8 for the chunk-local products (the same
    # derivation as test_ops.tolerance). |terms| is bounded by `majorants`: the gradient of the
    # same loss with absolute values (the sum of the absolute values of the true polynomial's
    # terms) plus, for gates and betas, the mass of the terms their reverse sums cancel.
    for name, a, b, m in zip("q k v g beta h0".split(), g64, g32, bounds):
        if a is None:
            continue
        assert b.dtype == torch.float32
        assert_within(b, a, 8 * (Tn + K + V) * U32 * m, f"{rule} d{name}")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_in_the_input_dtype(rule, dtype):
    Bn, Tn, H, K, V = 2, 40, 2, 8, 5
    q, k, v, g, beta, h0 = make_inputs(rule, Bn, Tn, H, K, V, seed=20)
    # Inputs that are exact in `dtype`, so float64 sees the very same values.
    q, k, v, g, beta, h0 = [None if x is None else x.to(dtype).double() for x in (q, k, v, g, beta, h0)]
    w_o, w_s = loss_weights((Bn, Tn, H, V), (Bn, H, K, V), seed=21)
    w_o = w_o.to(dtype).double()  # the output gradient reaches the op in `dtype`
    f = lambda q, k, v, g, beta, h0: call(rule, "chunk", q, k, v, g, beta,  # noqa: E731
                                          initial_state=h0, output_final_state=True)
    g64 = gradients(f, (q, k, v, g, beta, h0), w_o, w_s)
    gh = gradients(f, [None if x is None else x.to(dtype) for x in (q, k, v, g, beta, h0)], w_o, w_s)
    bounds = majorants(rule, q, k, v, g, beta, h0, K ** -0.5, w_o, w_s)
    # Computed in float32 (the float32 bound of test_float32_gradients_match_float64, without
    # the input rounding, which is exact here), then rounded once to `dtype`: relative 2^-8
    # (bfloat16) or 2^-11 (float16) of the value, itself at most the majorant.
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for name, a, b, m in zip("q k v g beta h0".split(), g64, gh, bounds):
        if a is None:
            continue
        assert b.dtype == dtype, f"d{name} has dtype {b.dtype}"
        assert_within(b, a, (8 * (Tn + K + V) * U32 + rounding) * m, f"{rule} {dtype} d{name}")


# ---- what the gradients cover, and bad input ---------------------------------------------------

@pytest.mark.parametrize("rule", RULES)
def test_unused_final_state_and_no_initial_state(rule):
    # Without output_final_state and initial_state the backward gets no state gradient and
    # returns none; the gradients equal those of a loss that weights the final state by 0.
    q, k, v, g, beta, _ = make_inputs(rule, 2, 37, 2, 3, 2, seed=22)
    w_o, _ = loss_weights((2, 37, 2, 2), (1,), seed=23)
    leaves = [None if x is None else x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, ht = call(rule, "chunk", *leaves)
    assert ht is None
    (o * w_o).sum().backward()
    zeros = torch.zeros(2, 2, 3, 2, dtype=torch.float64)
    want = gradients(lambda q, k, v, g, beta, h0: call(rule, "chunk", q, k, v, g, beta,
                                                       initial_state=h0, output_final_state=True),
                     (q, k, v, g, beta, zeros), w_o, torch.zeros(2, 2, 3, 2, dtype=torch.float64))
    for x, w in zip(leaves, want):
        if x is not None:
            assert torch.equal(x.grad, w)


def test_bad_backward_inputs_raise_with_a_message():
    q, k, v, g, beta, h0 = make_inputs("gated_delta_rule", 2, 5, 2, 3, 2, seed=24)
    do = torch.zeros(2, 5, 2, 2, dtype=torch.float64)
    args = ("gated_delta_rule", q, k, v, g, beta, h0, None, None, None, False, False, False)
    with pytest.raises(ValueError, match="output gradient"):
        _ext.backward(*args, do[:, :4], None, None)
    with pytest.raises(ValueError, match="final state's gradient"):
        _ext.backward(*args, do, torch.zeros(2, 2, 2, 3, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="final z"):
        _ext.backward(*args, do, None, torch.zeros(2, 1, 2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype"):
        _ext.backward(*args, do.long(), None, None)
    with pytest.raises(ValueError, match="beta"):  # the forward's checks hold in backward too
        _ext.backward("gated_delta_rule", q, k, v, g, beta + 2, h0, None, None, None, False,
                      False, False, do, None, None)
    # Double backward is not offered: a clear error, not silently wrong second derivatives.
    qq = q.clone().requires_grad_()
    o, _ = lt.chunk_gated_delta_rule(qq, k, v, g, beta)
    (dq,) = torch.autograd.grad((o * o).sum(), qq, create_graph=True)  # d_o = 2 o needs a graph
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


# ---- the saved forward: chunk_* ops keep their chunk states for the backward ---------------------

def saved_bytes(o):
    """Bytes of the chunk states o's node kept for its backward (0 when it kept none)."""
    saved = o.grad_fn.saved_forwards
    return 0 if saved is None else saved.bytes


def step(rule, inputs, w_o, w_s, saving, **kw):
    """(o, final state, gradients, bytes kept) of one forward and backward of the chunk op with
    set_saved_forward(saving); the bytes are read between the forward and the backward."""
    previous = lt.set_saved_forward(saving)
    try:
        leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
        q, k, v, g, beta, h0 = leaves
        o, ht = call(rule, "chunk", q, k, v, g, beta, initial_state=h0, output_final_state=True,
                     **kw)
        kept = saved_bytes(o)
        S, z = ht if isinstance(ht, tuple) else (ht, None)  # normalize: an (S, z) pair
        loss = (o.double() * w_o).sum() + (S.double() * w_s).sum()
        if z is not None:
            loss = loss + (z.double() * w_s[:, :1, :, 0]).sum()
        loss.backward()
        assert o.grad_fn.saved_forwards is None, "the backward must free the saved states"
        final = S if z is None else torch.cat([S.flatten(), z.flatten()])
        return o, final, [None if x is None else x.grad for x in leaves], kept
    finally:
        lt.set_saved_forward(previous)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", ["batch", "packed_head_first", "options"])
def test_saved_forward_gives_the_recomputing_gradients_bit_for_bit(rule, dtype, case):
    # The backward from the saved chunk states runs the same arithmetic as the one that rebuilds
    # them with the forward's own kernel (linattn/saved_forward.hpp), so every output and
    # gradient must be identical: torch.equal, no tolerance. That holds for the write rules at
    # any width; linear_attn's two backwards share the register kernel where V is a multiple of
    # the packet width (16 is, for float and double on SSE2 to AVX-512) and agree to rounding
    # elsewhere (docs/gradients.md), so it gets V = 16 and the rules an odd V = 5.
    H, K, V = 2, 8, (16 if rule == "linear_attn" else 5)
    kw = {}
    if case == "packed_head_first":
        cu = torch.tensor([0, 40, 40, 107, 108])  # uneven, one empty, several backward chunks
        q, k, v, g, beta, _ = make_inputs(rule, 1, 108, H, K, V, seed=30)
        h0 = make_inputs(rule, 4, 1, H, K, V, seed=31)[5]
        q, k, v, g, beta = (hf(x) for x in (q, k, v, g, beta))
        kw = dict(cu_seqlens=cu, head_first=True)
        o_shape, s_shape = (1, H, 108, V), (4, H, K, V)
    else:
        q, k, v, g, beta, h0 = make_inputs(rule, 2, 100, H, K, V, seed=32)
        o_shape, s_shape = (2, 100, H, V), (2, H, K, V)
        if case == "options":  # the ops' own options: normalize, the in-kernel L2 norm, a scale
            kw = dict(scale=0.7)
            if rule == "linear_attn":
                q, k = q.abs(), k.abs()  # positive features: a positive denominator
                kw["normalize"] = True
            if rule in DELTA:
                k = 3 * k
                kw["use_qk_l2norm_in_kernel"] = True
    w_o, w_s = loss_weights(o_shape, s_shape, seed=33)
    inputs = [None if x is None else x.to(dtype) for x in (q, k, v, g, beta, h0)]
    if rule == "linear_attn" and kw.get("normalize"):
        inputs[5] = None  # a normalized initial state is a (S, z) pair; start empty
    o1, s1, g1, kept = step(rule, inputs, w_o, w_s, True, **kw)
    o0, s0, g0, none = step(rule, inputs, w_o, w_s, False, **kw)
    assert kept > 0 and none == 0
    assert torch.equal(o1, o0) and torch.equal(s1, s0), "the saving forward changed the outputs"
    for name, a, b in zip("q k v g beta h0".split(), g1, g0):
        if a is not None:
            assert torch.equal(a, b), f"{rule} {dtype} {case} d{name} differs"


@pytest.mark.parametrize("rule", ["linear_attn", "simple_gla", "gla"])
def test_saved_forward_holds_the_documented_bytes(rule):
    # linear_attn and the gated ops keep S (K x V) and z (K) before every backward chunk of 32
    # rows, per sequence and head: N H ceil(T / 32) (K V + K) scalars (docs/pytorch.md).
    N, T, H, K, V = 2, 100, 3, 8, 5
    q, k, v, g, beta, h0 = make_inputs(rule, N, T, H, K, V, seed=34, dtype=torch.float32)
    q.requires_grad_()
    o, _ = call(rule, "chunk", q, k, v, g, beta)
    assert saved_bytes(o) == N * H * -(-T // 32) * (K * V + K) * 4


@pytest.mark.parametrize("rule", RULES)
def test_a_retained_graph_rebuilds_the_freed_states(rule):
    # The first backward uses the saved states and frees them; a second one through the
    # retained graph rebuilds them, with the same gradients.
    q, k, v, g, beta, h0 = make_inputs(rule, 2, 70, 2, 4, 3, seed=35, dtype=torch.float32)
    q.requires_grad_()
    o, _ = call(rule, "chunk", q, k, v, g, beta, initial_state=h0)
    assert saved_bytes(o) > 0
    loss = (o * o).sum()
    (first,) = torch.autograd.grad(loss, q, retain_graph=True)
    assert o.grad_fn.saved_forwards is None
    (second,) = torch.autograd.grad(loss, q)
    assert torch.equal(first, second)


def test_nothing_is_saved_where_no_backward_follows(monkeypatch):
    # Only a chunk_* op whose backward autograd will call keeps states: not under no_grad, not
    # when no input requires grad, not for fused_recurrent_* (no chunk states) and not after
    # set_saved_forward(False).
    asked = []
    forward = _ext.forward

    def spy(*args):
        asked.append(args[-1])  # the save flag
        return forward(*args)

    monkeypatch.setattr(_ext, "forward", spy)
    q, k, v, _, _, _ = make_inputs("linear_attn", 1, 40, 2, 4, 3, seed=36, dtype=torch.float32)
    qg = q.clone().requires_grad_()
    lt.chunk_linear_attn(qg, k, v, normalize=False)
    lt.chunk_linear_attn(q, k, v, normalize=False)
    with torch.no_grad():
        lt.chunk_linear_attn(qg, k, v, normalize=False)
    o, _ = lt.fused_recurrent_linear_attn(qg, k, v)
    assert o.grad_fn.saved_forwards is None
    previous = lt.set_saved_forward(False)
    assert previous is True and not lt.saved_forward_enabled()
    try:
        lt.chunk_linear_attn(qg, k, v, normalize=False)
    finally:
        lt.set_saved_forward(True)
    assert asked == [True, False, False, False, False]


def test_saved_states_of_another_call_are_refused():
    q, k, v, g, _, _ = make_inputs("simple_gla", 2, 40, 2, 4, 3, seed=37, dtype=torch.float32)
    settings = (None, None, None, None, 0.5, True, False, False, False, False)
    o, _, _, saved = _ext.forward("simple_gla", q, k, v, g, *settings, True)
    assert saved is not None and saved.bytes > 0
    do = torch.ones_like(o)
    back = ("simple_gla", q, k, v, g) + settings[:5] + (False, False, False)
    _ext.backward(*back, do, None, None, saved)  # its own call: accepted
    with pytest.raises(ValueError, match="saved forward is for simple_gla with N=2 H=2 T=40"):
        _ext.backward("simple_gla", q[:, :39], k[:, :39], v[:, :39], g[:, :39],
                      *back[5:], do[:, :39], None, None, saved)
    with pytest.raises(ValueError, match="this backward is for simple_gla .* scale=0.25"):
        _ext.backward(*back[:9], 0.25, *back[10:], do, None, None, saved)
    with pytest.raises(ValueError, match="this backward is for linear_attn"):
        _ext.backward("linear_attn", q, k, v, None, *back[5:], do, None, None, saved)
    # The token-by-token forward keeps nothing: its handle is None.
    assert _ext.forward("simple_gla", q, k, v, g, None, None, None, None, 0.5, False, False,
                        False, False, False, True)[3] is None


@pytest.mark.parametrize("rule", RULES)
def test_the_backward_reads_the_saved_states(rule):
    # The backward takes the states from the handle, not from the inputs: a handle filled by a
    # forward of other values (same shapes: accepted, values are not checked) gives other
    # gradients, and the handle of these values the recomputing backward's.
    q, k, v, g, beta, _ = make_inputs(rule, 1, 70, 2, 8, 16, seed=38, dtype=torch.float32)
    other = make_inputs(rule, 1, 70, 2, 8, 16, seed=39, dtype=torch.float32)
    settings = (None, None, None, 0.5)
    flags = (False, False, False)  # normalize, qk_l2norm, head_first

    def fwd(q, k, v, g, beta):
        return _ext.forward(rule, q, k, v, g, beta, *settings, True, False, *flags, True)

    o, _, _, mine = fwd(q, k, v, g, beta)
    _, _, _, theirs = fwd(*other[:5])
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(40))
    back = (rule, q, k, v, g, beta) + settings + flags + (do, None, None)
    recomputed = _ext.backward(*back)
    from_mine = _ext.backward(*back, mine)
    from_theirs = _ext.backward(*back, theirs)
    assert all(torch.equal(a, b) for a, b in zip(recomputed[:3], from_mine[:3]))
    assert not torch.equal(recomputed[0], from_theirs[0])  # dq reads the saved states
