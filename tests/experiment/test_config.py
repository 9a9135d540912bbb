"""The config core: strict keys with the nearest valid key, one --set grammar, checked values, presets,
the stacking order, and saved configs that reload into the same dataclasses."""

import fnmatch
from pathlib import Path

import pytest

from longattn.config import ConfigError, parse_set, read_yaml, to_dict
from longattn.experiment.config import load_saved, resolve_config, save_config
from longattn.experiment.grid import load_sweep, sweep_path
from longattn.tasks.lra import LRA_CONFIGS

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")


def test_defaults_are_the_standard_lra_model():
    config = resolve_config("listops")
    assert config.model == {"layers": 2, "dim": 64, "hidden": 128, "heads": 2, "dropout": 0.1,
                            "embedding_dropout": 0.1, "norm": "pre", "pooling": "mean", "head": "mlp"}
    assert config.attention == "softmax" and config.model_name == "lra_classifier"


def test_unknown_key_names_the_nearest_and_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.dimm'.*did you mean 'dim'.*valid keys in model: .*dropout"):
        resolve_config("listops", overrides=["model.dimm=3"])
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="optim.learning_rate"):
        resolve_config("listops", config_file=path)
    with pytest.raises(ConfigError, match="'bogus'"):
        resolve_config("listops", overrides=["bogus=1"])
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        resolve_config("listops", overrides=["train.batch_sise=1"])


def test_set_parses_types():
    assert parse_set("optim.lr=1e-4") == {"optim": {"lr": 1e-4}}
    assert parse_set("train.progress=false") == {"train": {"progress": False}}
    assert parse_set("optim.betas=[0.9, 0.98]") == {"optim": {"betas": [0.9, 0.98]}}
    assert parse_set("train.clip_norm=null") == {"train": {"clip_norm": None}}
    config = resolve_config("listops", overrides=["train.max_steps=7", "attention_options.skeleton.r=16",
                                                  "data.options.seed=3"])
    assert config.train.max_steps == 7
    assert config.attention_options == {"skeleton": {"r": 16}}
    assert config.data.options == {"seed": 3}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_set("train.max_steps")
    with pytest.raises(ConfigError, match="cannot read value"):
        parse_set("optim.betas=[0.9, 0.98")


@pytest.mark.parametrize("override, message", [
    ("model.pooling=sum", "model.pooling"),
    ("train.max_steps=0", "train.max_steps must be >= 1"),
    ("train.clip_norm=-1", "train.clip_norm must be > 0"),
    ("train.epochs=-1", "train.epochs must be >= 1"),
    ("train.checkpoint_every=0", "train.checkpoint_every must be >= 1"),
    ("train.eval_every=0", "train.eval_every must be >= 1"),
    ("optim.lr=inf", "optim.lr must be a finite number"),
    ("optim.lr=abc", "optim.lr must be a number"),
    ("optim.lr=0", "optim.lr must be > 0"),
    ("model=3", "must be a mapping"),
    ("train.precision=fp8", "train.precision must be one of fp32, bf16, fp16"),
    ("optim.warmup_steps=5000", "exceeds train.max_steps"),
])
def test_bad_values_are_rejected_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config("listops", overrides=[override])


def test_unknown_names_fail_before_any_data(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention mechanism 'nosuch'"):
        resolve_config("listops", attention="nosuch")
    with pytest.raises(ConfigError, match="unknown task 'listopz'.*did you mean 'listops'"):
        resolve_config("listopz")
    with pytest.raises(ConfigError, match="unknown model 'dlinear' for task 'listops'"):
        resolve_config("listops", model_name="dlinear")


def test_missing_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*demo"):
        resolve_config("listops", "no-such-preset")


def test_stacking_order(tmp_path):
    """defaults < task overlay < preset < --config < --set < explicit flags."""
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 0.5}\ntrain: {max_steps: 77, batch_size: 5}\nattention: linformer\n")
    config = resolve_config("listops", "demo", path, ["train.max_steps=99"], attention="skein")
    assert config.optim.lr == 0.5  # file over preset (demo: 1e-3)
    assert config.optim.schedule == "linear"  # preset over defaults (standard would be onecycle)
    assert config.train.max_steps == 99 and config.train.batch_size == 5  # --set over file
    assert config.attention == "skein"  # explicit flag over file
    forecast = resolve_config("forecasting", data={"dataset": "ETTm2"})
    assert forecast.optim.optimizer == "adam" and forecast.train.eval_every_epoch  # the task's overlay


