"""Write a model in the published Hugging Face layout: sharded safetensors, ``model.safetensors.index.json`` and a
``config.json`` in the published field names -- every rank its own tensors, nothing gathered on one rank.

What each rank writes (:func:`write_hf_shards`): the tensors of the parameters it holds (its pipeline stage, its
routed-expert shard), each tensor by exactly one of the ranks holding a copy (data/context-parallel replicas of
a stage split the dense tensors round-robin; the ``edp`` replicas of an expert shard split its stacks), converted
to the published names and shapes (k3train/hf/names.py): routed experts per expert (``experts.e.w1/w2/w3``, the
layout vLLM and SGLang load), in bf16 or -- ``experts="mxfp4"`` -- compressed-tensors ``mxfp4-pack-quantized``
(``weight_packed`` + ``weight_scale``). Shards of at most ``max_shard_bytes`` are written under temporary names;
one ``all_gather_object`` of the (name, bytes) lists numbers them ``model-00001-of-000NN.safetensors`` across all
ranks, and rank 0 writes the index (``metadata.total_size``) and ``config.json`` last.

Exporting a run that started from a Hugging Face checkpoint (``checkpoint.load_hf``) follows that checkpoint:
each tensor under the name variant and dtype the source used (transformers' ``save_pretrained`` writes a dense
first layer as ``block_sparse_moe.*_proj``), MXFP4 experts reusing the source's scales and codes for every block
whose values did not change (k3train/quant/qat.py: ``expert_weight_to_mxfp4(like=...)``), and the source's other
files (tokenizer, generation config) copied. An unchanged import is written back bit for bit.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from k3train.config import Config, ConfigError
from k3train.hf.config_map import config_json_from_config, read_config_json
from k3train.hf.load import _peak_rss_gib, choose_source
from k3train.hf.names import Part, PerExpert, PerExpertMXFP4, Slot, Source, model_slots
from k3train.hf.safetensors_dir import INDEX, HFCheckpointDir
from k3train.quant.qat import expert_weight_to_mxfp4

log = logging.getLogger(__name__)

EXPERT_FORMATS = ("auto", "bf16", "mxfp4")
# kept in fp32 in a fresh export (transformers' _keep_in_fp32_modules_strict, SGLang's fp32 conv / A_log / dt_bias)
FP32_KEYS = re.compile(r"(A_log|dt_bias|conv1d\.weight|\.gate\.weight|e_score_correction_bias)$")
SOURCE_FILES_SKIPPED = re.compile(r"(\.safetensors|\.safetensors\.index\.json|^config\.json|\.bin|\.pt|\.pth)$")
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
          "U8": torch.uint8, "I8": torch.int8, "F8_E8M0": torch.float8_e8m0fnu}


def mxfp4_quantization_config(ignore: list[str] | None = None) -> dict[str, Any]:
    """compressed-tensors ``quantization_config`` of routed experts in ``mxfp4-pack-quantized`` (E2M1 weights,
    one E8M0 scale per group of 32 along the input dim, weight-only)."""
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None, "output_activations": None}},
            "ignore": ignore or []}


class _Writer:
    """Accumulates ``(key, tensor)`` and cuts shard files of at most ``max_bytes`` under temporary names."""

    def __init__(self, out_dir: Path, rank: int, max_bytes: int) -> None:
        self.out_dir, self.rank, self.max_bytes = out_dir, rank, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str], int]] = []  # (temporary name, keys, bytes)
        self.bytes_written = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self.flush()
        self.pending[key] = t.detach().to("cpu").contiguous()
        self.pending_bytes += n

    def flush(self) -> None:
        if not self.pending:
            return
        name = f".rank{self.rank:05d}-{len(self.files):05d}.safetensors.part"
        save_file(self.pending, str(self.out_dir / name), metadata={"format": "pt"})
        self.files.append((name, sorted(self.pending), self.pending_bytes))
        self.bytes_written += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0


def _writes(group: str, holders: int, my_index: int) -> bool:
    """Whether this replica (``my_index`` of ``holders`` ranks holding the same tensors) writes ``group`` (an HF
    tensor name: every k3train tensor that makes up one HF tensor goes to the same writer)."""
    return holders <= 1 or zlib.crc32(group.encode()) % holders == my_index


def _target_dtype(part: Part, source: HFCheckpointDir | None, dtype: torch.dtype) -> torch.dtype:
    if source is not None and part.key in source.tensors:
        return DTYPES[source.tensors[part.key].dtype]
    return torch.float32 if FP32_KEYS.search(part.key) else dtype


def _expert_source(slot: Slot, src: Source | None, experts: str) -> Source:
    """The per-expert source to write an expert stack with (a fused source is written per expert)."""
    per = next(s for s in slot.sources if isinstance(s, PerExpert))
    mx = next((s for s in slot.sources if isinstance(s, PerExpertMXFP4)), None)
    if experts == "mxfp4":
        if mx is None:
            raise ConfigError(f"export-hf: --experts mxfp4: {slot.fqn} has a reduction width that is not a "
                              f"multiple of 32")
        return mx
    if experts == "bf16":
        return per
    return mx if isinstance(src, PerExpertMXFP4) else per


def _slot_pieces(slot: Slot, src: Source, t: torch.Tensor, offset: int, source: HFCheckpointDir | None,
                 source_src: Source | None) -> list[tuple[Part, int, int, torch.Tensor]]:
    if isinstance(src, PerExpertMXFP4):
        rows = range(offset, offset + t.shape[0])
        like = source_src.load_codes(source.read, rows) if isinstance(source_src, PerExpertMXFP4) else None
        packed, scales = expert_weight_to_mxfp4(t.float(), like)
        return ([(src.packed[offset + i], 0, 0, packed[i]) for i in range(t.shape[0])]
                + [(src.scales[offset + i], 0, 0, scales[i]) for i in range(t.shape[0])])
    return src.dump(t, offset)


@dataclass(frozen=True)
class _Share:
    """What this rank writes, and in which form: the model's slots by k3train name, the parameters another rank
    writes, the ranks holding a copy of a dense tensor / of an expert shard and this rank's index among them, the
    imported checkpoint (None: a fresh export), the expert format and the float dtype."""

    slots: dict[str, Slot]
    skip_ids: set[int]
    dense: tuple[int, int]  # (holders, my index): the dp * cp replicas of a stage
    edp: tuple[int, int]  # (holders, my index): the edp replicas of an expert shard
    source: HFCheckpointDir | None
    experts: str
    dtype: torch.dtype

    def writes(self, slot: Slot) -> bool:
        """Whether this rank is the one of the slot's holders that writes it."""
        group = slot.sources[0].parts[0].key
        return _writes(group, *self.edp) if slot.expert else _writes(group, *self.dense)

    def write_source(self, slot: Slot) -> tuple[Source, Source | None]:
        """The source (names, shapes, format) to write the slot with, and the imported checkpoint's source of it
        (None when there is none or it does not hold the slot)."""
        source_src = None
        if self.source is not None:
            try:
                source_src = choose_source(slot, self.source.tensors, "export-hf: source checkpoint")
            except ConfigError:
                source_src = None
        src = _expert_source(slot, source_src, self.experts) if slot.expert else (source_src or slot.sources[0])
        if not src.writable:
            src = slot.sources[0]
        return src, source_src


