#!/usr/bin/env python3
"""Times linattn.torch's ops on CPU against the same computation in plain PyTorch, a chunked
loop of batched matmuls over B * H (the way a CPU fallback of fla's chunk kernels runs), and
prints one table with the ratio (plain PyTorch time / linattn time; > 1: linattn is faster).

    PYTHONPATH=build/test/python python3 bench/torch/bench_ops.py          # quick grid
    PYTHONPATH=build/test/python python3 bench/torch/bench_ops.py --full   # issue 17's grid
    PYTHONPATH=build/test/python python3 bench/torch/bench_ops.py --backward   # training step
    PYTHONPATH=build/test/python python3 bench/torch/bench_ops.py --decode     # decode steps

With --backward each side runs forward and backward (the loss sum(o)): linattn's backward
against PyTorch's autograd through the same chunked loop; the gradients of every input are
checked to agree first. linattn's step is also timed with lt.set_saved_forward(False) (the
backward rebuilds the chunk states instead of reading the ones the forward kept): the column
"no-save ms", and "save gain" = that time / the default step's.

With --decode, every fused_recurrent_* op decodes `--steps` tokens one call per token,
continuing an [B, H, D, D] state: as fla returns it (a new state tensor per step) against
inplace_final_state=True (the step writes over its initial state); microseconds per step, best
of --reps runs, and "new / in place" (> 1: in place is faster). No plain PyTorch side.

Both sides run float32 on the same thread count (torch.set_num_threads), B = 1, H = 8. Each
row first checks that the two agree (a relative error well under 1e-3), then takes the median
of a few repetitions. Timings on a shared machine are noisy: compare ratios within one run.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import linattn.torch as lt

CHUNK = 64


def _chunks(T):
    return [(s, min(s + CHUNK, T)) for s in range(0, T, CHUNK)]


def torch_linear_attn(q, k, v, g=None, gk=None, scale=1.0):
    """o_t = scale q_t^T S_t, S_t = a_t S_{t-1} + k_t v_t^T with a_t = exp(g_t) (scalar per head),
    diag(exp(gk_t)) (per key channel) or 1; chunked: inter-chunk through S, intra-chunk by a
    masked score matrix. q, k, v: [BH, T, D] float32; g: [BH, T]; gk: [BH, T, K]."""
    BH, T, K = q.shape
    S = q.new_zeros(BH, K, v.shape[-1])
    o = torch.empty_like(v)
    for s, e in _chunks(T):
        qc, kc, vc = q[:, s:e] * scale, k[:, s:e], v[:, s:e]
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        if gk is not None:  # per-channel log-gates, cumulative within the chunk
            G = gk[:, s:e].cumsum(1)
            qg, kg = qc * G.exp(), kc * (-G).exp()  # stable for chunk-local sums of log-gates
            scores = (qg @ kg.transpose(1, 2)).masked_fill(~mask, 0)
            o[:, s:e] = qg @ S + scores @ vc
            last = G[:, -1:]
            S = last.transpose(1, 2).exp() * S + (kc * (last - G).exp()).transpose(1, 2) @ vc
        elif g is not None:
            G = g[:, s:e].cumsum(1)
            decay = (G[:, :, None] - G[:, None, :]).masked_fill(~mask, float("-inf")).exp()
            o[:, s:e] = (qc * G.exp()[..., None]) @ S + ((qc @ kc.transpose(1, 2)) * decay) @ vc
            last = G[:, -1:]
            S = last.exp()[..., None] * S + (kc * (last - G).exp()[..., None]).transpose(1, 2) @ vc
        else:
            o[:, s:e] = qc @ S + (qc @ kc.transpose(1, 2)).masked_fill(~mask, 0) @ vc
            S = S + kc.transpose(1, 2) @ vc
    return o


def torch_delta_rule(q, k, v, beta, g=None, gk=None, scale=1.0):
    """S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale q_t^T S_t, in
    chunks by the WY form (Yang et al. 2024): within a chunk with cumulative log-decay G,
    T = (I + tril(diag(beta) (K K^T * exp(G_i - G_j)), -1))^-1 diag(beta), U = T V,
    W = T (K * exp(G)), new values U - W S, then as linear attention. With gk ([BH, T, K],
    Kimi Delta Attention: S_t = (I - beta_t k_t k_t^T) diag(exp(gk_t)) S_{t-1} + beta_t k_t
    v_t^T) the decays are per key channel: the pairwise products become (k_i .* exp(G_i)) .
    (k_j .* exp(-G_j)), stable for chunk-local sums of mild log-gates, as chunk_gla's loop."""
    if gk is not None:
        return _torch_kda(q, k, v, beta, gk, scale)
    BH, Tn, K = q.shape
    S = q.new_zeros(BH, K, v.shape[-1])
    o = torch.empty_like(v)
    for s, e in _chunks(Tn):
        n = e - s
        qc, kc, vc, bc = q[:, s:e] * scale, k[:, s:e], v[:, s:e], beta[:, s:e]
        G = g[:, s:e].cumsum(1) if g is not None else q.new_zeros(BH, n)
        strict = torch.ones(n, n, dtype=torch.bool).tril(-1)
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        rel = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        A = ((kc @ kc.transpose(1, 2)) * rel * bc[..., None]).masked_fill(~strict, 0)
        eye = torch.eye(n).expand(BH, n, n)
        Tm = torch.linalg.solve_triangular(eye + A, torch.diag_embed(bc), upper=False)
        U, W = Tm @ vc, Tm @ (kc * G.exp()[..., None])
        new_v = U - W @ S
        o[:, s:e] = (qc * G.exp()[..., None]) @ S + ((qc @ kc.transpose(1, 2)) * rel) @ new_v
        last = G[:, -1:]
        S = last.exp()[..., None] * S + (kc * (last - G).exp()[..., None]).transpose(1, 2) @ new_v
    return o


