"""Multimodal training through the real trainer step: ``configs/tiny-vl.yaml`` (the tiny K3 + a 2-block
MoonViT-V2 and its projector, on the shipped multimodal corpus) at pp = 2 x vpp = 2, dp = 2 (ZeRO-2) and cp = 2
(ZeRO-1) equals the single process, step by step: the loss, the grad norm, EVERY parameter gradient the optimizer
steps with (encoder and projector included) and the parameters after the step. Then a resume with images: the
dp = 2 run's checkpoint after step 1, resumed at cp = 2, gives step 2 exactly.

What the global batches hold (checked first, so the comparison covers it): step 1 has a micro-batch with two
images of different sizes and micro-batches without any media (the encoder still runs, on zero patches, on every
rank); under cp = 2 its second image lies in the second half of the row, so rank 1 must place the embeddings from
offset 24 on; step 2 has a 4-frame clip whose placeholder span the cp boundary cuts. Under pp the encoder runs
as actions of its own in the pipeline's bubbles (``parallel.encoder_schedule``, the default), before / after the
pipeline (with Pipeline ZeRO-2, whose chunk hook must wait for the last encoder backward) or inline, inside the
first virtual stage's forward and backward; under cp = 2 with
``vision.cp_split_min_patches=90`` the media of >= 90 patches (a 96- and a 192-patch image, the 144-patch clip) are
split over the 2 CP ranks by pairs of patch rows (attention all-gathers their k / v), the others are encoded whole
by one rank, and the embeddings are all-gathered (kcp/vision_cp.py); the resume at cp = 2 (default threshold
4096) encodes every media whole on one rank. Each rank scatters only its slice's embeddings, and the dp_cp
gradient reduction sums the ranks' encoder gradients.

Tolerances (as tests/integration/test_pipeline_zero_parity.py, which explains them): gradients 3e-6 (step 1) /
1e-4 (step 2) of each tensor's max |value| + rtol 1e-5; loss and grad norm rel 1e-5; parameters 1e-5 + rtol 1e-5,
AdamW-stepped ones (embeddings, norms, the encoder's position tables) 1e-3 (a third of one step's lr: the update
of an entry with a near-zero gradient is ill-conditioned; a wrong gradient is caught by the gradient check).
Measured: gradients <= 2.2e-6 (step 1) / 6.0e-5 (step 2: a backbone AttnRes key norm under cp; 1.2e-4 on an AMD EPYC
AVX2 host, 2026-12-05) of their scale,
parameters <= 3.5e-6; run time ~22 s on 2 loaded cores.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from shipped_data import shipped_view
from trainer_parity import ROOT, assert_close_all, max_diffs, owned_grads, snapshot

WORLD, STEPS, SEQ_LEN, GBS, MBS = 2, 2, 128, 4, 1
PH = 4096  # <|media_pad|>
SCALE_TOL = {0: 3e-6, 1: 3e-4}
SPLIT_MIN = 90  # cp2_zero1: media of >= 90 patches split over the 2 CP ranks (kcp/vision_cp.py), the rest whole
RTOL, ATOL, ADAMW_ATOL = 1e-5, 1e-5, 1e-3
LAYOUTS = [  # (name, --parallel.* overrides); the 2 ranks run them one after another
    ("pp2_vpp2", ["--parallel.pp=2", "--parallel.vpp=2"]),  # the encoder in the pipeline's bubbles (default)
    ("pp2_zero2_before", ["--parallel.pp=2", "--parallel.zero=2", "--parallel.encoder_schedule=before"]),
    ("pp2_inline", ["--parallel.pp=2", "--parallel.encoder_schedule=inline"]),
    ("dp2_zero2", ["--parallel.zero=2"]),
    ("cp2_zero1", ["--parallel.cp=2", "--parallel.zero=1", f"--vision.cp_split_min_patches={SPLIT_MIN}"]),
]


@pytest.fixture(scope="module")
def mm_prefix(tmp_path_factory) -> Path:
    """The shipped multimodal corpus (``make data-mm``), or the same corpus built here when it is missing."""
    built = shipped_view("mm")
    if built is not None:
        return built
    from k3train.data.multimodal.prepare import prepare_multimodal
    from k3train.data.multimodal.shipped import build_shipped_shards
    from k3train.data.multimodal.vl_tokenizer import VL_SPECIAL, VL_TOKENIZER
    from k3train.data.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("mm")
    build_shipped_shards(d / "wds")
    prepare_multimodal(d / "wds", load_tokenizer(VL_TOKENIZER, VL_SPECIAL), d / "mm")
    return d / "mm"


def vl_cfg(prefix: str, out_dir: Path, world: int, layout: list[str], resume: str = "none"):
    from k3train.config import load_config

    over = [f"--data.path={prefix}", "--data.split=100,0,0", f"--train.seq_len={SEQ_LEN}",
            f"--train.global_batch_size={GBS}", f"--train.micro_batch_size={MBS}", f"--train.steps={STEPS}",
            "--train.device=cpu", "--train.dtype=float32", f"--train.out_dir={out_dir}", "--optim.warmup_steps=1",
            "--logging.wandb=false", "--logging.peak_flops=1e9", "--logging.level=WARNING",
            f"--checkpoint.resume={resume}", "--checkpoint.interval=0", *layout]
    return load_config(ROOT / "configs" / "tiny-vl.yaml", over, world_size=world)


def _check_coverage(cfg) -> None:
    """The global batches hold what the module docstring says (else the comparison would not test it)."""
    from k3train.data import GlobalBatchLoader

    loader = GlobalBatchLoader(cfg)
    step1, step2 = loader.next_step(), loader.next_step()
    sizes = {tuple(g) for mb in step1 for g in mb.media.grid_thw.tolist()}
    assert len(sizes) >= 2 and any(mb.media.num_media == 0 for mb in step1), sizes
    assert any(mb.media.num_media >= 2 for mb in step1)
    assert max(int(mb.slice_cp(1, 2).media_offsets.max()) for mb in step1) > 0  # rank 1 starts past a media
    half = SEQ_LEN // 2
    cut = [mb for mb in step2 if bool((mb.tokens[:, half - 1] == PH).any() & (mb.tokens[:, half] == PH).any())]
    assert cut and any(mb.media.grid_thw[:, 0].max() > 1 for mb in cut), "step 2: no clip span cut by cp = 2"
    from kcp.vision_cp import plan_vision_split

    plans = [plan_vision_split(mb.media.grid_thw.tolist(), 2, SPLIT_MIN) for mb in step1 + step2]
    assert any(any(p.split) and not all(p.split) for p in plans), "no micro-batch with a split and a whole media"
    assert any(p.split[i] and p.grids[i][0] > 1 for p in plans for i in range(len(p.grids))), "no split clip"
    for mb in step1 + step2:  # the slices' placeholders take exactly the micro-batch's embeddings
        a, b = mb.slice_cp(0, 2), mb.slice_cp(1, 2)
        assert torch.equal(b.media_offsets, a.media_offsets + (a.tokens == PH).sum(1))
        assert int(b.media_offsets[-1]) + int((b.tokens[-1] == PH).sum()) == mb.media.num_tokens()


def _param_check(tr, ref: dict, what: str) -> float:
    worst = 0.0
    for k, v in tr.pm.model.named_parameters():
        want = ref["params"][k]
        atol = ADAMW_ATOL if k + ".exp_avg_sq" in ref["optim"] else ATOL
        torch.testing.assert_close(v.detach(), want, atol=atol, rtol=RTOL, msg=lambda m, k=k: f"{what} {k}: {m}")
        worst = max(worst, float((v.detach() - want).abs().max()) if v.numel() else 0.0)
    return worst


def _compare(tr, rec: dict, ref: dict, rank: int, step: int, name: str) -> dict:
    what = f"rank {rank} {name} step {step + 1}:"
    grads = owned_grads(tr)
    assert_close_all(grads, ref["grads"], 0.0, RTOL, what + " grad", scale_atol=SCALE_TOL[step])
    assert math.isclose(rec["loss"], ref["loss"], rel_tol=1e-5), (what, rec["loss"], ref["loss"])
    assert math.isclose(rec["grad_norm"], ref["grad_norm"], rel_tol=1e-5), (what, rec["grad_norm"], ref["grad_norm"])
    params = _param_check(tr, ref, what + " parameter")
    rel = {k: max_diffs({k: v}, ref["grads"])[1] for k, v in grads.items()}
    worst = max(rel, key=rel.get)
    return {"grad_names": sorted(grads), "param_names": sorted(n for n, _ in tr.pm.model.named_parameters()),
            "loss": rec["loss"], "grads_rel": rel[worst], "worst_grad": worst, "params": params}


def _gather_check(mine: dict, ref: dict, rank: int, name: str, step: int, report: list) -> None:
    """Rank 0: the ranks' gradients and parameters together cover the whole model (vision included)."""
    every = [None] * WORLD
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    assert set().union(*(d["grad_names"] for d in every)) == set(ref["grads"]), f"{name}: gradients not covered"
    assert set().union(*(d["param_names"] for d in every)) == set(ref["params"]), f"{name}: parameters not held"
    worst = max(every, key=lambda d: d["grads_rel"])
    report.append({"layout": name, "step": step + 1, "loss": every[0]["loss"], "grads_rel": worst["grads_rel"],
                   "worst_grad": worst["worst_grad"], "params": max(d["params"] for d in every)})


