"""Grouped value heads (fla's HV > H, as in Qwen3-Next's Gated DeltaNet layers).

q and k have H heads; v, o, the gates, betas and states have HV = G H, and value head h reads
query/key head h // G: the op is the same op with q and k repeat_interleave'd to HV heads. That
call is the reference here (test_ops.py checks it against the float64 loop):
  * forward: each (sequence, value head) item runs the same arithmetic on the same rows, so o
    and the final state must be identical, bit for bit;
  * backward: dv, the gate and beta gradients and the initial state's are per value head, so
    bit for bit; dq and dk of a query/key head sum its G value heads' gradients, in another
    order than autograd's sum through repeat_interleave, so within that sum's rounding;
  * gradcheck (central finite differences, float64) of the grouped call itself;
  * the saved forward's gradients equal the recomputing backward's, bit for bit;
  * shapes that do not group raise ValueError naming them.
"""

import pytest
import torch

import linattn.torch as lt
from ops_support import DELTA, OPS, RULES, call, random_inputs

torch.set_num_threads(2)

G = 3          # value heads per query/key head
H, HV = 2, 6   # query/key heads, value heads
U64 = 2.0 ** -53


def grouped_inputs(rule, Bn, Tn, K, V, seed, dtype=torch.float64, heads=H, group=G):
    """q, k [B, T, heads, K]; v [B, T, heads * group, V]; g, beta, h0 per value head (logical
    layout)."""
    q, k, v, g, beta, h0 = random_inputs(rule, Bn, Tn, heads * group, K, V, seed, dtype)
    # Every group-th head of a draw over all value heads: distinct rows for every q/k head.
    return q[:, :, ::group].contiguous(), k[:, :, ::group].contiguous(), v, g, beta, h0


def repeated(x, group=G, dim=2):
    """x with each head repeated `group` times in place (value head h then reads head h // group)."""
    return x.repeat_interleave(group, dim=dim)


def head_first(x):
    return None if x is None else x.transpose(1, 2).contiguous()


def case_inputs(rule, case, dtype=torch.float64):
    """(q, k, v, g, beta, h0, keyword arguments) of a test case: two batch entries, or three
    packed sequences (one empty) in the head-first layout, or the delta rules' in-kernel L2 norm."""
    K, V = 8, 5
    if case == "packed_head_first":
        q, k, v, g, beta, _ = grouped_inputs(rule, 1, 70, K, V, seed=41, dtype=dtype)
        h0 = grouped_inputs(rule, 3, 1, K, V, seed=42, dtype=dtype)[5]
        return (*(head_first(x) for x in (q, k, v, g, beta)), h0,
                dict(cu_seqlens=torch.tensor([0, 17, 17, 70]), head_first=True))
    q, k, v, g, beta, h0 = grouped_inputs(rule, 2, 70, K, V, seed=40, dtype=dtype)
    kw = {}
    if case == "l2norm":
        k = 3 * k  # not unit: the kernel normalizes
        kw["use_qk_l2norm_in_kernel"] = True
    return q, k, v, g, beta, h0, kw


CASES = [(rule, kind, case) for rule, kind in OPS for case in ("batch", "packed_head_first", "l2norm")
         if case != "l2norm" or rule in DELTA]


