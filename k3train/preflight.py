"""Every check that runs before any process group, model or training step exists, so bad input fails in one line.

:func:`validate_run` is the ONE entry every command that takes a run config goes through (``k3train.train``
and its ``--check``, ``tools/count_params.py``, ``tools/compare_optimizers.py``, ``benchmarks/bench_optim.py``):
it loads the YAML + overrides (:func:`k3train.config.load_config`: keys, types, values, the layout against the
world size) and then runs :func:`preflight` for what the config alone cannot show:

* the machine: ``train.device=cuda`` / ``parallel.backend=nccl`` without CUDA, more local ranks than GPUs;
* wandb: ``online`` (``logging.wandb_mode`` or ``WANDB_MODE``) without credentials falls back to ``offline``
  with one warning -- a run is never lost to its logger, and ``wandb sync <out_dir>/wandb`` uploads later;
* the data: tokenizer file, dataset files (missing, truncated, index not matching the data, token ids beyond
  the vocabulary), the tokenizer recorded in ``PREFIX.meta.json`` against ``data.tokenizer``, and every split
  the run READS holding at least one ``seq_len + 1``-token sample. The train split is always read; the valid
  split only when ``train.eval_interval > 0``; the test split never (a split nobody reads is not checked and
  not built, so a tiny one cannot fail a run);
* the pipeline partition and whether the schedule can run with this many micro-batches;
* ``checkpoint.load_hf`` (a fresh start from a Hugging Face checkpoint): its config.json against the run's model,
  every shard's header, every tensor present once with its shape (k3train/hf/load.py: check_hf_checkpoint).
* ``train.objective=eagle3``: the target checkpoint (k3train/draft/target.py: complete, undamaged, an MTP layer,
  this run's model and tokenizer).

* ``K3TRAIN_INJECT_NAN`` (test fault injection, k3train/runtime/nonfinite.py): well-formed, naming a module of
  this run's model and a rank inside its world.

Bad input raises ConfigError, DataError or ParallelConfigError (:func:`is_bad_input`, k3train/runtime/bad_input.py),
each message one line naming the key; anything else is a bug, not bad input. Config errors are found before torch,
megatron or the data package is imported, so they return in a fraction of a second: the checks that need them
import them when they run.
"""
from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from k3train.config import Config, ConfigError, load_config
from k3train.runtime.bad_input import is_bad_input  # noqa: F401 - the entry points' and tools' import path

log = logging.getLogger(__name__)


def validate_run(config_path: str | Path | None, overrides: list[str] | None = None, world_size: int | None = None,
                 *, for_training: bool = True) -> Config:
    """Load and check a run config for ``world_size`` processes. ``for_training=False`` (tools that only build
    the model on the meta device) skips the machine and data checks, keeping config and layout ones."""
    if config_path is None:
        raise ConfigError("--config: no run config given (e.g. --config configs/tiny.yaml); a run always names "
                          "its config file, the built-in defaults are the full-size 2.78T Kimi K3")
    cfg = load_config(config_path, overrides, world_size)
    if for_training:
        preflight(cfg)
    else:
        check_layout(cfg)
    return cfg


def check_devices(cfg: Config) -> None:
    import torch  # noqa: PLC0415 - lazy: torch is not loaded before the config is checked

    t, p = cfg.train, cfg.parallel
    cuda = torch.cuda.is_available()
    if t.device == "cuda" and not cuda:
        raise ConfigError(f"train.device: cuda requested but CUDA is not available here (torch.cuda.is_available() "
                          f"is False); use train.device=cpu or auto ({cfg.origin('train.device')})")
    on_gpu = t.device == "cuda" or (t.device == "auto" and cuda)
    if p.backend == "nccl" and not on_gpu:
        why = "CUDA is not available here" if not cuda else "train.device=cpu"
        raise ConfigError(f"parallel.backend: nccl needs GPUs but {why}; use parallel.backend=gloo or auto "
                          f"({cfg.origin('parallel.backend', 'train.device')})")
    if on_gpu:
        local_rank, n_gpu = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= n_gpu:
            raise ConfigError(f"train.device: local rank {local_rank} needs GPU {local_rank} but {n_gpu} are "
                              f"visible (one process per GPU: --nproc_per_node <= {n_gpu})")
    from k3train.model.kernels import check_kernel_settings  # noqa: PLC0415 - lazy: k3train.model loads torch

    bad_kernel = check_kernel_settings(cfg)  # a train.<op>_kernel forced where it cannot run (device, installed)
    if bad_kernel is not None:
        key, msg = bad_kernel
        raise ConfigError(f"{key}: {msg} ({cfg.origin(key)})")


