"""The CUDA comparisons, one definition each, shared by the tests in this directory and ``tools/gpu_check.py``:
fast path vs k3train's reference on the same inputs, reported as error statistics (and timings) in plain dicts.

Errors: ``max_abs``, ``max_rel`` (= max_abs / max |ref|) and ``rel_rms`` (= ||got - ref|| / ||ref||), the last being
what the tests bound (a few outliers of a bf16 kernel do not fail it; a wrong mask, gate or state does).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
from torch import Tensor

# rel_rms bounds: fp32 kernels may use TF32 tensor cores (fla's Triton dots do), bf16 ones round their inputs and
# intermediates to 8 mantissa bits
KDA_TOL = {"float32": 1e-2, "bfloat16": 4e-2}
MLA_TOL = {"float32": 1e-3, "bfloat16": 2e-2}
EXPERTS_TOL = 2e-2


def err(got: Tensor | None, ref: Tensor | None) -> dict[str, float]:
    if got is None or ref is None:
        return {"missing": 1.0}
    g, r = got.detach().double(), ref.detach().double()
    d = (g - r).abs()
    return {"max_abs": float(d.max()), "max_rel": float(d.max() / r.abs().max().clamp_min(1e-30)),
            "rel_rms": float(d.norm() / r.norm().clamp_min(1e-30))}


def worst(errors: dict[str, dict[str, float]]) -> float:
    """Largest rel_rms over a dict of :func:`err` results (inf when one is missing)."""
    return max((e.get("rel_rms", float("inf")) for e in errors.values()), default=0.0)


def _time_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``fn`` in ms (CUDA-synchronised), after one warm-up call (compilation, autotuning)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------------------------------------------
# KDA: fla chunk_kda vs k3train's chunk_kda
# ----------------------------------------------------------------------------------------------------------------
def kda_inputs(T: int, H: int, K: int, dtype: torch.dtype, docs: int = 3, seed: int = 0,
               lower_bound: float = -5.0, device: str = "cuda") -> dict[str, Any]:
    """Varlen inputs as the KDA layer makes them: ``[1, T, H, *]``, L2-normalised q and k, K3's lower-bounded
    gate ``g = lb * sigmoid(.)`` (fp32), ``beta = sigmoid(.)``, ``docs`` documents of uneven length, an fp32
    initial state per document."""
    dev = device
    g = torch.Generator(device=dev).manual_seed(seed)

    def rn(*shape: int) -> Tensor:
        return torch.randn(*shape, device=dev, generator=g)

    q = torch.nn.functional.normalize(rn(1, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rn(1, T, H, K), dim=-1).to(dtype)
    v = rn(1, T, H, K).to(dtype)
    gate = lower_bound * torch.sigmoid(rn(1, T, H, K) + 2.0)  # mostly mild decay, as a trained gate
    beta = torch.sigmoid(rn(1, T, H))
    cuts = sorted(torch.randperm(T - 2, generator=torch.Generator().manual_seed(seed))[:docs - 1].add(1).tolist())
    cu = torch.tensor([0, *cuts, T], device=dev, dtype=torch.int32)
    h0 = 0.1 * rn(docs, H, K, K)
    return {"q": q, "k": k, "v": v, "g": gate, "beta": beta, "cu_seqlens": cu, "initial_state": h0,
            "lower_bound": lower_bound}


def _kda_run(op: Callable[..., Any], inp: dict[str, Any], cast: torch.dtype | None, grad_out: Tensor,
             grad_state: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: (inp[n].to(cast) if cast is not None and n in ("q", "k", "v") else inp[n]).detach()
              .requires_grad_(True) for n in names}
    o, s = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=inp["q"].shape[-1] ** -0.5,
              initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"],
              g_lower_bound=inp["lower_bound"])
    ((o.float() * grad_out).sum() + (s.float() * grad_state).sum()).backward()
    return o.detach(), s.detach(), {n: t.grad for n, t in leaves.items()}


def kda_compare(dtype: torch.dtype, T: int = 1024, H: int = 4, K: int = 128, seed: int = 0,
                device: str = "cuda") -> dict[str, Any]:
    """fla's kernel on ``dtype`` inputs vs k3train's ``chunk_kda`` in fp32 on the same (already rounded) inputs:
    output, final state, and the gradients of q, k, v, g, beta and the initial state."""
    from k3train.ops.kda import chunk_kda
    from k3train.ops.kda_fla import fla_chunk_kda

    inp = kda_inputs(T, H, K, dtype, seed=seed, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    d_o = torch.randn(1, T, H, K, device=device, generator=gen)
    d_s = torch.randn_like(inp["initial_state"])
    o, s, grads = _kda_run(fla_chunk_kda, inp, None, d_o, d_s)
    ro, rs, rgrads = _kda_run(chunk_kda, inp, torch.float32, d_o, d_s)
    errors = {"o": err(o, ro), "final_state": err(s, rs)}
    errors.update({f"d{n}": err(grads[n], rgrads[n]) for n in grads})
    dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
    return {"dtype": dt, "T": T, "H": H, "K": K, "docs": 3, "errors": errors, "worst_rel_rms": worst(errors),
            "tol_rel_rms": KDA_TOL[dt], "ok": worst(errors) <= KDA_TOL[dt]}


def kda_first_call(op_name: str, dtype: torch.dtype, T: int = 2048, H: int = 4, K: int = 128) -> dict[str, Any]:
    """Seconds of one op's first forward + backward in this process (``op_name``: ``torch`` or ``fla``; fla's
    includes its Triton compilation and autotuning of every kernel), then of a second call on the same inputs."""
    from k3train.ops.kda import chunk_kda
    from k3train.ops.kda_fla import fla_chunk_kda

    op = {"torch": chunk_kda, "fla": fla_chunk_kda}[op_name]
    inp = kda_inputs(T, H, K, dtype)
    d_o = torch.randn(1, T, H, K, device="cuda")
    d_s = torch.randn_like(inp["initial_state"])
    out: dict[str, Any] = {"op": op_name, "dtype": str(dtype).replace("torch.", ""), "T": T, "H": H, "K": K}
    for key in ("first_s", "second_s"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _kda_run(op, inp, None, d_o, d_s)
        torch.cuda.synchronize()
        out[key] = round(time.perf_counter() - t0, 3)
    return out


def kda_speed(T: int, H: int = 16, K: int = 128, reps: int = 3) -> dict[str, Any]:
    """Forward + backward time of both ops on bf16 inputs (one sequence of ``T`` tokens): ms and the ratio."""
    from k3train.ops.kda import chunk_kda
    from k3train.ops.kda_fla import fla_chunk_kda

    inp = kda_inputs(T, H, K, torch.bfloat16, docs=1)
    leaves = [inp[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    cu = inp["cu_seqlens"]

    def step(op: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            o, _ = op(*leaves, scale=K ** -0.5, cu_seqlens=cu, g_lower_bound=inp["lower_bound"])
            o.float().sum().backward()
        return run

    fla_ms = _time_ms(step(fla_chunk_kda), reps)
    torch_ms = _time_ms(step(chunk_kda), reps)
    return {"T": T, "H": H, "K": K, "fla_ms": fla_ms, "torch_ms": torch_ms, "torch_over_fla": torch_ms / fla_ms}


# ----------------------------------------------------------------------------------------------------------------
# MLA: FlexAttention (and the blockwise op) vs the dense reference
# ----------------------------------------------------------------------------------------------------------------
def mla_case(T: int, H: int, dtype: torch.dtype, B: int = 2, L: int = 64, Dn: int = 128, Dr: int = 64,
             Dv: int = 128, seed: int = 0, device: str = "cuda") -> dict[str, Any]:
    """q ``[B, H, T, Dn + Dr]`` and a latent ``[B, T, L]`` with a linear expansion to K/V (as MLA's
    ``expand_latent``: k = [k_nope ; k_pe shared over heads]), rows of several documents."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, T, Dn + Dr, device=device, generator=g).to(dtype)
    latent = torch.randn(B, T, L + Dr, device=device, generator=g).to(dtype)
    w_kv = (torch.randn(L, H * (Dn + Dv), device=device, generator=g) * L ** -0.5).to(dtype)
    doc = torch.zeros(B, T, dtype=torch.long, device=device)
    pos = torch.zeros(B, T, dtype=torch.long, device=device)
    for b in range(B):  # b + 2 documents per row, uneven
        cuts = sorted(torch.randperm(T - 2, generator=torch.Generator().manual_seed(seed + b))[:b + 1].add(1).tolist())
        for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, T])):
            doc[b, s:e] = i
            pos[b, s:e] = torch.arange(e - s, device=device)
    return {"q": q, "latent": latent, "w_kv": w_kv, "doc": doc, "pos": pos, "H": H, "L": L, "Dn": Dn, "Dr": Dr,
            "Dv": Dv, "scale": (Dn + Dr) ** -0.5}


