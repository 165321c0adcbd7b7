"""Config loading: YAML + overrides, strict keys, types, consistency, derived values."""
from pathlib import Path

import pytest

from k3train.config import ConfigError, load_config, parse_overrides, parse_split

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
MODEL = "model:\n  hidden_size: 64\n  num_hidden_layers: 4\n  vocab_size: 4096\n"  # the keys a file must set


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_stay_text_until_typed():
    o = parse_overrides(["--train.steps=5", "--parallel.attnres_comm", "full", "--train.out_dir=a=b"])
    assert o == [("train.steps", "5", "--train.steps=5"), ("parallel.attnres_comm", "full",
                                                           "--parallel.attnres_comm full"),
                 ("train.out_dir", "a=b", "--train.out_dir=a=b")]
    for bad in (["steps=5"], ["--steps=5"], ["--train.steps"]):
        with pytest.raises(ConfigError, match="command line"):
            parse_overrides(bad)


def test_overrides_parse_by_declared_type():
    cfg = load_config(TINY, ["--train.steps=5", "--optim.lr=1e-3", "--parallel.pp_layers=[2, 2,2,2]",
                             "--logging.wandb=no", "--parallel.pp=4", "--train.out_dir=0123",
                             "--logging.wandb_project=1e3", "--checkpoint.dir=",
                             "--optim.adamw_param_patterns=[embed,007]", "--train.seed=0042"])
    assert cfg.train.steps == 5 and cfg.optim.lr == 1e-3 and cfg.parallel.pp_layers == [2, 2, 2, 2]
    assert cfg.logging.wandb is False
    # str fields keep the text as written (YAML rules would give 123, 83 or 1000.0)
    assert cfg.train.out_dir == "0123" and cfg.logging.wandb_project == "1e3" and cfg.checkpoint.dir == ""
    assert cfg.optim.adamw_param_patterns == ["embed", "007"]
    assert cfg.train.seed == 42  # int fields are decimal: no YAML 1.1 octal
    assert cfg.origins["train.out_dir"] == "from the command line: --train.out_dir=0123"
    for arg, msg in (("--train.steps=5.0", "train.steps: expected int, got '5.0'"),
                     ("--optim.lr=inf", "optim.lr: expected float"), ("--logging.wandb=2", "expected bool"),
                     ("--parallel.pp_layers=[1,x]", r"parallel.pp_layers\[1\]: expected int")):
        with pytest.raises(ConfigError, match=msg):
            load_config(TINY, [arg])


def test_file_values_parse_by_declared_type(tmp_path):
    p = _write(tmp_path, MODEL + "train:\n  out_dir: 0123\n  seed: 010\n  steps: 7\nlogging:\n  wandb: off\n"
                                 "  wandb_project: '99'\n")
    cfg = load_config(p)
    assert cfg.train.out_dir == "0123" and cfg.train.seed == 10 and cfg.logging.wandb is False
    assert cfg.logging.wandb_project == "99" and cfg.origins["train.steps"] == f"in {p}:8"
    with pytest.raises(ConfigError, match=r"train\.out_dir: expected str, got an empty value \(in .*c\.yaml:6\)"):
        load_config(_write(tmp_path, MODEL + "train:\n  out_dir:\n"))
    with pytest.raises(ConfigError, match=r"train\.steps: set twice"):
        load_config(_write(tmp_path, MODEL + "train:\n  steps: 1\n  steps: 2\n"))


def test_config_file_must_name_the_model(tmp_path):
    for text, msg in (("", "is empty"), ("# nothing\n", "is empty"), ("train:\n  steps: 3\n", "does not set"),
                      ("model:\n  hidden_size: 64\n", "model.num_hidden_layers, model.vocab_size"),
                      ("model:\n", "does not set model.hidden_size")):
        with pytest.raises(ConfigError, match=f"^model: .*{msg}.*'model' section"):
            load_config(_write(tmp_path, text))
    cfg = load_config(_write(tmp_path, MODEL))  # the three scale keys are enough; the rest has defaults
    assert cfg.model.hidden_size == 64


def test_yaml_syntax_error_keeps_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match=r"malformed YAML at .*c\.yaml:2:1: while parsing a flow mapping"):
        load_config(_write(tmp_path, "model: {hidden_size: 64\n"))
    with pytest.raises(ConfigError, match=r"malformed YAML at .*c\.yaml:3:"):
        load_config(_write(tmp_path, "model:\n  hidden_size: 64\n\tvocab_size: 3\n"))


def test_errors_name_where_the_value_came_from(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"train\.seq_len: must be >= 1 \(from the command line: --train\.seq_len=0\)$"):
        load_config(TINY, ["--train.seq_len=0"])
    with pytest.raises(ConfigError, match=r"model\.kda_num_heads: must be >= 1, got 0 \(in .*c\.yaml:5\)$"):
        load_config(_write(tmp_path, MODEL + "  kda_num_heads: 0\n"))
    with pytest.raises(ConfigError, match=r"train\.steps: must be >= 1, got 0 \(default value; not set in"):
        cfg = load_config(_write(tmp_path, MODEL))
        cfg.train.steps = 0
        cfg.validate()
    # a rule over several keys names the command-line one when the command line changed what the file had
    with pytest.raises(ConfigError, match=r"\(from the command line: --train\.micro_batch_size=3\)$"):
        load_config(TINY, ["--train.micro_batch_size=3"], world_size=1)