def _body(rank: int, world: int, prefix: str, ref_path: str, out: str) -> None:
    from k3train.trainer import Trainer

    from kcp.vision_cp import VisionCPContext

    refs, out, report = torch.load(ref_path), Path(out), []
    exchanges = []  # the cp layout's encoder really splits media: its attention exchanges k / v (kcp/vision_cp.py)
    kv = VisionCPContext.exchange_kv
    VisionCPContext.exchange_kv = lambda self, k, v: (exchanges.append(name), kv(self, k, v))[1]
    for name, layout in LAYOUTS:
        tr = Trainer(vl_cfg(prefix, out / name, WORLD, layout))
        vision = [i for i in tr.optimizer.infos if i.fqn.startswith("vision.")]
        assert bool(vision) == (not name.startswith("pp") or tr.dims.pp_rank == 0), f"{name}: the encoder's stage"
        for i in vision:  # Per-Head Muon on the encoder's q/k/v projections, over dp_cp like the other dense params
            assert i.group == "dp_cp", (i.fqn, i.group)
            if i.fqn.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                assert (i.kind, i.layout) == ("muon", "per_head"), (i.fqn, i.kind, i.layout)
        for s in range(STEPS):
            rec = tr.train_step()
            if name.startswith("pp") and tr.dims.pp_rank == 0:  # the encoder ran as its own actions (or inline)
                assert (tr.pm.runner.last_stats["encoder_s"] > 0) == (not name.endswith("inline")), name
            _gather_check(_compare(tr, rec, refs[s], rank, s, name), refs[s], rank, name, s, report)
            if name == "dp2_zero2" and s == 0:
                tr.save_checkpoint()
        tr.ckpt.wait()
        tr.metrics.close()
        assert (name in exchanges) == name.startswith("cp"), (name, len(exchanges))
    # resume with images: the dp = 2 run's step-1 checkpoint, continued at cp = 2
    tr = Trainer(vl_cfg(prefix, out / "dp2_zero2", WORLD, ["--parallel.cp=2"], resume="auto"))
    assert tr.step == 1, tr.step
    rec = tr.train_step()
    _gather_check(_compare(tr, rec, refs[1], rank, 1, "resume_dp2_to_cp2"), refs[1], rank, "resume_dp2_to_cp2", 1,
                  report)
    tr.metrics.close()
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))