def _expand(case: dict[str, Any], latent: Tensor, w_kv: Tensor) -> tuple[Tensor, Tensor]:
    """``latent [B', n, L + Dr] -> k [B', n, H, Dn + Dr], v [B', n, H, Dv]``."""
    H, L, Dn, Dr, Dv = case["H"], case["L"], case["Dn"], case["Dr"], case["Dv"]
    Bp, n, _ = latent.shape
    c, k_pe = latent.split([L, Dr], dim=-1)
    kv = (c @ w_kv).view(Bp, n, H, Dn + Dv)
    k_nope, v = kv.split([Dn, Dv], dim=-1)
    return torch.cat([k_nope, k_pe[:, :, None, :].expand(Bp, n, H, Dr)], dim=-1), v


def mla_compare(dtype: torch.dtype, T: int = 1024, H: int = 8, seed: int = 0, blockwise: bool = True,
                device: str = "cuda") -> dict[str, Any]:
    """Flex (and, when present, k3train's blockwise op) vs the dense reference in fp32 on the same inputs:
    output, per-head max logit, gradients of q, the latent and the expansion weight."""
    from k3train.ops.mla_dense import MaskInfo, attention_core, masked_logit_max
    from k3train.ops.mla_flex import flex_attention_with_max

    case = mla_case(T, H, dtype, seed=seed, device=device)
    mask = MaskInfo(case["doc"], case["pos"], case["doc"], case["pos"])
    d_o = torch.randn(case["q"].shape[0], H, T, case["Dv"], device=device,
                      generator=torch.Generator(device=device).manual_seed(seed + 1))

    def run(kind: str) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        cast = torch.float32 if kind == "dense" else dtype
        q, lat, w = (case[n].detach().to(cast).requires_grad_(True) for n in ("q", "latent", "w_kv"))
        if kind == "blockwise":
            from k3train.ops.mla_blockwise import blockwise_mla_attention

            o, mx = blockwise_mla_attention(q, lat, mask, case["scale"], 128,
                                            lambda x: _expand(case, x, w), (w,))
        else:
            k, v = _expand(case, lat, w)
            kh, vh = k.transpose(1, 2), v.transpose(1, 2)
            if kind == "flex":
                o, mx = flex_attention_with_max(q, kh, vh, mask, case["scale"])
            else:
                o, mx = attention_core(q, kh, vh, mask, case["scale"]), masked_logit_max(q, kh, mask, case["scale"])
        (o.float() * d_o).sum().backward()
        return o.detach(), mx.detach(), {"dq": q.grad, "dlatent": lat.grad, "dw_kv": w.grad}

    ro, rmx, rg = run("dense")
    out: dict[str, Any] = {"dtype": "bfloat16" if dtype == torch.bfloat16 else "float32", "T": T, "H": H,
                           "Dqk": case["Dn"] + case["Dr"], "Dv": case["Dv"]}
    kinds = ["flex"]
    if blockwise:
        import importlib.util

        if importlib.util.find_spec("k3train.ops.mla_blockwise") is not None:
            kinds.append("blockwise")
        else:
            out["blockwise"] = "k3train.ops.mla_blockwise is not present"
    tol = MLA_TOL[out["dtype"]]
    for kind in kinds:
        o, mx, gr = run(kind)
        errors = {"o": err(o, ro), "max_logit": err(mx, rmx), **{n: err(gr[n], rg[n]) for n in gr}}
        out[kind] = {"errors": errors, "worst_rel_rms": worst(errors), "tol_rel_rms": tol,
                     "ok": worst(errors) <= tol}
    return out


