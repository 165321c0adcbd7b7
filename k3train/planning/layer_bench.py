"""CPU calibration of one config: the real forward and backward time of every layer, and of every optimizer update.

On a CPU, models of CPU size (tiny, small) spend most of a step in framework overhead (hundreds of small ops per
layer), which no FLOP count predicts. So for ``--device cpu`` the planner times the project's own modules on real
tensors, one piece at a time, at the micro-batch shape of a layout, single rank, at the thread count a rank gets:

* the embedding, each backbone layer ``i`` (``K3Model.forward_layers(state, i, i + 1)`` from its canonical AttnRes
  input state, then autograd backward of its outputs), and the head (final AttnRes, norm, LM head, MTP:
  ``loss_sums``) -- at ``[micro_batch_size, seq_len / cp]`` tokens, routed experts sharded for ``ep`` as the rank
  holds them (the local expert shard computing the ``N*k`` routed rows, as MoonEP balances them);
* every parameter's optimizer update (``muon_step_`` / ``adamw_step_`` with its real shape and head split).

Communication is NOT in these times (no process group): the planner adds it from the gloo calibration. Results
are cached in the calibration file, keyed by the model section, shape, ep, dtype and thread count.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from k3train.planning.devices import host_key, load_cache, median_time, save_cache


def _key(cfg: Any, *parts: Any) -> str:
    import dataclasses

    model = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str)
    h = hashlib.sha1(model.encode()).hexdigest()[:12]
    return "|".join([h, cfg.train.dtype, *map(str, parts)])


def _time(fn, reps: int = 3) -> float:  # noqa: ANN001
    return median_time(fn, reps)


def _model(cfg: Any, ep: int) -> torch.nn.Module:
    from k3train.model.model import K3Model
    from k3train.parallelize import cast_params_to_bf16
    from k3train.planning.memory import _ShardDispatcher

    torch.manual_seed(0)
    m = K3Model(cfg.model, cfg.vision)
    if ep > 1:
        from moonep.shard import _latent_moes, shard_experts

        for _, moe in _latent_moes(m):
            shard_experts(moe.experts, ep, 0)
            moe.dispatcher = _ShardDispatcher()
    if cfg.train.dtype == "bfloat16":
        cast_params_to_bf16([m])
    m.train()
    return m


def bench_layers(cfg: Any, B: int, T: int, ep: int, threads: int) -> dict[str, Any]:
    """``{'embed': [f, b], 'layers': [[f, b], ...], 'head': [f, b]}`` seconds for one ``[B, T]`` micro-batch."""
    from k3train.model.attnres import AttnResState
    from k3train.model.seq import SeqInfo
    from k3train.planning.memory import trace_batch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(cfg, ep)
        batch, _ = trace_batch(cfg, B, T)
        seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
        d, bs, L = cfg.model.hidden_size, cfg.model.attn_res_block_size, cfg.model.num_hidden_layers
        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32

        def leaves(s: int) -> list[torch.Tensor]:
            g = torch.Generator().manual_seed(s)
            n = 1 + s // bs + (1 if s % bs else 0)
            return [torch.randn(B, T, d, generator=g, dtype=dtype).requires_grad_() for _ in range(n)]

        def state_of(lv: list[torch.Tensor], s: int) -> Any:
            nb = 1 + s // bs
            return AttnResState(blocks=list(lv[:nb]), partial=lv[nb] if s % bs else None)

        def roots_of(out: Any, s: int) -> list[torch.Tensor]:
            r = list(out.blocks[1 + s // bs:]) + ([out.partial] if out.partial is not None else [])
            return [t for t in r if t.requires_grad]

        def fb(fwd) -> tuple[float, float]:  # noqa: ANN001
            def f_only() -> None:
                with torch.no_grad():
                    fwd()

            def both() -> None:
                roots = fwd()
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                model.zero_grad(set_to_none=True)

            tf = _time(f_only)
            # forward with autograd on, then backward: backward = total - forward (grad-mode forward is slower)
            tfb = _time(both)
            return tf, max(0.0, tfb - tf)

        def embed() -> list[torch.Tensor]:
            st = model.embed(batch.tokens)
            return [st.blocks[0]]

        out: dict[str, Any] = {"embed": list(fb(embed)), "layers": []}
        for i in range(L):
            lv = leaves(i)

            def layer(i: int = i, lv: list = lv) -> list[torch.Tensor]:
                return roots_of(model.forward_layers(state_of(lv, i), i, i + 1, seq), i)

            out["layers"].append(list(fb(layer)))
        lv = leaves(L)
        mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0

        def head() -> list[torch.Tensor]:
            o = model.loss_sums(state_of(lv, L), batch, seq)
            return [o["lm_loss_sum"] + mtp_w * o["mtp_loss_sum"]]

        out["head"] = list(fb(head))
        return out
    finally:
        torch.set_num_threads(old)


def bench_optimizer(cfg: Any, infos: list[Any], threads: int) -> dict[str, float]:
    """Seconds of one update per distinct parameter signature (``sig(info)`` -> s)."""
    from k3train.optim.muon import HParams, adamw_step_, muon_step_

    hp = HParams.from_config(cfg.optim, 1e-3)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    try:
        for inf in infos:
            k = opt_sig(inf)
            if k in out:
                continue
            w = torch.randn(inf.param.shape)
            g, s1, s2 = torch.randn_like(w), torch.zeros_like(w), torch.zeros_like(w)
            step = torch.zeros(())
            if inf.kind == "muon":
                out[k] = _time(lambda: muon_step_(w, g, s1, hp, inf), 2)
            else:
                out[k] = _time(lambda: adamw_step_(w, g, s1, s2, step, hp, inf.decay), 2)
    finally:
        torch.set_num_threads(old)
    return out


def opt_sig(inf: Any) -> str:
    return f"{inf.kind}|{inf.layout}|{tuple(inf.param.shape)}|{inf.heads}|{tuple(inf.segments)}"


class LayerTimes:
    """Cached per-config CPU timings (module docstring)."""

    def __init__(self, path: Path, threads: int, log: Any = print) -> None:
        self.path, self.threads, self.log = path, threads, log
        self.data = load_cache(path)
        self.host = host_key(threads)
        self.dirty = False

    def _slot(self) -> dict[str, Any]:
        return self.data.setdefault(self.host, {}).setdefault("layers", {})

    def layers(self, cfg: Any, B: int, T: int, ep: int) -> dict[str, Any]:
        k = _key(cfg, f"B={B}", f"T={T}", f"ep={ep}")
        slot = self._slot()
        if k not in slot:
            self.log(f"timing layers at [{B}, {T}] tokens, ep={ep} ...")
            slot[k] = bench_layers(cfg, B, T, ep, self.threads)
            self.dirty = True
        return slot[k]

    def optimizer(self, cfg: Any, infos: list[Any]) -> dict[str, float]:
        slot = self.data.setdefault(self.host, {}).setdefault("optimizer", {})
        k = _key(cfg, cfg.optim.name, cfg.optim.ns_steps, cfg.optim.ns_dtype, cfg.optim.per_head_muon)
        have = slot.setdefault(k, {})
        missing = [inf for inf in infos if opt_sig(inf) not in have]
        if missing:
            self.log(f"timing {len(missing)} optimizer update shape(s) ...")
            have.update(bench_optimizer(cfg, missing, self.threads))
            self.dirty = True
        return have

    def save(self) -> None:
        if self.dirty:
            fresh = load_cache(self.path)  # keep what another run added meanwhile
            for host, v in self.data.items():
                for sec, d in v.items():
                    fresh.setdefault(host, {}).setdefault(sec, {}).update(d)
            save_cache(self.path, fresh)
            self.dirty = False