def _torch_kda(q, k, v, beta, gk, scale):
    """torch_delta_rule with per-channel log-gates: within a chunk, with G the cumulative
    log-gates (n x K), Kg = K .* exp(G), Ki = K .* exp(-G), Qg = Q .* exp(G):
    (I + tril(diag(beta) Kg Ki^T, -1)) U = diag(beta) (V - Kg S), o = Qg S + tril(Qg Ki^T) U,
    S <- diag(exp(G_n)) S + (K .* exp(G_n - G))^T U."""
    BH, Tn, K = q.shape
    S = q.new_zeros(BH, K, v.shape[-1])
    o = torch.empty_like(v)
    for s, e in _chunks(Tn):
        n = e - s
        qc, kc, vc, bc = q[:, s:e] * scale, k[:, s:e], v[:, s:e], beta[:, s:e]
        G = gk[:, s:e].cumsum(1)
        qg, kg, ki = qc * G.exp(), kc * G.exp(), kc * (-G).exp()
        strict = torch.ones(n, n, dtype=torch.bool).tril(-1)
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        A = ((kg @ ki.transpose(1, 2)) * bc[..., None]).masked_fill(~strict, 0)
        eye = torch.eye(n).expand(BH, n, n)
        rhs = bc[..., None] * (vc - kg @ S)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False)
        o[:, s:e] = qg @ S + (qg @ ki.transpose(1, 2)).masked_fill(~lower, 0) @ U
        last = G[:, -1:]
        S = last.transpose(1, 2).exp() * S + (kc * (last - G).exp()).transpose(1, 2) @ U
    return o


def bhtd(x):  # [B, T, H, D] -> [B*H, T, D]
    B, T, H, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B * H, T, D).contiguous()


def bht(x):  # [B, T, H] -> [B*H, T]
    return x.permute(0, 2, 1).reshape(-1, x.shape[1]).contiguous()