def _share(cfg: Config, dims: Any, skip: Iterable[nn.Parameter], source: HFCheckpointDir | None, experts: str,
           dtype: torch.dtype) -> _Share:
    dense = (dims.dp * dims.cp, dims.dpcp_rank) if dims is not None else (1, 0)
    edp_holders = (dims.dp * dims.cp) // dims.ep if dims is not None else 1
    edp_me = dims.edp_rank if dims is not None else 0
    return _Share({s.fqn: s for s in model_slots(cfg)}, {id(p) for p in skip}, dense, (edp_holders, edp_me), source,
                  experts, dtype)


def _add_piece(writer: _Writer, partial: dict[str, list[tuple[int, int, torch.Tensor]]], part: Part, pdim: int,
               start: int, block: torch.Tensor, share: _Share) -> None:
    """One piece of an HF tensor, in its target dtype: written when it is the whole tensor, else kept in
    ``partial`` until every block of the split tensor is here, then joined and written."""
    if part.kind == "float":
        block = block.to(_target_dtype(part, share.source, share.dtype))
    else:
        want = _target_dtype(part, share.source, torch.uint8)
        block = block.view(want) if want != torch.uint8 else block
    if tuple(block.shape) == part.shape:
        writer.add(part.key, block)
        return
    got = partial.setdefault(part.key, [])
    got.append((pdim, start, block))
    if sum(b.shape[pdim] for _, _, b in got) == part.shape[pdim]:  # every block of a split tensor
        got.sort(key=lambda x: x[1])
        writer.add(part.key, torch.cat([b for _, _, b in got], dim=pdim))
        del partial[part.key]


def _write_module(mod: nn.Module, writer: _Writer, share: _Share) -> bool:
    """This rank's share of one module's tensors, to ``writer``; whether an MXFP4 expert source was used."""
    mx_used = False
    items = sorted(mod.state_dict(keep_vars=True).items())
    partial: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for fqn, t in items:
        slot = share.slots[fqn]
        if id(t) in share.skip_ids:
            continue
        if not share.writes(slot):
            continue
        src, source_src = share.write_source(slot)
        mx_used |= isinstance(src, PerExpertMXFP4)
        offset = int(getattr(t, "_k3_shard_offset", 0)) if slot.expert else 0
        for part, pdim, start, block in _slot_pieces(slot, src, t.detach(), offset, share.source, source_src):
            _add_piece(writer, partial, part, pdim, start, block, share)
    if partial:
        raise RuntimeError(f"export-hf: tensors {sorted(partial)} were only partly held by this rank")
    return mx_used


