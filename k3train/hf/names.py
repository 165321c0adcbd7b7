"""k3train tensors <-> the published Hugging Face tensors, by name, shape and layout (one rule per name, both ways).

Every tensor a :class:`k3train.model.model.K3Model` saves (parameters and the routers' persistent ``bias``) is a
:class:`Slot`: its FQN, its full (unsharded) shape, and the :class:`Source` alternatives a checkpoint may store it
in, the one k3train writes first. Sources:

* :class:`Whole` -- one HF tensor, the same values (reshaped: AttnRes ``query [d]`` <-> ``*_res_proj.weight
  [1, d]``, KDA ``A_log [H]`` <-> Kimi Linear's ``[1, 1, H, 1]``, the vision patch conv ``[D, 3, p, p]``; or padded:
  K3's ``A_log`` is stored zero-padded to ``max(H, head_dim)``);
* :class:`Slice` -- a block of rows (columns) of one HF tensor: the published shared-expert MLP is ONE MLP of
  width ``num_shared_experts * moe_intermediate_size``, k3train's ``shared_experts.{s}`` are its blocks; K3's
  vision ``wqkv`` holds q, k and v (q and k rows interleaved-RoPE ordered: permuted to k3train's rotate-half);
* :class:`PerExpert` -- routed experts one HF tensor per expert, ``nn.Linear``-shaped (``w1`` = gate ``[f, l]``,
  ``w3`` = up, ``w2`` = down ``[l, f]``; k3train stacks them transposed: ``w_gate [E, l, f]``);
* :class:`PerExpertMXFP4` -- the same, compressed-tensors ``mxfp4-pack-quantized``: ``w1.weight_packed [f, l/2]``
  (E2M1 nibbles, uint8) + ``w1.weight_scale [f, l/32]`` (E8M0), decoded by :mod:`k3train.quant.mx` exactly;
* :class:`Fused` -- all experts in one tensor, transformers' in-memory layout ``experts.gate_up_proj [E, 2f, l]``
  (gate rows first) and ``experts.down_proj [E, l, f]`` (read only; exports are per expert, the layout vLLM and
  SGLang load).

Names (``P`` = ``model.`` for ``kimi_linear``, ``language_model.model.`` for ``kimi_k3``; sources followed:
transformers 5.24 ``kimi_linear`` (modeling + its ``conversion_mapping`` entry, i.e. the Hub names), SGLang
``models/kimi_k3.py`` / ``kimi_k3_vl.py`` / ``configs/kimi_k3.py`` and Megatron-Bridge ``kimi_k3_bridge.py``)::

    embed_tokens / norm / lm_head            P embed_tokens.weight, P norm.weight, lm_head.weight (K3:
                                             language_model.lm_head.weight)
    final_attnres.{query, key_norm}          P output_attn_res_proj.weight [1, d], P output_attn_res_norm.weight
    layers.i.attn_res / ffn_res              P layers.i.self_attention_res_{proj,norm}, ...mlp_res_{proj,norm}
    layers.i.attn_norm / ffn_norm            P layers.i.input_layernorm / post_attention_layernorm
    layers.i.attn.X                          P layers.i.self_attn.X (KDA q/k/v_proj, q/k/v_conv1d [C, 1, K],
                                             f_a/f_b_proj, dt_bias, A_log, b_proj, g_proj | g_a/g_b_proj, o_norm,
                                             o_proj; MLA q_proj | q_a_proj q_a_layernorm q_b_proj,
                                             kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj, o_proj)
    layers.i.ffn (dense)                     P layers.i.mlp.{gate,up,down}_proj (transformers' save_pretrained:
                                             block_sparse_moe.{gate,up,down}_proj, read too)
    layers.i.ffn (MoE)                       P layers.i.block_sparse_moe.: gate.weight, gate.e_score_correction_bias
                                             (the balancing bias), routed_expert_{down,up}_proj, routed_expert_norm,
                                             shared_experts.{gate,up,down}_proj, experts.e.w{1,2,3}.weight(_packed
                                             / _scale)
    mtp.*                                    P layers.L.{hnorm, enorm, eh_proj, input_layernorm, self_attn.*,
                                             post_attention_layernorm, block_sparse_moe.*, shared_head.norm} --
                                             DeepSeek-V3's next-n layout (no Kimi checkpoint publishes MTP weights)
    vision.* (kimi_k3)                       vision_tower.patch_embed.proj / .pos_emb.weight, vision_tower.encoder.
                                             blocks.n.{norm0, norm1, wqkv, wo, mlp.fc0, mlp.fc1},
                                             vision_tower.encoder.final_layernorm, mm_projector.{proj.0, proj.2,
                                             post_norm}

A tensor k3train holds and no rule names is a ConfigError (never a silently dropped weight).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from k3train.config import Config, ConfigError
from k3train.hf.config_map import hf_format
from k3train.model.model import K3Model
from k3train.model.moe import GroupedExperts
from k3train.quant.qat import expert_weight_from_mxfp4

# read(key, index) -> the tensor (or the indexed block of it) as stored
Reader = Callable[[str, tuple[slice, ...] | None], torch.Tensor]


@dataclass(frozen=True)
class Part:
    """One stored HF tensor: name, full on-disk shape, kind (``float``; ``e2m1`` packed nibbles and ``e8m0``
    scales: one byte per element, read as uint8)."""

    key: str
    shape: tuple[int, ...]
    kind: str = "float"


class Source:
    """One way a checkpoint stores a k3train tensor. ``parts``: the HF tensors it reads."""

    name = "source"
    parts: tuple[Part, ...] = ()
    writable = True

    def load(self, read: Reader, shape: tuple[int, ...], rows: range | None) -> torch.Tensor:
        """The k3train tensor (``rows``: only these experts of an expert stack) from the checkpoint."""
        raise NotImplementedError

    def dump(self, t: torch.Tensor, offset: int) -> list[tuple[Part, int, int, torch.Tensor]]:
        """``[(part, dim, start, block)]``: what to write for the local tensor ``t`` (experts from ``offset``);
        blocks of one part (``Slice``) are concatenated along ``dim`` by ``start``."""
        raise NotImplementedError


@dataclass
class Whole(Source):
    part: Part
    mode: str = "same"  # "same" | "reshape" | "pad" (1-D, zero tail beyond the k3train length)
    name = "whole"

    @property
    def parts(self) -> tuple[Part, ...]:  # type: ignore[override]
        return (self.part,)

    def load(self, read: Reader, shape: tuple[int, ...], rows: range | None) -> torch.Tensor:
        t = read(self.part.key, None)
        if self.mode == "pad":
            n = shape[0]
            if t.numel() > n and bool((t.reshape(-1)[n:] != 0).any()):
                raise ConfigError(f"checkpoint.load_hf: {self.part.key}: the padding beyond the first {n} entries "
                                  f"must be zero (K3 stores A_log zero-padded)")
            return t.reshape(-1)[:n]
        return t.reshape(shape)

    def dump(self, t: torch.Tensor, offset: int) -> list[tuple[Part, int, int, torch.Tensor]]:
        if self.mode == "pad":
            out = t.new_zeros(self.part.shape)
            out[:t.numel()] = t.reshape(-1)
            return [(self.part, 0, 0, out)]
        return [(self.part, 0, 0, t.reshape(self.part.shape))]


@dataclass
class Slice(Source):
    """``ours = hf.narrow(dim, start, n)`` (rows permuted within each head by ``perm`` [head_dim] when set)."""

    part: Part
    dim: int
    start: int
    perm: torch.Tensor | None = None
    name = "slice"

    @property
    def parts(self) -> tuple[Part, ...]:  # type: ignore[override]
        return (self.part,)

    def load(self, read: Reader, shape: tuple[int, ...], rows: range | None) -> torch.Tensor:
        idx = [slice(None)] * len(self.part.shape)
        idx[self.dim] = slice(self.start, self.start + shape[self.dim])
        t = read(self.part.key, tuple(idx))
        if self.perm is not None:
            dh = self.perm.numel()
            t = t.reshape(-1, dh, *t.shape[1:])[:, self.perm].reshape(t.shape)
        return t

    def dump(self, t: torch.Tensor, offset: int) -> list[tuple[Part, int, int, torch.Tensor]]:
        if self.perm is not None:
            dh = self.perm.numel()
            t = t.reshape(-1, dh, *t.shape[1:])[:, torch.argsort(self.perm)].reshape(t.shape)
        return [(self.part, self.dim, self.start, t)]


@dataclass
class PerExpert(Source):
    """Expert ``e`` is ``parts[e]`` ``[out, in]``; k3train holds ``[E, in, out]``."""

    expert_parts: tuple[Part, ...]
    name = "per_expert"

    @property
    def parts(self) -> tuple[Part, ...]:  # type: ignore[override]
        return self.expert_parts

    def load(self, read: Reader, shape: tuple[int, ...], rows: range | None) -> torch.Tensor:
        rows = rows if rows is not None else range(shape[0])
        return torch.stack([read(self.expert_parts[e].key, None).transpose(0, 1) for e in rows]) if len(rows) \
            else torch.empty(0, *shape[1:])

    def dump(self, t: torch.Tensor, offset: int) -> list[tuple[Part, int, int, torch.Tensor]]:
        return [(self.expert_parts[offset + i], 0, 0, t[i].transpose(0, 1).contiguous()) for i in range(t.shape[0])]


@dataclass
class PerExpertMXFP4(Source):
    """Expert ``e``: ``packed[e] [out, in/2]`` E2M1 pairs + ``scales[e] [out, in/32]`` E8M0 (compressed-tensors
    ``mxfp4-pack-quantized``); decoded exactly (:func:`k3train.quant.qat.expert_weight_from_mxfp4`)."""

    packed: tuple[Part, ...]
    scales: tuple[Part, ...]
    name = "per_expert_mxfp4"

    @property
    def parts(self) -> tuple[Part, ...]:  # type: ignore[override]
        return self.packed + self.scales

    def load_codes(self, read: Reader, rows: range) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed [n, out, in/2], scales [n, out, in/32])`` uint8 of experts ``rows``, as stored."""
        packed = [read(self.packed[e].key, None).view(torch.uint8) for e in rows]
        scales = [read(self.scales[e].key, None).view(torch.uint8) for e in rows]
        p0, s0 = self.packed[0].shape, self.scales[0].shape
        return (torch.stack(packed) if packed else torch.empty(0, *p0, dtype=torch.uint8),
                torch.stack(scales) if scales else torch.empty(0, *s0, dtype=torch.uint8))

    def load(self, read: Reader, shape: tuple[int, ...], rows: range | None) -> torch.Tensor:
        packed, scales = self.load_codes(read, rows if rows is not None else range(shape[0]))
        return expert_weight_from_mxfp4(packed, scales, torch.float32)

    def dump(self, t: torch.Tensor, offset: int) -> list[tuple[Part, int, int, torch.Tensor]]:
        raise RuntimeError("PerExpertMXFP4.dump: the exporter quantizes (k3train/hf/export.py: mxfp4_blocks)")