def cases(B, T, H, D, leaves):
    """Every op as (linattn, plain PyTorch) closures; `leaves` gets the input tensors."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    kn = F.normalize(k, dim=-1)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 4)
    gk = F.logsigmoid(torch.randn(B, T, H, D, generator=gen) + 4)
    beta = torch.rand(B, T, H, generator=gen)
    leaves.extend([q, kn, k, v, g, gk, beta])
    s = D ** -0.5
    return {
        "chunk_linear_attn": (lambda: lt.chunk_linear_attn(q, k, v, normalize=False)[0],
                              lambda: torch_linear_attn(bhtd(q), bhtd(k), bhtd(v), scale=s)),
        "chunk_simple_gla": (lambda: lt.chunk_simple_gla(q, k, v, g)[0],
                             lambda: torch_linear_attn(bhtd(q), bhtd(k), bhtd(v), g=bht(g), scale=s)),
        "chunk_gla": (lambda: lt.chunk_gla(q, k, v, gk)[0],
                      lambda: torch_linear_attn(bhtd(q), bhtd(k), bhtd(v), gk=bhtd(gk), scale=s)),
        "chunk_delta_rule": (lambda: lt.chunk_delta_rule(q, kn, v, beta)[0],
                             lambda: torch_delta_rule(bhtd(q), bhtd(kn), bhtd(v), bht(beta), scale=s)),
        "chunk_gated_delta_rule": (lambda: lt.chunk_gated_delta_rule(q, kn, v, g, beta)[0],
                                   lambda: torch_delta_rule(bhtd(q), bhtd(kn), bhtd(v), bht(beta),
                                                            g=bht(g), scale=s)),
        "chunk_kda": (lambda: lt.chunk_kda(q, kn, v, gk, beta)[0],
                      lambda: torch_delta_rule(bhtd(q), bhtd(kn), bhtd(v), bht(beta),
                                               gk=bhtd(gk), scale=s)),
    }


def median_seconds(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def with_backward(fn, leaves):
    """fn's forward and backward of sum(o); the leaves' gradients reset first."""
    def run():
        for x in leaves:
            x.grad = None
        fn().sum().backward()
    return run


def check_gradients(name, ours, theirs, leaves):
    grads = []
    for fn in (ours, theirs):
        fn()
        grads.append([None if x.grad is None else x.grad.clone() for x in leaves])
    for a, b in zip(*grads):
        if a is None and b is None:
            continue
        rel = ((a - b).norm() / b.norm()).item()
        if not rel < 1e-3:
            raise SystemExit(f"{name}: the gradients of linattn and plain PyTorch disagree "
                             f"(relative {rel:.2g})")


def decode_cases(B, H, D):
    """One decode step of every fused_recurrent_* op as f(state, inplace) -> state."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 1, H, D, generator=gen) for _ in range(3))
    kn = F.normalize(k, dim=-1)
    g = F.logsigmoid(torch.randn(B, 1, H, generator=gen) + 4)
    gk = F.logsigmoid(torch.randn(B, 1, H, D, generator=gen) + 4)
    beta = torch.rand(B, 1, H, generator=gen)
    kw = dict(output_final_state=True)
    return {
        "linear_attn": lambda h, ip: lt.fused_recurrent_linear_attn(
            q, k, v, initial_state=h, inplace_final_state=ip, **kw)[1],
        "simple_gla": lambda h, ip: lt.fused_recurrent_simple_gla(
            q, k, v, g, initial_state=h, inplace_final_state=ip, **kw)[1],
        "gla": lambda h, ip: lt.fused_recurrent_gla(
            q, k, v, gk=gk, initial_state=h, inplace_final_state=ip, **kw)[1],
        "delta_rule": lambda h, ip: lt.fused_recurrent_delta_rule(
            q, kn, v, beta, initial_state=h, inplace_final_state=ip, **kw)[1],
        "gated_delta_rule": lambda h, ip: lt.fused_recurrent_gated_delta_rule(
            q, kn, v, g, beta, initial_state=h, inplace_final_state=ip, **kw)[1],
        "kda": lambda h, ip: lt.fused_recurrent_kda(
            q, kn, v, gk, beta, initial_state=h, inplace_final_state=ip, **kw)[1],
    }