def mla_speed(T: int, H: int = 16, reps: int = 3) -> dict[str, Any]:
    """Forward + backward ms of flex vs dense attention on bf16 inputs (expanded K/V), one row of 2 documents."""
    from k3train.ops.mla_dense import MaskInfo, attention_core
    from k3train.ops.mla_flex import document_block_mask, flex_attention_core

    case = mla_case(T, H, torch.bfloat16, B=1)
    mask = MaskInfo(case["doc"], case["pos"], case["doc"], case["pos"])
    k, v = _expand(case, case["latent"], case["w_kv"])
    leaves = [t.detach().requires_grad_(True) for t in (case["q"], k.transpose(1, 2), v.transpose(1, 2))]
    bm = document_block_mask(mask)

    def step(op: Callable[..., Tensor]) -> Callable[[], None]:
        return lambda: op(*leaves, mask, case["scale"]).sum().backward()

    flex_ms = _time_ms(step(functools.partial(flex_attention_core, block_mask=bm)), reps)
    dense_ms = _time_ms(step(attention_core), reps)
    return {"T": T, "H": H, "flex_ms": flex_ms, "dense_ms": dense_ms, "dense_over_flex": dense_ms / flex_ms}


# ----------------------------------------------------------------------------------------------------------------
# Routed experts: torch._grouped_mm vs the per-expert loop
# ----------------------------------------------------------------------------------------------------------------
def experts_compare(E: int = 8, N: int = 1024, l_dim: int = 256, f_dim: int = 512, seed: int = 0,
                    device: str = "cuda") -> dict[str, Any]:
    """``grouped_expert_ffn`` with ``impl='grouped_mm'`` in bf16 vs the per-expert ``'loop'`` in fp32 on CUDA (uneven
    groups, one empty): output and the gradients of the rows and the three weights."""
    from k3train.model.moe import grouped_expert_ffn

    g = torch.Generator(device=device).manual_seed(seed)
    counts = torch.randint(0, 2 * N // E, (E,), generator=torch.Generator().manual_seed(seed))
    counts[1] = 0
    n = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    x = torch.randn(n, l_dim, device=device, generator=g).bfloat16()
    ws = [(torch.randn(E, a, b, device=device, generator=g) * a ** -0.5).bfloat16()
          for a, b in ((l_dim, f_dim), (l_dim, f_dim), (f_dim, l_dim))]
    d_y = torch.randn(n, l_dim, device=device, generator=g)

    def run(impl: str, dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, *ws)]
        y = grouped_expert_ffn(leaves[0], offsets, *leaves[1:], impl=impl)
        (y.float() * d_y).sum().backward()
        return y.detach(), [t.grad for t in leaves]

    y, grads = run("grouped_mm", torch.bfloat16)
    ry, rgrads = run("loop", torch.float32)  # the reference: the same bf16-rounded values, fp32 arithmetic
    errors = {"y": err(y, ry), **{f"d{nm}": err(a, b) for nm, a, b in zip(("x", "w_gate", "w_up", "w_down"), grads,
                                                                         rgrads)}}
    return {"E": E, "rows": n, "errors": errors, "worst_rel_rms": worst(errors), "tol_rel_rms": EXPERTS_TOL,
            "ok": worst(errors) <= EXPERTS_TOL}


# ----------------------------------------------------------------------------------------------------------------
# Data for the training checks
# ----------------------------------------------------------------------------------------------------------------
def small_corpus(directory: str, chapters: int = 120) -> str:
    """A real dataset (the first ``chapters`` KJV chapters, the shipped tokenizer) built under ``directory``; its
    prefix for ``--data.path``. Built fresh, so the checks never depend on (or write beside) data_cache/."""
    import itertools
    from pathlib import Path

    from k3train.data.corpus import DEFAULT_CORPUS, read_documents, write_text_corpus
    from k3train.data.prepare import prepare
    from k3train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_text_corpus([x.text for x in itertools.islice(read_documents(DEFAULT_CORPUS), chapters)], d / "kjv.txt")
    prefix = d / "kjv_text_document"
    prepare([d / "kjv.txt"], load_tokenizer(DEFAULT_TOKENIZER), prefix)
    return str(prefix)
