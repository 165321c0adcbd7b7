"""Config loading: YAML + overrides, strict keys, types, consistency, derived values."""
from pathlib import Path

import pytest

from k3train.config import ConfigError, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_parse_yaml_scalars():
    o = parse_overrides(["--train.steps=5", "--parallel.attnres_comm", "full", "--optim.lr=1e-3",
                         "--parallel.pp_layers=[1,2]", "--logging.wandb=false"])
    assert o == {"train": {"steps": 5}, "parallel": {"attnres_comm": "full", "pp_layers": [1, 2]},
                 "optim": {"lr": 1e-3}, "logging": {"wandb": False}}


def test_shipped_configs_validate():
    for name in ("tiny", "small", "k3"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.model.num_hidden_layers >= 1
    k3 = load_config(ROOT / "configs" / "k3.yaml")
    assert len(k3.model.kda_layers) == 69 and len(k3.model.full_attn_layers) == 24
    assert k3.model.full_attn_layers[-2:] == [92, 93] and k3.model.num_attn_res_blocks == 8


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, "model:\n  hidden_sise: 64\n")
    with pytest.raises(ConfigError, match=r"model\.hidden_sise.*c\.yaml"):
        load_config(p)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown section 'modle'"):
        load_config(_write(tmp_path, "modle: {}\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: expected int"):
        load_config(_write(tmp_path, "train:\n  steps: many\n"))
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