@dataclass
class Fused(Source):
    """All experts in one tensor ``[E, a, b]``; expert e's k3train block is ``part[e, start:start + n, :]^T``."""

    part: Part
    start: int
    name = "fused"
    writable = False

    @property
    def parts(self) -> tuple[Part, ...]:  # type: ignore[override]
        return (self.part,)

    def load(self, read: Reader, shape: tuple[int, ...], rows: range | None) -> torch.Tensor:
        rows = rows if rows is not None else range(shape[0])
        t = read(self.part.key, (slice(rows.start, rows.stop), slice(self.start, self.start + shape[2]),
                                 slice(None)))
        return t.transpose(1, 2)

    def dump(self, t: torch.Tensor, offset: int) -> list[tuple[Part, int, int, torch.Tensor]]:
        raise RuntimeError("Fused experts are read, never written (exports are per expert)")


@dataclass
class Slot:
    """A k3train tensor: FQN, full shape, whether dim 0 counts routed experts, the ways it may be stored."""

    fqn: str
    shape: tuple[int, ...]
    sources: list[Source]
    expert: bool = False


# ------------------------------------------------------------------------------------------------------------------
def hf_prefix(fmt: str) -> str:
    return "language_model.model." if fmt == "kimi_k3" else "model."


def lm_head_key(fmt: str) -> str:
    return "language_model.lm_head.weight" if fmt == "kimi_k3" else "lm_head.weight"


