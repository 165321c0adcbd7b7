"""Bad input through the real entry point (``k3train.train`` run as ``__main__`` in a process forked from the fork
server, tests/train/train_helpers.py ``run_train_forked``; torchrun for a few): exit code 2, exactly
one ``k3train: error:`` line naming the key, no traceback, and nothing built -- no run directory, no layout line
(the trainer's first log line, printed once the process groups exist), no training step.

``BAD_INPUT`` is the table of every preflight case; ``python tests/train/bad_input_table.py`` prints it with the
messages (the table of the closing note).
"""
from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from k3train.data.corpus import DEFAULT_CORPUS, read_documents, write_text_corpus
from k3train.data.prepare import prepare
from k3train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from train_helpers import FAST, run_train, run_train_forked

TINY = "configs/tiny.yaml"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

# (id, arguments, substrings of the error line, options). Placeholders: {run} the run directory (must not be
# created), {data} the 120-chapter test dataset, {tiny3} a 3-document dataset, other {names} files of `inputs`.
BAD_INPUT = [
    ("no --config", ["--train.out_dir={run}"], ["--config", "no run config"], {}),
    ("config file missing", ["--config", "{dir}/nope.yaml"], ["config file not found", "nope.yaml"], {}),
    ("empty YAML", ["--config", "{empty}"], ["model:", "empty", "'model' section"], {}),
    ("YAML without model", ["--config", "{nomodel}"], ["model.hidden_size", "'model' section"], {}),
    ("YAML syntax error", ["--config", "{syntax}"], ["malformed YAML", "syntax.yaml:4:6", "flow sequence"], {}),
    ("unknown key in file", ["--config", "{stepz}"], ["train.stepz", "stepz.yaml:2"], {}),
    ("unknown key override", ["--config", TINY, "--optim.lrr=1"], ["optim.lrr", "command line: --optim.lrr=1"], {}),
    ("wrong type override", ["--config", TINY, "--train.steps=ten"], ["train.steps", "expected int"], {}),
    ("bad override syntax", ["--config", TINY, "--steps=3"], ["bad override", "--steps=3"], {}),
    ("num_attention_heads 0", ["--config", TINY, "--model.num_attention_heads=0"], ["model.num_attention_heads"], {}),
    ("kda_num_heads 0", ["--config", TINY, "--model.kda_num_heads=0"], ["model.kda_num_heads"], {}),
    ("kda_head_dim 0", ["--config", TINY, "--model.kda_head_dim=0"], ["model.kda_head_dim"], {}),
    ("moe_intermediate_size 0", ["--config", TINY, "--model.moe_intermediate_size=0"],
     ["model.moe_intermediate_size"], {}),
    ("moe_token_chunk 0", ["--config", TINY, "--model.moe_token_chunk=0"], ["model.moe_token_chunk", "positive"], {}),
    ("mla_block_size 0", ["--config", TINY, "--model.mla_block_size=0"], ["model.mla_block_size", "positive"], {}),
    ("seq_len not split over cp", ["--check", "--world-size", "3", "--config", TINY, "--parallel.cp=3",
                                   "--train.seq_len=128"], ["train.seq_len", "not divisible by cp=3"], {}),
    ("seq_len above max_position_embeddings", ["--config", TINY, "--train.seq_len=65536"],
     ["train.seq_len", "exceeds model.max_position_embeddings=4096"], {}),
    ("v_head_dim 0 in file", ["--config", "{vhead0}"], ["model.v_head_dim", "vhead0.yaml:"], {}),
    ("global_batch_size 0", ["--config", TINY, "--train.global_batch_size=0"], ["train.global_batch_size"], {}),
    ("train.steps 0", ["--config", TINY, "--train.steps=0"], ["train.steps", "must be >= 1"], {}),
    ("log_interval 0", ["--config", TINY, "--logging.log_interval=0"], ["logging.log_interval"], {}),
    ("unknown logging.level", ["--config", TINY, "--logging.level=LOUD"], ["logging.level", "LOUD"], {}),
    ("split with 2 numbers", ["--config", TINY, "--data.split=98,2"], ["data.split", "'98,2'"], {}),
    ("split not numbers", ["--config", TINY, "--data.split=a,b,c"], ["data.split"], {}),
    ("split negative", ["--config", TINY, "--data.split=99,-1,2"], ["data.split"], {}),
    ("split sums to 0", ["--config", TINY, "--data.split=0,0,0"], ["data.split"], {}),
    ("device cuda without CUDA", ["--config", TINY, "--train.device=cuda"], ["train.device", "CUDA"],
     {"mark": NO_CUDA}),
    ("nccl without GPUs", ["--config", TINY, "--parallel.backend=nccl"], ["parallel.backend", "nccl"],
     {"mark": NO_CUDA}),
    ("override blamed on the command line", ["--config", TINY, "--train.micro_batch_size=3"],
     ["train.global_batch_size", "from the command line: --train.micro_batch_size=3"], {"absent": "tiny.yaml:"}),
    ("sizes that do not divide", ["--config", TINY, "--train.global_batch_size=6", "--train.micro_batch_size=4"],
     ["train.global_batch_size"], {}),
    ("pp_layers wrong count", ["--config", TINY, "--parallel.pp_layers=[3,3]"], ["parallel.pp_layers"], {}),
    ("world size vs --check", ["--check", "--world-size", "3", "--config", TINY, "--parallel.pp=2"],
     ["world size 3"], {}),
    ("--world-size not a number", ["--check", "--world-size", "x", "--config", TINY], ["--world-size"], {}),
    ("dataset missing", ["--config", TINY, "--data.path={dir}/none"],
     ["data.path", "dataset file not found", "none.idx"], {}),
    ("truncated .bin", ["--config", TINY, "--data.path={trunc}", *FAST], ["data.path", ".bin", "truncated"], {}),
    (".idx cut short", ["--config", TINY, "--data.path={idxcut}", *FAST], ["data.path", ".idx"], {}),
    ("tokenizer larger than model vocab", ["--config", TINY, "--data.path={data}", "--model.vocab_size=1000", *FAST],
     ["model.vocab_size"], {}),
    ("dataset made with another tokenizer", ["--config", TINY, "--data.path={data}", "--data.tokenizer={alt_tok}",
                                             *FAST], ["data.tokenizer", "tokenizer_sha256"], {}),
    ("valid split too small for eval", ["--config", TINY, "--data.path={tiny3}", "--data.split=98,2,0",
                                        "--train.seq_len=64", "--train.eval_interval=5"],
     ["data.split='98,2,0'", "valid split", "0 tokens"], {}),
    ("train split shorter than a sample", ["--config", TINY, "--data.path={tiny3}", "--data.split=100,0,0",
                                           "--train.seq_len=4096"], ["data.split", "train split"], {}),
    ("WANDB_MODE not a mode", ["--config", TINY, "--data.path={data}", *FAST, "--logging.wandb=true"],
     ["WANDB_MODE", "bogus"], {"env": {"WANDB_MODE": "bogus"}}),
    ("checkpoint.resume path missing", ["--config", TINY, "--data.path={data}", *FAST,
                                        "--checkpoint.resume={dir}/step_00000007"], ["checkpoint.resume"], {}),
    ("eagle3 without checkpoint.target", ["--config", TINY, "--train.objective=eagle3"],
     ["checkpoint.target", "train.objective=eagle3 needs the frozen target", "--train.objective=eagle3"], {}),
    ("torchrun: world size vs pp", ["--config", TINY, "--data.path={data}", *FAST, "--parallel.pp=4"],
     ["parallel: world size 2 is not divisible by pp*cp = 4"], {"nproc": 2}),
    ("torchrun: num_attention_heads 0", ["--config", TINY, "--model.num_attention_heads=0"],
     ["model.num_attention_heads"], {"nproc": 2}),
]


