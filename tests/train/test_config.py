"""Config loading: strict keys, typed overrides, presets."""

import pytest

from longattn.train.config import ConfigError, configs_root, load_config, parse_override, read_yaml


def test_defaults_are_the_standard_lra_model():
    config = load_config(task="listops")
    assert config["model"] == {"layers": 2, "dim": 64, "hidden": 128, "heads": 2, "dropout": 0.1,
                               "embedding_dropout": 0.1, "norm": "pre", "pooling": "mean", "head": "mlp"}
    assert config["attention"] == "softmax"


def test_unknown_key_names_the_key_and_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.dimm'.*valid keys at model: dim, dropout"):
        load_config(overrides=["model.dimm=3"])
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="optim.learning_rate"):
        load_config(config_file=path)
    with pytest.raises(ConfigError, match="'bogus'"):
        load_config(overrides=["bogus=1"])


def test_overrides_parse_types():
    assert parse_override("optim.lr=1e-4") == {"optim": {"lr": 1e-4}}
    assert parse_override("train.progress=false") == {"train": {"progress": False}}
    assert parse_override("optim.betas=[0.9, 0.98]") == {"optim": {"betas": [0.9, 0.98]}}
    assert parse_override("train.clip_norm=null") == {"train": {"clip_norm": None}}
    config = load_config(overrides=["train.max_steps=7", "attention_options.skeleton.r=16", "data.options.seed=3"])
    assert config["train"]["max_steps"] == 7
    assert config["attention_options"] == {"skeleton": {"r": 16}}
    assert config["data"]["options"] == {"seed": 3}
    with pytest.raises(ConfigError, match="key.subkey=value"):
        parse_override("train.max_steps")


def test_bad_values_are_rejected():
    with pytest.raises(ConfigError, match="model.pooling"):
        load_config(overrides=["model.pooling=sum"])
    with pytest.raises(ConfigError, match="train.max_steps must be a positive integer"):
        load_config(overrides=["train.max_steps=0"])
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(overrides=["model=3"])


def test_missing_preset_lists_the_available_ones():
    with pytest.raises(FileNotFoundError, match="available: .*demo"):
        load_config(task="listops", preset="no-such-preset")


TASKS = ("listops", "text", "retrieval", "image", "pathfinder")


@pytest.mark.parametrize("task", TASKS)
def test_every_shipped_preset_loads(task):
    presets = sorted((configs_root() / task).glob("*.yaml"))
    assert {"demo", "standard"} <= {p.stem for p in presets}
    for path in presets:
        config = load_config(task=task, preset=path.stem)
        assert config["task"] == task


def test_yaml_floats_without_a_dot_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n")
    assert read_yaml(path)["optim"]["lr"] == 1e-3


def test_every_config_file_is_shipped_in_the_wheel():
    """pyproject's package-data patterns must cover every YAML under the package's configs folder."""
    import fnmatch
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    from longattn.train.config import packaged_configs

    package = packaged_configs().parent
    pyproject = tomllib.loads((package.parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["longattn"]
    files = sorted(p.relative_to(package).as_posix() for p in packaged_configs().rglob("*.yaml"))
    assert len(files) > 30
    # setuptools globs do not cross "/" with "*": compare path depth as well as the pattern
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns)]
    assert unshipped == []


def test_sweeps_are_found_by_name_or_path(tmp_path):
    from longattn.train.experiments import load_sweep, sweep_path

    by_name = sweep_path("skt_table7_r")
    assert by_name == configs_root() / "sweeps" / "skt_table7_r.yaml"
    assert load_sweep("skt_table7_r") == load_sweep(by_name)
    with pytest.raises(FileNotFoundError, match="skt_table7_r"):
        sweep_path("no_such_sweep")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sweep_path(tmp_path / "skt_table7_r.yaml")  # an explicit path is never swapped for a shipped file