def test_per_model_sections_apply_only_to_their_model(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("optim: {lr: 0.002}\nmodels:\n  dlinear: {optim: {lr: 0.03}, model: {kernel_size: 5}}\n")
    dlinear = resolve_config("forecasting", config_file=path, model_name="dlinear")
    skt = resolve_config("forecasting", config_file=path, model_name="skt")
    assert dlinear.optim.lr == 0.03 and dlinear.model["kernel_size"] == 5
    assert skt.optim.lr == 0.002 and "kernel_size" not in skt.model
    # --set on a general key wins over a file's per-model key (a later layer)
    assert resolve_config("forecasting", config_file=path, model_name="dlinear",
                          overrides=["optim.lr=0.7"]).optim.lr == 0.7


def test_earlier_forecast_keys_still_work(tmp_path):
    """The previous forecasting grammar (lr under train, lr_schedule, grad_clip, top-level horizons, model
    options directly under models.<name>) reads as before."""
    path = tmp_path / "old.yaml"
    path.write_text("train: {lr: 0.01, lr_schedule: constant, grad_clip: 2.0, epochs: 3}\nhorizons: [5, 7]\n"
                    "models:\n  dlinear: {kernel_size: 3, train: {lr: 0.2}}\n")
    config = resolve_config("forecasting", config_file=path, model_name="dlinear",
                            overrides=["model.individual=true"])
    assert config.optim.lr == 0.2 and config.optim.schedule == "constant"
    assert config.train.clip_norm == 2.0 and config.train.epochs == 3
    assert config.data.horizons == [5, 7] and config.model["kernel_size"] == 3 and config.model["individual"]
    skt = resolve_config("forecasting", overrides=["model.attention_options.s1=4"])
    assert skt.chosen_attention_options()["s1"] == 4


@pytest.mark.parametrize("task", TASKS)
def test_every_shipped_preset_loads_and_round_trips(task, tmp_path):
    presets = sorted((LRA_CONFIGS / task).glob("*.yaml"))
    assert {"demo", "standard"} <= {p.stem for p in presets}
    for path in presets:
        config = resolve_config(task, path.stem)
        save_config(config, tmp_path / "config.yaml")
        assert to_dict(load_saved(tmp_path / "config.yaml")) == to_dict(config)


def test_yaml_floats_without_a_dot_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n")
    assert read_yaml(path)["optim"]["lr"] == 1e-3


def test_malformed_yaml_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: {lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: .* line \d+"):
        read_yaml(path)


def test_every_config_file_is_shipped_in_the_wheel():
    """pyproject's package-data patterns must cover every YAML under the package's configs folder."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    configs = LRA_CONFIGS.parent
    package = configs.parent
    pyproject = tomllib.loads((package.parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["longattn"]
    files = sorted(p.relative_to(package).as_posix() for p in configs.rglob("*.yaml"))
    assert len(files) > 30
    # setuptools globs do not cross "/" with "*": compare path depth as well as the pattern
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns)]
    assert unshipped == []


def test_sweeps_are_found_by_name_or_path(tmp_path):
    by_name = sweep_path("skt_table7_r")
    assert by_name == LRA_CONFIGS / "sweeps" / "skt_table7_r.yaml"
    assert load_sweep("skt_table7_r") == load_sweep(by_name)
    with pytest.raises(FileNotFoundError, match="skt_table7_r"):
        sweep_path("no_such_sweep")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sweep_path(tmp_path / "skt_table7_r.yaml")  # an explicit path is never swapped for a shipped file


# ----------------------------------------------------------------------------- config files with a key twice

from reliability import CLEAR_ERROR, OTHER_READERS, bad_input, cases  # noqa: E402

TWICE = {
    "a key twice in a config file": ("config", "optim:\n  lr: 1.0e-3\n  warmup_steps: 2\n  lr: 3.0e-4\n",
                                     r"c.yaml is not valid YAML: key 'lr' appears twice in one mapping \(first on line "
                                     r"2\) at line 4"),
    "a section twice in a config file": ("config", "train:\n  max_steps: 10\ntrain:\n  batch_size: 4\n",
                                         r"key 'train' appears twice .*first on line 1\) at line 3"),
    "a key twice in a --set value": ("set", "model={dim: 16, dim: 32}", r"key 'dim' appears twice"),
    "a sweep file with a key twice": ("sweep", "attention: softmax\ngrid:\n  optim.lr: [1.0e-3]\nattention: linear\n",
                                      r"c.yaml is not valid YAML: key 'attention' appears twice"),
}


@pytest.mark.parametrize("where, text, message", cases(OTHER_READERS, CLEAR_ERROR, TWICE))
def test_a_key_given_twice_is_an_error_not_the_last_value(tmp_path, where, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        if where == "set":
            parse_set(text)
        elif where == "sweep":
            load_sweep(path)
        else:
            resolve_config("listops", config_file=path)


@bad_input(OTHER_READERS, CLEAR_ERROR, cases=2)
def test_a_hand_edited_saved_config_names_its_file(tmp_path):
    save_config(resolve_config("listops", "demo"), tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(text.replace("max_steps:", "max_stepz:"))
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.yaml'}: unknown config key 'train.max_stepz'"):
        load_saved(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text(text[: len(text) // 3])  # cut short
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.yaml'}"):
        load_saved(tmp_path / "config.yaml")


@bad_input(OTHER_READERS, CLEAR_ERROR, cases=2)
def test_a_damaged_cross_validation_summary_names_its_file(tmp_path):
    from longattn.experiment.singular_figures import run_accuracy_cost

    for text in ('{"entries": [', '{"folds": []}'):  # cut short; another file's JSON
        (tmp_path / "results.json").write_text(text)
        with pytest.raises(ConfigError, match=rf"{tmp_path / 'results.json'} is not a cross-validation summary"):
            run_accuracy_cost(tmp_path, tmp_path / "out")


def test_a_step_budget_that_epochs_override_is_a_warning(capsys):
    """``train.max_steps`` from the user while the preset budgets in epochs: the epochs win, and a warning says so
    (and how to train by steps); with ``train.epochs=null`` the steps count and nothing is said."""
    config = resolve_config("mqar", "cpu", None, ["train.max_steps=40"])
    assert config.train.epochs == 2
    assert "train.max_steps=40 is not used: the budget is train.epochs=2" in capsys.readouterr().err
    config = resolve_config("mqar", "cpu", None, ["train.max_steps=40", "train.epochs=null"])
    assert config.train.epochs is None and config.train.max_steps == 40
    resolve_config("mqar", "cpu", None, ["train.epochs=3"])
    assert "warning" not in capsys.readouterr().err