def _tiny_dataset(d: Path, n_docs: int) -> Path:
    docs = [x.text for x in itertools.islice(read_documents(DEFAULT_CORPUS), n_docs)]
    write_text_corpus(docs, d / f"kjv{n_docs}.txt")
    prefix = d / f"kjv{n_docs}_text_document"
    prepare([d / f"kjv{n_docs}.txt"], load_tokenizer(DEFAULT_TOKENIZER), prefix)
    return prefix


def copy_dataset(prefix: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(str(prefix) + ext, dst / (prefix.name + ext))
    return dst / prefix.name


def make_inputs(d: Path, corpus_prefix: Path) -> dict[str, str]:
    """Write the files the table's placeholders name into ``d``."""
    files = {"empty": "", "nomodel": "train:\n  steps: 3\n",
             "syntax": "model:\n  hidden_size: 64\n  vocab_size: [1, 2\ntrain: {}\n",
             "stepz": "train:\n  stepz: 3\n",
             "vhead0": Path(TINY).read_text().replace("  v_head_dim: 16", "  v_head_dim: 0")}
    out = {"dir": str(d), "data": str(corpus_prefix)}
    for name, text in files.items():
        (d / f"{name}.yaml").write_text(text)
        out[name] = str(d / f"{name}.yaml")
    trunc = copy_dataset(corpus_prefix, d / "trunc")
    b = Path(str(trunc) + ".bin")
    b.write_bytes(b.read_bytes()[:-1000])
    idxcut = copy_dataset(corpus_prefix, d / "idxcut")
    i = Path(str(idxcut) + ".idx")
    i.write_bytes(i.read_bytes()[:-16])  # index cut short: counts no longer match its size
    alt = d / "alt_tokenizer.json"  # the same vocabulary in another file: a different sha256
    alt.write_text(json.dumps(json.loads(Path(DEFAULT_TOKENIZER).read_text()), indent=2))
    out.update(trunc=str(trunc), idxcut=str(idxcut), alt_tok=str(alt), tiny3=str(_tiny_dataset(d, 3)))
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, corpus_prefix) -> dict[str, str]:
    return make_inputs(tmp_path_factory.mktemp("bad_inputs"), corpus_prefix)