def _whole(key: str, shape: tuple[int, ...], mode: str = "same") -> list[Source]:
    return [Whole(Part(key, tuple(shape)), mode)]


def _rope_perm(head_dim: int) -> torch.Tensor:
    """Interleaved complex-pair RoPE rows (pair p = rows 2p, 2p+1; SGLang's kimi_k3_vl ``apply_rope``) -> k3train's
    rotate-half rows (pair p = rows p, p + head_dim/2; k3train/model/vit.py), within a head."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _expert_sources(M: str, pname: str, shape: tuple[int, ...]) -> list[Source]:
    E, a, b = shape  # w_gate / w_up: [E, l, f]; w_down: [E, f, l]
    w = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}[pname]
    srcs: list[Source] = [PerExpert(tuple(Part(f"{M}experts.{e}.{w}.weight", (b, a)) for e in range(E)))]
    if a % 32 == 0:
        srcs.append(PerExpertMXFP4(tuple(Part(f"{M}experts.{e}.{w}.weight_packed", (b, a // 2), "e2m1")
                                         for e in range(E)),
                                   tuple(Part(f"{M}experts.{e}.{w}.weight_scale", (b, a // 32), "e8m0")
                                         for e in range(E))))
    for fused_m in (M, M.replace("block_sparse_moe.", "mlp.")):
        if pname == "w_down":
            srcs.append(Fused(Part(f"{fused_m}experts.down_proj", (E, b, a)), 0))
        else:
            srcs.append(Fused(Part(f"{fused_m}experts.gate_up_proj", (E, 2 * b, a)), 0 if pname == "w_gate" else b))
    return srcs


def _ffn_sources(base: str, rest: str, shape: tuple[int, ...], cfg: Config, moe: bool) -> list[Source] | None:
    m = cfg.model
    if not moe:
        mt = re.fullmatch(r"(w_gate|w_up|w_down)\.weight", rest)
        if mt is None:
            return None
        proj = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[mt.group(1)]
        return [Whole(Part(f"{base}mlp.{proj}.weight", shape)),
                Whole(Part(f"{base}block_sparse_moe.{proj}.weight", shape))]
    M = f"{base}block_sparse_moe."
    simple = {"router.weight": "gate.weight", "router.bias": "gate.e_score_correction_bias",
              "latent_down.weight": "routed_expert_down_proj.weight", "latent_norm.weight": "routed_expert_norm.weight",
              "latent_up.weight": "routed_expert_up_proj.weight"}
    if rest in simple:
        return _whole(M + simple[rest], shape)
    mt = re.fullmatch(r"shared_experts\.(\d+)\.(w_gate|w_up|w_down)\.weight", rest)
    if mt is not None:
        s, f, n, d = int(mt.group(1)), m.shared_expert_intermediate_size, m.num_shared_experts, m.hidden_size
        if mt.group(2) == "w_down":
            return [Slice(Part(f"{M}shared_experts.down_proj.weight", (d, n * f)), 1, s * f)]
        proj = "gate_proj" if mt.group(2) == "w_gate" else "up_proj"
        return [Slice(Part(f"{M}shared_experts.{proj}.weight", (n * f, d)), 0, s * f)]
    mt = re.fullmatch(r"experts\.(w_gate|w_up|w_down)", rest)
    if mt is not None:
        return _expert_sources(M, mt.group(1), shape)
    return None


def _attn_sources(base: str, rest: str, shape: tuple[int, ...], cfg: Config, fmt: str) -> list[Source]:
    key = f"{base}self_attn.{rest}"
    if rest == "A_log":
        H, K = cfg.model.kda_num_heads, cfg.model.kda_head_dim
        padded = Whole(Part(key, (max(H, K),)), "pad")
        four_d = Whole(Part(key, (1, 1, H, 1)), "reshape")
        flat = Whole(Part(key, (H,)), "same")
        alts = [padded, four_d] if fmt == "kimi_k3" else [four_d, padded]
        return alts + ([flat] if max(H, K) != H else [])
    return _whole(key, shape)


def _layer_sources(base: str, rest: str, shape: tuple[int, ...], cfg: Config, fmt: str,
                   moe: bool) -> list[Source] | None:
    d = cfg.model.hidden_size
    fixed = {"attn_res.query": ("self_attention_res_proj.weight", (1, d), "reshape"),
             "attn_res.key_norm.weight": ("self_attention_res_norm.weight", shape, "same"),
             "ffn_res.query": ("mlp_res_proj.weight", (1, d), "reshape"),
             "ffn_res.key_norm.weight": ("mlp_res_norm.weight", shape, "same"),
             "attn_norm.weight": ("input_layernorm.weight", shape, "same"),
             "ffn_norm.weight": ("post_attention_layernorm.weight", shape, "same")}
    if rest in fixed:
        name, hf_shape, mode = fixed[rest]
        return _whole(base + name, hf_shape, mode)
    if rest.startswith("attn."):
        return _attn_sources(base, rest[len("attn."):], shape, cfg, fmt)
    if rest.startswith("ffn."):
        return _ffn_sources(base, rest[len("ffn."):], shape, cfg, moe)
    return None


def _vision_sources(rest: str, shape: tuple[int, ...], cfg: Config) -> list[Source] | None:
    v = cfg.vision
    if rest == "encoder.patch_embed.weight":
        return _whole("vision_tower.patch_embed.proj.weight", (shape[0], 3, v.patch_size, v.patch_size), "reshape")
    simple = {"encoder.patch_embed.bias": "vision_tower.patch_embed.proj.bias",
              "encoder.pos_embed.weight": "vision_tower.patch_embed.pos_emb.weight"}
    if rest in simple:
        return _whole(simple[rest], shape)
    mt = re.fullmatch(r"encoder\.final_norm\.(weight|bias)", rest)
    if mt:
        return _whole(f"vision_tower.encoder.final_layernorm.{mt.group(1)}", shape)
    mt = re.fullmatch(r"projector\.(in_proj|out_proj|norm)\.(weight|bias)", rest)
    if mt:
        name = {"in_proj": "proj.0", "out_proj": "proj.2", "norm": "post_norm"}[mt.group(1)]
        return _whole(f"mm_projector.{name}.{mt.group(2)}", shape)
    mt = re.fullmatch(r"encoder\.blocks\.(\d+)\.(.+)\.(weight|bias)", rest)
    if not mt:
        return None
    blk, what, wb = f"vision_tower.encoder.blocks.{mt.group(1)}.", mt.group(2), mt.group(3)
    renames = {"norm1": "norm0", "norm2": "norm1", "attn.o_proj": "wo", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1"}
    if what in renames:
        return _whole(f"{blk}{renames[what]}.{wb}", shape)
    mt2 = re.fullmatch(r"attn\.(q|k|v)_proj", what)
    if mt2:
        inner = v.num_attention_heads * v.head_dim
        which = "qkv".index(mt2.group(1))
        perm = _rope_perm(v.head_dim) if which < 2 else None
        full = (3 * inner, *shape[1:])
        return [Slice(Part(f"{blk}wqkv.{wb}", full), 0, which * inner, perm)]
    return None


def sources_for(fqn: str, shape: tuple[int, ...], cfg: Config) -> list[Source]:
    """The ways a checkpoint of ``cfg``'s format stores k3train tensor ``fqn`` (full ``shape``), the preferred
    (written) one first. ConfigError when no rule names it."""
    fmt = hf_format(cfg)
    P = hf_prefix(fmt)
    m = cfg.model
    srcs: list[Source] | None = None
    if fqn in ("embed_tokens.weight", "norm.weight"):
        srcs = _whole(P + fqn, shape)
    elif fqn == "lm_head.weight":
        srcs = _whole(lm_head_key(fmt), shape)
    elif fqn == "final_attnres.query":
        srcs = _whole(P + "output_attn_res_proj.weight", (1, m.hidden_size), "reshape")
    elif fqn == "final_attnres.key_norm.weight":
        srcs = _whole(P + "output_attn_res_norm.weight", shape)
    elif (mt := re.fullmatch(r"layers\.(\d+)\.(.+)", fqn)) is not None:
        i = int(mt.group(1))
        srcs = _layer_sources(f"{P}layers.{i}.", mt.group(2), shape, cfg, fmt, m.is_moe_layer(i))
    elif fqn.startswith("mtp."):
        base, rest = f"{P}layers.{m.num_hidden_layers}.", fqn[len("mtp."):]
        mtp = {"hnorm.weight": "hnorm.weight", "enorm.weight": "enorm.weight", "eh_proj.weight": "eh_proj.weight",
               "norm.weight": "shared_head.norm.weight"}
        srcs = _whole(base + mtp[rest], shape) if rest in mtp else \
            _layer_sources(base, rest, shape, cfg, fmt, m.is_moe_layer(m.num_hidden_layers - 1))
    elif fqn.startswith("vision.") and fmt == "kimi_k3":
        srcs = _vision_sources(fqn[len("vision."):], shape, cfg)
    if not srcs:
        raise ConfigError(f"k3train tensor {fqn!r} {tuple(shape)} has no Hugging Face name in the {fmt} format "
                          f"(k3train/hf/names.py)")
    return srcs


def model_tensors(cfg: Config) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(fqn, full shape, is a routed-expert stack)`` of everything a K3Model of ``cfg`` saves (parameters and
    persistent buffers), from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = K3Model(cfg.model, cfg.vision)
    experts = {f"{n}.{p}" for n, mod in model.named_modules() if isinstance(mod, GroupedExperts)
               for p in ("w_gate", "w_up", "w_down")}
    return [(k, tuple(t.shape), k in experts) for k, t in model.state_dict(keep_vars=True).items()]


def model_slots(cfg: Config) -> list[Slot]:
    """Every tensor of ``cfg``'s model with its HF sources."""
    return [Slot(fqn, shape, sources_for(fqn, shape, cfg), expert) for fqn, shape, expert in model_tensors(cfg)]