def test_tiny_vl_parallel_layouts_equal_single_process(mm_prefix: Path, tmp_path: Path) -> None:
    from k3train.trainer import Trainer

    cfg = vl_cfg(str(mm_prefix), tmp_path / "ref", 1, [])
    _check_coverage(cfg)
    tr = Trainer(cfg)
    try:
        refs = [snapshot(tr, tr.train_step()) for _ in range(STEPS)]
    finally:
        tr.metrics.close()
    for r in refs:  # the encoder and projector learn from the images: real, non-zero gradients
        assert all(float(r["grads"][k].abs().max()) > 0 for k in r["grads"] if k.startswith("vision.")), r["grads"]
    assert any(k.startswith("vision.encoder.blocks.1.") for k in refs[0]["grads"])
    torch.save(refs, tmp_path / "ref.pt")
    run_distributed(_body, WORLD, str(mm_prefix), str(tmp_path / "ref.pt"), str(tmp_path), timeout=600)
    report = json.loads((tmp_path / "report.json").read_text())
    for r in report:
        print(r)
    assert {r["layout"] for r in report} == {n for n, _ in LAYOUTS} | {"resume_dp2_to_cp2"}


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_slices_place_exactly_the_full_rows_media(mm_prefix: Path, tmp_path: Path, cp: int) -> None:
    """Model level, one process: the CP slices' first-stage embeddings (each slice encodes every media and keeps
    its own placeholders' rows, ``Batch.media_offsets``) concatenated along the sequence equal the full rows', and
    the slices' encoder gradients summed equal the full rows' -- with spans cut by the slice boundaries."""
    from k3train.data import GlobalBatchLoader
    from k3train.model.model import K3Model

    cfg = vl_cfg(str(mm_prefix), tmp_path, 1, ["--train.micro_batch_size=2"])
    model = K3Model(cfg.model, cfg.vision)
    model.init_weights(cfg.train.seed)
    loader = GlobalBatchLoader(cfg)
    batches = loader.next_step() + loader.next_step()
    cut = 0
    for mb in batches:
        weight = torch.randn(*mb.tokens.shape, cfg.model.hidden_size,
                             generator=torch.Generator().manual_seed(0))
        full = model.embed_batch(mb).blocks[0]
        model.zero_grad()
        (full * weight).sum().backward()
        want = {n: p.grad.clone() for n, p in model.vision.named_parameters()}
        model.zero_grad()
        n = SEQ_LEN // cp
        parts = []
        for r in range(cp):
            emb = model.embed_batch(mb.slice_cp(r, cp)).blocks[0]
            (emb * weight[:, r * n:(r + 1) * n]).sum().backward()
            parts.append(emb.detach())
        torch.testing.assert_close(torch.cat(parts, dim=1), full.detach(), atol=0, rtol=0)  # the same encoder
        for name, p in model.vision.named_parameters():  # fp32 summation order only
            torch.testing.assert_close(p.grad, want[name], atol=1e-6 * float(want[name].abs().max()), rtol=1e-5,
                                       msg=lambda m, k=name: f"{k}: {m}")
        ph = mb.tokens == PH
        cut += int(sum(bool((ph[:, r * n - 1] & ph[:, r * n]).any()) for r in range(1, cp)))
    assert cut > 0, "no media span crosses a slice boundary"