@pytest.mark.parametrize("rule,kind,case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_is_the_op_on_repeated_q_and_k_bit_for_bit(rule, kind, case, dtype):
    q, k, v, g, beta, h0, kw = case_inputs(rule, case, dtype)
    head_dim = 1 if kw.get("head_first") else 2
    o, ht = call(rule, kind, q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    o_ref, ht_ref = call(rule, kind, repeated(q, dim=head_dim), repeated(k, dim=head_dim), v, g,
                         beta, initial_state=h0, output_final_state=True, **kw)
    assert o.shape == v.shape and ht.shape == h0.shape
    assert torch.equal(o, o_ref), f"{rule} {kind} {case}: o differs"
    assert torch.equal(ht, ht_ref), f"{rule} {kind} {case}: final state differs"


def test_decode_in_place_with_grouped_heads():
    # A prefill then token-by-token decode writing the state in place: the same bits as the
    # op on repeated q and k with new state tensors.
    q, k, v, g, beta, h0 = grouped_inputs("gated_delta_rule", 2, 12, 8, 5, seed=43)
    _, state = lt.chunk_gated_delta_rule(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8],
                                         initial_state=h0, output_final_state=True)
    _, state_ref = lt.chunk_gated_delta_rule(repeated(q[:, :8]), repeated(k[:, :8]), v[:, :8],
                                             g[:, :8], beta[:, :8], initial_state=h0,
                                             output_final_state=True)
    with torch.no_grad():
        for t in range(8, 12):
            s = slice(t, t + 1)
            o, _ = lt.fused_recurrent_gated_delta_rule(
                q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=state,
                output_final_state=True, inplace_final_state=True)
            o_ref, state_ref = lt.fused_recurrent_gated_delta_rule(
                repeated(q[:, s]), repeated(k[:, s]), v[:, s], g[:, s], beta[:, s],
                initial_state=state_ref, output_final_state=True)
            assert torch.equal(o, o_ref) and torch.equal(state, state_ref), f"token {t}"


def gradients(rule, kind, inputs, kw, repeat):
    """Gradients of a fixed weighted sum of o and the final state with respect to (q, k, v, g,
    beta, h0); with `repeat`, the op runs on repeat_interleave'd q and k, which are returned
    too (their gradients are the per-value-head terms that dq and dk sum)."""
    head_dim = 1 if kw.get("head_first") else 2
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = leaves
    q_in, k_in = q, k
    if repeat:
        q_in = repeated(q, dim=head_dim).detach().requires_grad_()
        k_in = repeated(k, dim=head_dim).detach().requires_grad_()
    o, ht = call(rule, kind, q_in, k_in, v, g, beta, initial_state=h0, output_final_state=True,
                 **kw)
    gen = torch.Generator().manual_seed(44)
    w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    w_s = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    ((o.double() * w_o).sum() + (ht.double() * w_s).sum()).backward()
    grads = [None if x is None else x.grad for x in leaves]
    if repeat:
        grads[0], grads[1] = q_in.grad, k_in.grad
    return grads


@pytest.mark.parametrize("rule,kind,case", [c for c in CASES if c[2] != "l2norm"])
def test_gradients_are_the_repeated_ops_summed_over_each_group(rule, kind, case):
    q, k, v, g, beta, h0, kw = case_inputs(rule, case)
    inputs = (q, k, v, g, beta, h0)
    got = gradients(rule, kind, inputs, kw, repeat=False)
    per_head = gradients(rule, kind, inputs, kw, repeat=True)
    for name, a, b in zip("v g beta h0".split(), got[2:], per_head[2:]):
        if a is not None:
            assert torch.equal(a, b), f"{rule} {kind} {case}: d{name} differs"
    head_dim = 1 if kw.get("head_first") else 2
    for name, a, terms in zip("q k".split(), got[:2], per_head[:2]):
        # terms: [..., HV, ...]; the G terms of query/key head j are heads jG ... jG + G - 1.
        shape = list(terms.shape)
        grouped = terms.reshape(shape[:head_dim] + [H, G] + shape[head_dim + 1:])
        want = grouped.sum(head_dim + 1)
        # Each term is the same bits in both calls (the per-item backward is the same); only
        # the sum of G terms is taken in another order: each sum of G terms errs by at most
        # (G - 1) u sum |terms|, so the two differ by at most twice that.
        tol = 2 * (G - 1) * U64 * grouped.abs().sum(head_dim + 1)
        assert a.shape == want.shape
        assert ((a - want).abs() <= tol).all(), f"{rule} {kind} {case}: d{name}"


@pytest.mark.parametrize("rule,kind", OPS)
def test_gradcheck_with_grouped_heads(rule, kind):
    # Small: two query/key heads read by two value heads each; for the delta rules also one
    # read by three, through the in-kernel L2 norm.
    configs = [(2, 2, False)] + ([(1, 3, True)] if rule in DELTA else [])
    for heads, group, l2 in configs:
        q, k, v, g, beta, h0 = grouped_inputs(rule, 1, 37, 3, 2, 45, heads=heads, group=group)
        if l2:
            k = 3 * k
        inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
        names = [n for n, x in zip("q k v g beta h0".split(), (q, k, v, g, beta, h0)) if x is not None]

        def f(*xs):
            d = dict(zip(names, xs))
            kw = dict(use_qk_l2norm_in_kernel=True) if l2 else {}
            return call(rule, kind, d["q"], d["k"], d["v"], d.get("g"), d.get("beta"),
                        initial_state=d["h0"], output_final_state=True, scale=0.8, **kw)

        assert torch.autograd.gradcheck(f, inputs), f"{rule} {kind} H={heads} G={group}"


@pytest.mark.parametrize("rule", RULES)
def test_saved_forward_with_grouped_heads_gives_the_same_gradients(rule):
    # As test_autograd's saved-forward test: the same arithmetic, so identical gradients
    # (linear_attn gets V = 16, where its two backwards share the register kernel).
    q, k, v, g, beta, h0 = grouped_inputs(rule, 2, 100, 8, 16 if rule == "linear_attn" else 5,
                                          seed=47, dtype=torch.float32)
    kw = dict(use_qk_l2norm_in_kernel=True) if rule in DELTA else {}
    results = []
    for saving in (True, False):
        previous = lt.set_saved_forward(saving)
        try:
            results.append(gradients(rule, "chunk", (q, k, v, g, beta, h0), kw, repeat=False))
        finally:
            lt.set_saved_forward(previous)
    for name, a, b in zip("q k v g beta h0".split(), *results):
        if a is not None:
            assert torch.equal(a, b), f"{rule}: d{name} differs"


def test_shapes_that_do_not_group_raise_with_a_message():
    q, k, v, g, beta, h0 = grouped_inputs("gated_delta_rule", 1, 10, 4, 3, seed=48)

    def bad(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            lt.chunk_gated_delta_rule(*args, **kw)

    bad("v's heads must equal q's or be a multiple", q, k, v[:, :, :5], g[:, :, :5], beta[:, :, :5])
    bad("v's heads must equal q's or be a multiple", repeated(q, 2), repeated(k, 2), v[:, :, :2],
        g[:, :, :2], beta[:, :, :2])  # fewer value heads than query/key heads
    bad("g", q, k, v, g[:, :, :H], beta)          # gates per query/key head, not per value head
    bad("beta", q, k, v, g, beta[:, :, :H])
    bad("initial_state", q, k, v, g, beta, initial_state=h0[:, :H])
    with pytest.raises(ValueError, match="g_gamma"):
        lt.chunk_simple_gla(q, k, v, g_gamma=torch.zeros(H))
    # The value heads' default beta (beta=None) and g_gamma per value head are accepted.
    o, _ = lt.fused_recurrent_gated_delta_rule(q, k, v, g)
    o_ref, _ = lt.fused_recurrent_gated_delta_rule(repeated(q), repeated(k), v, g)
    assert torch.equal(o, o_ref)
    o, _ = lt.chunk_simple_gla(q, k, v, g_gamma=-torch.rand(HV, dtype=torch.float64))
    assert o.shape == v.shape
