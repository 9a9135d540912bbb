"""Command-line mistakes are one line that says what to fix, with exit code 2 (issue 13, items 5 and 9)."""

import pytest

from longattn.cli import main


@pytest.fixture(autouse=True)
def _stub(lra_stub_data):
    """No data is built before these errors; the stub makes sure none would be downloaded either."""


@pytest.mark.parametrize("argv, says", [
    (["train", "--task", "listops", "--set", "train.clip_norm=-1"], "train.clip_norm must be > 0"),
    (["train", "--task", "listops", "--set", "optim.lr=inf"], "optim.lr must be a finite number"),
    (["train", "--task", "listops", "--set", "train.epochs=-1"], "train.epochs must be >= 1"),
    (["train", "--task", "listops", "--set", "train.checkpoint_every=0"], "train.checkpoint_every must be >= 1"),
    (["train", "--task", "listops", "--set", "optim.betas=[0.9"], "cannot read value"),
    (["train", "--task", "listops", "--set", "model.dim=-16"], "model 'lra_classifier' cannot be built"),
])
def test_bad_values_are_one_line_errors(argv, says, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_malformed_config_file_and_out_naming_a_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {max_steps: 3\n")
    assert main(["train", "--task", "listops", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["train", "--task", "listops", "--set", "train.max_steps=1", "--out", str(afile)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_forecast_value_errors(tmp_path, capsys):
    from forecast_csv import write_series

    csv = write_series(tmp_path / "toy.csv")
    common = ["forecast", "--dataset", str(csv), "--model", "skt", "--pred-len", "4", "--set", "data.seq_len=16",
              "--set", "data.label_len=8", "--out", str(tmp_path / "f")]
    assert main([*common, "--set", "train.lr=abc"]) == 2
    assert "optim.lr must be a number" in capsys.readouterr().err
    assert main([*common, "--set", "model.d_model=-16"]) == 2
    assert "model 'skt' cannot be built" in capsys.readouterr().err