@pytest.mark.parametrize("key,value", [
    ("num_attention_heads", 0), ("qk_nope_head_dim", 0), ("v_head_dim", 0), ("kda_num_heads", 0),
    ("kda_head_dim", 0), ("kda_decay_rank", 0), ("short_conv_kernel_size", 0), ("intermediate_size", 0),
    ("moe_intermediate_size", 0), ("shared_expert_intermediate_size", 0), ("qb_bins", 0), ("hidden_size", 0),
    ("num_hidden_layers", 0), ("kv_lora_rank", 0), ("q_lora_rank", -1), ("qk_rope_head_dim", -1),
    ("num_experts", -1), ("num_shared_experts", -1), ("rms_norm_eps", 0), ("init_std", 0),
    ("routed_scaling_factor", 0), ("activation_situ_beta", 0), ("mtp_loss_weight", -1), ("vocab_size", 1),
])
def test_every_model_size_is_checked(key, value):
    with pytest.raises(ConfigError, match=f"^model\\.{key}: "):
        load_config(TINY, [f"--model.{key}={value}"])


def test_zero_sizes_of_absent_layer_kinds_are_allowed():
    # all-MLA (full_attn_interval 1): KDA sizes unused; all-dense (no experts): MoE sizes unused
    cfg = load_config(TINY, ["--model.full_attn_interval=1", "--model.kda_num_heads=0", "--model.kda_head_dim=0",
                             "--model.num_experts=0", "--model.moe_intermediate_size=0", "--model.qb_bins=0",
                             "--model.q_lora_rank=0", "--model.qk_rope_head_dim=0"])
    assert cfg.model.kda_layers == [] and not cfg.model.is_moe_layer(3)


