#!/usr/bin/env python
"""Count a config's parameters: total and active per token, by component, from the real model on the meta device.

    python tools/count_params.py --config configs/k3.yaml [--json] [--model.key=value ...]

``total`` / ``active`` are the BACKBONE (excluding the MTP layer and the vision tower, as the published
2.78T / 104.2B); ``active`` leaves out the input embedding (a lookup) and counts k/E of the routed experts.
The MTP layer, the MoonViT-V2 encoder (``vision``) and its projector (``projector``) are listed separately; with
``vision.enabled`` the tokens and the forward / backward FLOPs (patch embedding, attention projections, the
quadratic attention term, MLP, merge, projector) of one image at the seed's three resolutions follow.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3train.model import K3Model, param_breakdown  # noqa: E402
from k3train.model.flops import model_flops_per_token, vision_flops, vision_flops_detail  # noqa: E402
from k3train.model.media import merged_tokens, patch_grid  # noqa: E402
from k3train.preflight import validate_run  # noqa: E402
from k3train.runtime.bad_input import is_bad_input, report_bad_input  # noqa: E402

IMAGE_SIDES_PX = (448, 1792, 3584)  # seed 000's token table

def count(config: str, overrides: list[str] | None = None) -> dict:
    """Build the model on the meta device and return :func:`param_breakdown` plus FLOPs per token. The config
    goes through the same validation as a training run (no data or machine checks: nothing is trained)."""
    cfg = validate_run(config, overrides or [], for_training=False)
    with torch.device("meta"):
        model = K3Model(cfg.model, cfg.vision)
    out = param_breakdown(model, cfg.model)
    v = cfg.vision
    out["vision_per_image"] = [] if not v.enabled else [
        {"pixels": side, "grid": g, "tokens": merged_tokens(*g, merge=v.merge_size),
         "encoder_forward_flops": vision_flops(g, v, cfg.model.hidden_size, projector=False),
         "forward_flops": vision_flops(g, v, cfg.model.hidden_size),
         "flops": vision_flops_detail(g, v, cfg.model.hidden_size)}
        for side in IMAGE_SIDES_PX for g in [list(patch_grid(side, side, 1, v.patch_size, v.merge_size))]]
    out["config"] = config
    out["flops_per_token_train"] = model_flops_per_token(cfg.model, cfg.train.seq_len)
    out["seq_len"] = cfg.train.seq_len
    return out


def _fmt(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.3f}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args, overrides = ap.parse_known_args(argv)
    try:
        res = count(args.config, overrides)
    except Exception as e:
        if not is_bad_input(e):
            raise
        return report_bad_input(e)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['config']}: total {_fmt(res['total'])} ({res['total']:,}), active {_fmt(res['active'])} "
          f"({res['active']:,}) per token  [backbone; excluding MTP and vision; embedding not active]")
    notes = {"mtp": "  (not in total: MTP)", "vision": "  (not in total: MoonViT-V2 encoder)",
             "projector": "  (not in total: vision projector)"}
    print(f"{'component':<16}{'total':>22}{'active':>22}")
    for name, c in res["breakdown"].items():
        note = notes.get(name, "")
        print(f"{name:<16}{c['total']:>22,}{c['active']:>22,}{note}")
    print(f"with MTP: {_fmt(res['total_with_mtp'])}; training FLOPs/token at seq_len {res['seq_len']}: "
          f"{res['flops_per_token_train']:.4g}")
    if res["vision_per_image"]:
        parts = list(res["vision_per_image"][0]["flops"])
        print("vision tower per image (k3train/model/flops.py: vision_flops_detail; FLOPs forward / backward):")
        print(f"{'image px':>10} {'patches':>8} {'tokens':>7}  " + " ".join(f"{p:>19}" for p in parts))
        for im in res["vision_per_image"]:
            t, h, w = im["grid"]
            print(f"{str(im['pixels']) + 'x' + str(im['pixels']):>10} {t * h * w:>8,} {im['tokens']:>7,}  "
                  + " ".join(f"{im['flops'][p]['forward']:>9.3g}/{im['flops'][p]['backward']:<9.3g}"
                             for p in parts).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