def wandb_has_credentials() -> bool:
    """An API key in ``WANDB_API_KEY``, or a ``~/.netrc`` (``$NETRC``) entry for the wandb host
    (``WANDB_BASE_URL``, default api.wandb.ai) -- where ``wandb login`` stores it."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        entry = None
    return bool(entry and entry[2])


def resolve_wandb_mode(cfg: Config) -> None:
    """Settle the wandb mode before training (``WANDB_MODE`` wins over ``logging.wandb_mode``, as in wandb).
    ``online`` without credentials would stop the run at ``wandb.init`` (or wait on a login prompt) after the
    model is built: fall back to ``offline`` with one warning instead -- the metrics are still written
    (``metrics.jsonl`` and the offline wandb files) and can be synced later. The resolved mode is put in the
    config and in ``WANDB_MODE`` so the logger uses it."""
    lg = cfg.logging
    if not lg.wandb:
        return
    env = os.environ.get("WANDB_MODE", "").strip()
    if env and env not in ("online", "offline", "disabled"):
        raise ConfigError(f"WANDB_MODE={env!r} (environment): must be online, offline or disabled")
    mode = env or lg.wandb_mode
    if mode == "online" and not wandb_has_credentials():
        src = ("WANDB_MODE=online (environment)" if env
               else f"logging.wandb_mode=online ({cfg.origin('logging.wandb_mode')})")
        log.warning("%s but no wandb credentials (no WANDB_API_KEY, no ~/.netrc entry for the wandb host): logging "
                    "to wandb OFFLINE instead; upload later with `wandb sync %s/wandb`", src, cfg.train.out_dir)
        mode = "offline"
    lg.wandb_mode = mode
    if env:
        os.environ["WANDB_MODE"] = mode


def splits_read(cfg: Config) -> list[str]:
    """The dataset splits the run reads: train always, valid when ``train.eval_interval > 0``."""
    return ["train"] + (["valid"] if cfg.train.eval_interval > 0 else [])


def check_data(cfg: Config) -> None:
    # lazy: k3train.data loads torch (and megatron's dataset code), not loaded before the config is checked
    from k3train.data.corpus import DataError  # noqa: PLC0415
    # lazy: k3train.data, as above
    from k3train.data.dataset import check_metadata, check_split_sizes, validate_indexed_dataset  # noqa: PLC0415
    from k3train.data.tokenizer import load_config_tokenizer  # noqa: PLC0415 - lazy: k3train.data, as above

    tok_path = Path(cfg.data.tokenizer)
    if not tok_path.is_file():
        raise DataError(f"data.tokenizer: tokenizer file not found: {tok_path}")
    tok = load_config_tokenizer(cfg)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tok.vocab_size} ids ({tok_path}) ({cfg.origin('model.vocab_size')})")
    check_token_ids(cfg, tok)
    if cfg.data.format == "multimodal":  # tokens + media store, every media against its placeholders
        from k3train.data.multimodal.validate import check_multimodal_data  # noqa: PLC0415 - lazy: torch

        check_multimodal_data(cfg, tok, splits_read(cfg))
        return
    if cfg.data.format == "chat":  # tokens + the assistant-only loss mask beside them
        from k3train.data.chat.validate import check_chat_data  # noqa: PLC0415  # lazy: as the imports above

        check_chat_data(cfg, tok, splits_read(cfg))
        return
    try:  # ids in the data beyond the TOKENIZER's vocabulary: the data was made with another tokenizer
        info = validate_indexed_dataset(cfg.data.path, vocab_size=tok.vocab_size)
    except DataError as e:  # the message names the file; name the key too
        raise DataError(f"data.path: {e}") from None
    check_metadata(cfg.data.path, tok)
    check_split_sizes(info, cfg.data.split, cfg.train.seq_len, splits_read(cfg))


# token ids: model.*_token_id against the tokenizer the run reads (not in Config.validate: the meta-device tools
# load configs/k3.yaml, whose published ids belong to the Kimi tokenizer, without any tokenizer)
TOKEN_ID_KEYS = (("bos_token_id", "bos_id", "data.bos_token"), ("eos_token_id", "eos_id", "data.eos_token"),
                 ("pad_token_id", "pad_id", "data.pad_token"),
                 ("media_placeholder_token_id", "media_id", "data.media_placeholder_token"))


def check_token_ids(cfg: Config, tok) -> None:  # noqa: ANN001 - a k3train.data.tokenizer.TextTokenizer
    """Every ``model.*_token_id`` must be the id the tokenizer gives its ``data.*_token`` (media: -1 when the
    config names no media placeholder token). One error naming both values."""
    m, d = cfg.model, cfg.data
    for key, attr, name_key in TOKEN_ID_KEYS:
        ours, theirs = getattr(m, key), getattr(tok, attr)
        name = getattr(d, name_key.split(".")[1])
        if theirs is None:  # no media placeholder token named
            if ours != -1:
                raise ConfigError(f"model.{key}={ours} but data.media_placeholder_token is not set, so the run's "
                                  f"tokenizer ({tok.path}) has no media placeholder: set model.{key}=-1, or name "
                                  f"the token ({cfg.origin('model.' + key)})")
            continue
        if ours != theirs:
            raise ConfigError(f"model.{key}={ours} but data.tokenizer {tok.path} gives {name!r} ({name_key}) id "
                              f"{theirs}: set model.{key}={theirs}, or use the tokenizer these ids belong to "
                              f"({cfg.origin('model.' + key, name_key)})")


def check_layout(cfg: Config) -> None:
    from parallel.pipeline.partition import build_partition  # noqa: PLC0415 - lazy: parallel loads torch
    from parallel.pipeline.schedules import build_schedule, resolve_schedule  # noqa: PLC0415 - lazy: torch

    p = cfg.parallel
    build_partition(cfg.model, p, cfg.train.seq_len)
    if p.pp > 1 and cfg.train.grad_accum_steps:
        build_schedule(resolve_schedule(p.schedule, p.pp, p.vpp), p.pp, p.vpp, cfg.train.grad_accum_steps)


def preflight(cfg: Config) -> None:
    """Machine, logger, data and layout checks of a loaded config (see the module docstring)."""
    check_devices(cfg)
    resolve_wandb_mode(cfg)
    check_data(cfg)
    check_layout(cfg)
    check_injection(cfg)  # a malformed K3TRAIN_INJECT_NAN (test fault injection) is bad input too
    if cfg.train.objective == "eagle3":
        from k3train.draft.target import check_target  # noqa: PLC0415 - lazy: k3train.draft loads torch

        check_target(cfg)  # the frozen target checkpoint of EAGLE-3 draft training (k3train/draft/target.py)
    from k3train.checkpoint.resume import resume_preflight  # noqa: PLC0415 - lazy: k3train.checkpoint loads torch

    resume_preflight(cfg)  # run directory, checkpoint to resume, run fingerprint (k3train/checkpoint/resume.py)
    check_load_hf(cfg)


def check_injection(cfg: Config) -> None:
    """Preflight of ``K3TRAIN_INJECT_NAN`` (k3train/runtime/nonfinite.py): well-formed, ``module`` a module of the
    model (from a meta-device build, no memory) and ``rank`` inside the world. Raises :class:`ConfigError` (one
    line)."""
    from k3train.runtime.nonfinite import INJECT_ENV, injection_from_env  # noqa: PLC0415 - lazy: it loads torch

    spec = injection_from_env()
    if spec is None:
        return
    import torch  # noqa: PLC0415 - lazy: torch is not loaded before the config is checked

    from k3train.model.model import K3Model  # noqa: PLC0415 - lazy: k3train.model loads torch

    with torch.device("meta"):
        names = {n for n, _ in K3Model(cfg.model, cfg.vision).named_modules() if n}
    if spec.module not in names:
        raise ConfigError(f"{INJECT_ENV}: the model has no module {spec.module!r} (e.g. layers.0.attn, lm_head)")
    world = cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.cp
    if spec.rank is not None and cfg.parallel.dp > 0 and spec.rank >= world:
        raise ConfigError(f"{INJECT_ENV}: rank={spec.rank} but the run has {world} ranks")


def starts_from_hf(cfg: Config) -> bool:
    """Whether this start loads ``checkpoint.load_hf`` (set, and no checkpoint of the run to resume instead)."""
    if not cfg.checkpoint.load_hf:
        return False
    from k3train.checkpoint.resume import resume_candidate  # noqa: PLC0415 - lazy: k3train.checkpoint loads torch

    return resume_candidate(cfg) is None


def check_load_hf(cfg: Config) -> None:
    """A fresh start from a Hugging Face checkpoint: the checkpoint matches the run (one line naming what does
    not), before any process group or model exists."""
    if starts_from_hf(cfg):
        from k3train.hf.load import check_hf_checkpoint  # noqa: PLC0415 - lazy: k3train.hf loads torch

        check_hf_checkpoint(cfg)