@pytest.mark.parametrize("arg,key", [
    ("--train.steps=0", "train.steps"), ("--train.global_batch_size=0", "train.global_batch_size"),
    ("--logging.log_interval=0", "logging.log_interval"), ("--logging.level=info", "logging.level"),
    ("--logging.wandb_mode=sometimes", "logging.wandb_mode"), ("--train.stop_at_step=-1", "train.stop_at_step"),
    ("--optim.adam_beta2=1", "optim.adam_beta2"), ("--optim.adam_eps=0", "optim.adam_eps"),
    ("--optim.ns_steps=0", "optim.ns_steps"), ("--train.seq_len=8192", "train.seq_len"),
])
def test_run_settings_are_checked(arg, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        load_config(TINY, [arg])


@pytest.mark.parametrize("args,key,needle", [
    (["--model.moe_token_chunk=0"], "model.moe_token_chunk", "must be a positive integer"),
    (["--model.moe_token_chunk=-8"], "model.moe_token_chunk", "must be a positive integer"),
    (["--model.mla_block_size=0"], "model.mla_block_size", "must be a positive integer"),
    (["--model.mixer_head_chunk=-1"], "model.mixer_head_chunk", ">= 0"),
    (["--parallel.recompute_granularity=token"], "parallel.recompute_granularity", "chunk, layer, sublayer"),
    (["--parallel.cp=3", "--train.seq_len=128"], "train.seq_len", "not divisible by cp=3"),
    (["--train.seq_len=65536"], "train.seq_len", "exceeds model.max_position_embeddings=4096"),
])
def test_long_context_settings_are_checked(args, key, needle):
    """Long-context settings (docs/long-context.md): one line naming the key, raised by the one validation
    every entry point runs (Config.validate), before anything is built."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, args)
    msg = str(e.value)
    assert msg.startswith(f"{key}: ") and needle in msg and len(msg.splitlines()) == 1, msg


@pytest.mark.parametrize("split,ok", [
    ("98,2,0", (98.0, 2.0, 0.0)), (" 1, 0 ,0 ", (1.0, 0.0, 0.0)), ("0.5,0.25,0.25", (0.5, 0.25, 0.25)),
    ("100", None), ("98,2", None), ("1,1,1,1", None), ("a,b,c", None), ("98-2-0", None), ("0,0,0", None),
    ("1,-1,1", None), ("nan,1,1", None), ("inf,1,1", None), ("", None), ("1e2,1,0", None),
    ("98.,2,.5", (98.0, 2.0, 0.5)),
])
def test_split_rule(split, ok):
    if ok is None:
        with pytest.raises(ConfigError, match="data.split: cannot parse"):
            parse_split(split)
        with pytest.raises(ConfigError, match=r"data\.split.*from the command line"):
            load_config(TINY, [f"--data.split={split}"])
    else:
        assert parse_split(split) == ok


def test_shipped_configs_validate():
    for name in ("tiny", "small", "k3"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.model.num_hidden_layers >= 1
    k3 = load_config(ROOT / "configs" / "k3.yaml")
    assert len(k3.model.kda_layers) == 69 and len(k3.model.full_attn_layers) == 24
    assert k3.model.full_attn_layers[-2:] == [92, 93] and k3.model.num_attn_res_blocks == 8


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, "model:\n  hidden_sise: 64\n")  # the unknown key is found before the model rule
    with pytest.raises(ConfigError, match=r"model\.hidden_sise.*c\.yaml"):
        load_config(p)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown section 'modle'"):
        load_config(_write(tmp_path, "modle: {}\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: expected int"):
        load_config(_write(tmp_path, MODEL + "train:\n  steps: many\n"))
    with pytest.raises(ConfigError, match=r"logging\.wandb: expected bool"):
        load_config(None, ["--logging.wandb=3"])


def test_malformed_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(_write(tmp_path, "model: [1, 2\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_derived_field_cannot_be_set(tmp_path):
    with pytest.raises(ConfigError, match="model.kda_layers"):
        load_config(None, ["--model.kda_layers=[1]"])


def test_inconsistent_values_are_named():
    with pytest.raises(ConfigError, match="parallel.ep"):
        load_config(None, ["--parallel.ep=3"], world_size=4)
    with pytest.raises(ConfigError, match="world size 3"):
        load_config(None, ["--parallel.pp=2"], world_size=3)
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config(None, ["--train.global_batch_size=6", "--train.micro_batch_size=4"], world_size=1)
    with pytest.raises(ConfigError, match="parallel.pp_layers"):
        load_config(None, ["--model.num_hidden_layers=8", "--parallel.pp=2", "--parallel.pp_layers=[4,3]"])
    with pytest.raises(ConfigError, match="cannot fill"):
        load_config(None, ["--model.num_hidden_layers=3", "--parallel.pp=2", "--parallel.vpp=2"])
    with pytest.raises(ConfigError, match="model.mla_use_nope"):
        load_config(None, ["--model.mla_use_nope=false"])
    with pytest.raises(ConfigError, match="seq_len"):
        load_config(None, ["--train.seq_len=130", "--parallel.cp=4"])


def test_dp_is_derived_from_world_size():
    cfg = load_config(None, ["--parallel.pp=2", "--train.global_batch_size=8", "--train.micro_batch_size=1"],
                      world_size=4)
    assert cfg.parallel.dp == 2 and cfg.train.grad_accum_steps == 4


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--train.steps=7"])
    cfg.save(tmp_path / "resolved.yaml")
    text = (tmp_path / "resolved.yaml").read_text()
    assert "steps: 7" in text and "model.kda_layers:" in text
    again = load_config(tmp_path / "resolved.yaml")
    assert again.to_dict() == cfg.to_dict()
    assert again.model.kda_layers == cfg.model.kda_layers


def test_multimodal_data_needs_the_vision_tower():
    """data.format=multimodal with vision off, or with a placeholder id outside the vocabulary: one ConfigError
    naming the fields (the tokenizer lacking the placeholder is preflight's DataError: tests/data)."""
    vl = ROOT / "configs" / "tiny-vl.yaml"
    assert load_config(vl).vision.enabled
    with pytest.raises(ConfigError, match=r"^data\.format: multimodal data needs vision\.enabled=true.*"
                                          r"--vision\.enabled=false"):
        load_config(vl, ["--vision.enabled=false"])
    with pytest.raises(ConfigError, match=r"^model\.media_placeholder_token_id: .*\[0, vocab_size=4224\), got 4224"):
        load_config(vl, ["--model.media_placeholder_token_id=4224"])
    with pytest.raises(ConfigError, match=r"^data\.format: multimodal data needs data\.media_placeholder_token"):
        load_config(vl, ["--model.media_placeholder_token_id=-1"])


def test_overlap_ep_applies_where_it_can():
    """``parallel.overlap_ep`` (F/B pairing): a bool, default on; on only with ep > 1, several micro-batches per
    step, under context parallelism too (Config.ep_overlap says why not otherwise)."""
    def ep_overlap(*over: str, world: int = 4):
        return load_config(TINY, ["--parallel.ep=2", "--train.micro_batch_size=1", "--train.global_batch_size=8",
                                  *over],
                           world_size=world).ep_overlap()

    assert load_config(TINY, []).parallel.overlap_ep is True
    assert ep_overlap() == (True, "")
    assert ep_overlap("--parallel.overlap_ep=false") == (False, "parallel.overlap_ep=false")
    assert ep_overlap("--parallel.ep=1")[1].startswith("no expert parallelism")
    assert ep_overlap("--train.global_batch_size=4")[1] == "one micro-batch per step"
    assert ep_overlap("--parallel.pp=2", "--parallel.vpp=2", "--train.global_batch_size=4") == (True, "")
    assert ep_overlap("--parallel.cp=2", "--train.global_batch_size=4") == (True, "")  # dp 2 cp 2: 2 micro-batches
    with pytest.raises(ConfigError, match="parallel.overlap_ep"):
        load_config(TINY, ["--parallel.overlap_ep=sometimes"])