def _number_shards(writer: _Writer, out_dir: Path, rank: int, world: int
                   ) -> tuple[list[tuple[int, str, list[str], int]], dict[tuple[int, str], str]]:
    """Every rank's shard files (one all_gather_object), numbered ``model-0000i-of-0000N`` across the ranks; this
    rank's renamed to their final names. Returns ``[(rank, temporary name, keys, bytes)]`` and the final names."""
    files = [(rank, name, keys, n) for name, keys, n in writer.files]
    every = [files]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, files)
    flat = [f for part in every for f in part]
    total = len(flat)
    final = {(r, name): f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, (r, name, _, _) in enumerate(flat)}
    for name, _, _ in writer.files:
        os.replace(out_dir / name, out_dir / final[(rank, name)])
    if world > 1:
        dist.barrier()
    return flat, final


def _write_index_and_config(cfg: Config, out_dir: Path, flat: list[tuple[int, str, list[str], int]],
                            final: dict[tuple[int, str], str], source: HFCheckpointDir | None,
                            source_dir: str | Path | None, mx_used: bool) -> None:
    """Rank 0: ``config.json`` (the source's other files copied), then the index, last (its presence = export
    complete)."""
    weight_map = {k: final[(r, name)] for r, name, keys, _ in flat for k in keys}
    if len(weight_map) != sum(len(keys) for _, _, keys, _ in flat):
        raise RuntimeError("export-hf: a tensor was written by two ranks")
    index = {"metadata": {"total_size": sum(n for *_, n in flat)},
             "weight_map": dict(sorted(weight_map.items()))}
    src_cj = read_config_json(source_dir, "export-hf: source checkpoint") if source is not None else None
    quant = None
    if mx_used:
        quant = (src_cj or {}).get("quantization_config") or \
            ((src_cj or {}).get("text_config") or {}).get("quantization_config") or mxfp4_quantization_config()
    cj = config_json_from_config(cfg, src_cj, quant)
    if source is not None:  # tokenizer, generation config, remote code: as the source has them
        for f in sorted(Path(source_dir).iterdir()):
            if f.is_file() and not SOURCE_FILES_SKIPPED.search(f.name):
                shutil.copy2(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")  # last: its presence = export complete


@torch.no_grad()
def write_hf_shards(modules: Iterable[nn.Module], cfg: Config, out_dir: str | Path, *, dims: Any = None,
                    skip: Iterable[nn.Parameter] = (), experts: str = "auto", dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int = 5 * 2 ** 30, source_dir: str | Path | None = None) -> dict[str, Any]:
    """Write this rank's share of the model in ``modules`` to ``out_dir`` (module docstring). Collective over the
    world when torch.distributed is initialised (one all_gather_object; ranks then wait for rank 0's index).
    ``dims``: the run's ParallelDims (None: one process holds everything). ``skip``: parameters another rank
    writes (the last stage's copy of the MTP-shared embedding). ``source_dir``: the imported checkpoint
    (default ``checkpoint.load_hf`` when it exists). Returns this rank's statistics."""
    t0 = time.perf_counter()
    if experts not in EXPERT_FORMATS:
        raise ConfigError(f"export-hf: --experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts!r}")
    out_dir = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    source_dir = source_dir if source_dir is not None else (cfg.checkpoint.load_hf or None)
    source = HFCheckpointDir(source_dir, "export-hf: source checkpoint") \
        if source_dir and Path(source_dir).is_dir() else None
    share = _share(cfg, dims, skip, source, experts, dtype)
    writer = _Writer(out_dir, rank, max_shard_bytes)
    mx_used = False
    for mod in modules:
        mx_used |= _write_module(mod, writer, share)
    writer.flush()
    flat, final = _number_shards(writer, out_dir, rank, world)
    if rank == 0:
        _write_index_and_config(cfg, out_dir, flat, final, source, source_dir, mx_used)
    if world > 1:
        dist.barrier()
    stats = {"files": len(writer.files), "bytes_written": writer.bytes_written,
             "bytes_read_source": source.bytes_read if source is not None else 0,
             "seconds": time.perf_counter() - t0, "peak_rss_gib": _peak_rss_gib()}
    if source is not None:
        source.close()
    return stats


def check_output_dir(out_dir: str | Path) -> Path:
    """The export's directory must be new or empty (an export never overwrites or mixes with other files)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export-hf: -o {out} exists and is not an empty directory (an export never overwrites)")
    return out