def decode_table(args):
    """--decode: microseconds per step, new state tensor against in place."""
    print(f"{'op':18} {'B':>2} {'D':>4} {'thr':>3} {'new us':>8} {'in place us':>11} "
          f"{'new / in place':>14}")
    torch.set_grad_enabled(False)
    H = 8
    for B in (1, 4):
        for D in (64, 128):
            for name, step in decode_cases(B, H, D).items():
                if args.ops and name not in args.ops:
                    continue
                for n in args.threads:
                    torch.set_num_threads(n)
                    best = {}
                    # The two forms alternate, so that a slow phase of the machine hits both.
                    for _ in range(args.reps):
                        for inplace in (False, True):
                            h = torch.zeros(B, H, D, D)
                            start = time.perf_counter()
                            for _ in range(args.steps):
                                h = step(h, inplace)
                            t = (time.perf_counter() - start) / args.steps
                            best[inplace] = min(best.get(inplace, t), t)
                    print(f"{name:18} {B:2d} {D:4d} {n:3d} {best[False] * 1e6:8.1f} "
                          f"{best[True] * 1e6:11.1f} {best[False] / best[True]:14.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="D 64, 128; T 1024 to 16384")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ops", nargs="*", help="only these ops")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2],
                        help="torch thread counts (default 1 2)")
    parser.add_argument("--decode", action="store_true",
                        help="time decode steps: new state tensor against inplace_final_state")
    parser.add_argument("--steps", type=int, default=1000, help="decode steps per run (--decode)")
    args = parser.parse_args()
    if args.decode:
        decode_table(args)
        return
    dims = [64, 128]
    lengths = [1024, 4096, 16384] if args.full else [1024, 4096]
    threads = args.threads
    B, H = 1, 8
    extra = f" {'no-save ms':>11} {'save gain':>9}" if args.backward else ""
    print(f"{'op':24} {'D':>4} {'T':>6} {'thr':>3} {'linattn ms':>11} {'torch ms':>10} "
          f"{'ratio':>6}{extra}")
    torch.set_grad_enabled(args.backward)
    for D in dims:
        for T in lengths:
            leaves = []
            for name, (ours, theirs) in cases(B, T, H, D, leaves).items():
                if args.ops and name not in args.ops:
                    continue
                with torch.no_grad():
                    a = ours().permute(0, 2, 1, 3).reshape(B * H, T, D)
                    b = theirs()
                rel = ((a - b).norm() / b.norm()).item()
                if not rel < 1e-3:
                    raise SystemExit(f"{name}: linattn and plain PyTorch disagree (relative {rel:.2g})")
                if args.backward:
                    for x in leaves:
                        x.requires_grad_()
                    ours, theirs = with_backward(ours, leaves), with_backward(theirs, leaves)
                    check_gradients(name, ours, theirs, leaves)
                for n in threads:
                    torch.set_num_threads(n)
                    t_ours = median_seconds(ours, args.reps)
                    t_theirs = median_seconds(theirs, args.reps)
                    extra = ""
                    if args.backward:
                        lt.set_saved_forward(False)
                        t_nosave = median_seconds(ours, args.reps)
                        lt.set_saved_forward(True)
                        extra = f" {t_nosave * 1e3:11.1f} {t_nosave / t_ours:9.2f}"
                    print(f"{name:24} {D:4d} {T:6d} {n:3d} {t_ours * 1e3:11.1f} "
                          f"{t_theirs * 1e3:10.1f} {t_theirs / t_ours:6.2f}{extra}", flush=True)


if __name__ == "__main__":
    main()