def fill(args: list[str], inputs: dict[str, str], run: Path) -> list[str]:
    return [a.format(run=run, **inputs) for a in args]


def error_line(res, nproc: int = 0) -> str:
    """The one ``k3train: error:`` line of a bad-input run, after checking exit code and absence of tracebacks."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train: error:")]
    assert len(lines) == 1, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    if nproc:  # torchrun reports the failed ranks itself (with its own traceback); our ranks print one line
        assert res.returncode != 0
    else:
        assert res.returncode == 2, f"exit {res.returncode}\n{res.stderr[-4000:]}"
        assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert "layout:" not in res.stderr + res.stdout  # no process group / parallel layout was built
    assert "step " not in res.stdout
    return lines[0]


def _params():
    for cid, args, needles, opts in BAD_INPUT:
        yield pytest.param(args, needles, opts, id=cid, marks=[opts["mark"]] if "mark" in opts else [])


@pytest.mark.parametrize("args,needles,opts", list(_params()))
def test_bad_input(args, needles, opts, inputs, tmp_path):
    run = tmp_path / "run"
    argv = fill(args, inputs, run)
    if "--train.out_dir={run}" not in args:
        argv.append(f"--train.out_dir={run}")
    nproc = opts.get("nproc", 0)
    res = (run_train if nproc else run_train_forked)(argv, nproc=nproc, env_extra=opts.get("env"))
    line = error_line(res, opts.get("nproc", 0))
    for n in needles:
        assert n.format(**inputs) in line, line
    if "absent" in opts:
        assert opts["absent"] not in line, line
    assert not run.exists()


# ----------------------------------------------------------------------------------------------------------------
# inputs that must NOT fail, next to the cases above
# ----------------------------------------------------------------------------------------------------------------
def _check(args: list[str], **kw) -> tuple[str, str]:
    res = run_train_forked(["--check", *args], **kw)
    assert res.returncode == 0 and "are valid" in res.stdout, res.stderr[-3000:]
    assert "k3train: error" not in res.stderr
    return res.stdout, res.stderr


def test_unread_split_too_small_does_not_fail(inputs):
    # 3 documents, split 98,2,0: the valid split gets no document, but nothing reads it (train.eval_interval=0)
    _check(["--config", TINY, f"--data.path={inputs['tiny3']}", "--data.split=98,2,0", "--train.seq_len=64",
            "--train.eval_interval=0"])


def test_check_mode_validates_for_a_world_size(corpus_prefix):
    _check(["--world-size", "4", "--config", TINY, f"--data.path={corpus_prefix}", *FAST, "--parallel.pp=2"])


def test_dataset_without_tokenizer_hash_warns(inputs, tmp_path):
    prefix = copy_dataset(Path(inputs["data"]), tmp_path / "nohash")
    meta_file = Path(str(prefix) + ".meta.json")
    meta = json.loads(meta_file.read_text())
    del meta["tokenizer_sha256"]
    meta_file.write_text(json.dumps(meta))
    _, err = _check(["--config", TINY, f"--data.path={prefix}", *FAST])
    warnings = [ln for ln in err.splitlines() if "cannot verify" in ln]
    assert len(warnings) == 1 and "has no tokenizer_sha256" in warnings[0], err


def test_wandb_online_without_credentials_trains_offline(inputs, tmp_path):
    """WANDB_MODE=online, no WANDB_API_KEY, a HOME without .netrc: one warning, then the run trains with wandb
    offline (a real 1-step run; online would fail at wandb.init after the model was built)."""
    run = tmp_path / "run"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": None, "NETRC": None, "HOME": str(tmp_path),
           "WANDB_DIR": None, "WANDB_CONFIG_DIR": str(tmp_path / "wandb_cfg")}
    res = run_train_forked(["--config", TINY, f"--data.path={inputs['data']}", *FAST, "--logging.wandb=true",
                            "--train.steps=1", "--checkpoint.save_final=false", "--checkpoint.resume=none",
                            f"--train.out_dir={run}"], env_extra=env)
    assert res.returncode == 0, res.stderr[-4000:]
    warnings = [ln for ln in res.stderr.splitlines() if "no wandb credentials" in ln]
    assert len(warnings) == 1 and "OFFLINE" in warnings[0], res.stderr[-3000:]
    assert list((run / "wandb").glob("offline-run-*")), sorted(p.name for p in run.rglob("*"))[:20]
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    _, err = _check(["--config", TINY, f"--data.path={inputs['data']}", *FAST, "--logging.wandb=true"],
                    env_extra=env)
    assert "no wandb credentials" not in err  # a ~/.netrc entry for the wandb host counts as credentials

