"""``longattn bench gpu`` on a CPU (--smoke): every part runs, so the device run cannot fail on a typo."""

from __future__ import annotations

import json

import torch

from longattn.bench.gpu import Budget, verdicts
from longattn.cli import main


def test_smoke_run_writes_every_part(tmp_path, capsys):
    out = tmp_path / "gpu"
    args = ["bench", "gpu", "--device", "cpu", "--smoke", "--attentions", "softmax", "fsat", "skeleton",
            "--hf-attentions", "softmax", "nystrom", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "gpu.json").read_text())
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["date"]
    assert report["rates"]["gemm_bf16_flop_per_s"] > 0 and report["rates"]["copy_bytes_per_s"] > 0
    accuracy = {row["attention"]: row for row in report["accuracy"]}
    assert set(accuracy) == {"softmax", "fsat", "skeleton"}
    for name in ("softmax", "fsat"):
        assert all(accuracy[name][label]["status"] == "pass" for label in ("fp32", "fp32_tf32", "bf16", "fp16"))
    assert accuracy["fsat"]["bf16"]["dtype"] == "bfloat16"
    speed = report["speed"]
    assert [(r["attention"], r["length"]) for r in speed] == [
        (name, n) for name in ("softmax", "fsat", "skeleton") for n in (64, 128)]
    for row in speed:
        assert row["status"] == "ok" and row["time_s"] > 0 and row["batch"] * row["length"] == 256
        assert row["floor_s"] > 0 and row["floor_ratio"] > 0 and row["speedup_vs_softmax"] > 0
    assert next(r for r in speed if r["attention"] == "fsat")["flops"] > 0  # counted on meta tensors
    train = report["train"]
    assert train["status"] == "pass" and train["steps"] == 3 and train["precision"] == "bf16"
    assert [row["status"] for row in report["hf"]["rows"]] == ["pass", "pass"]
    assert report["hf"]["softmax_conversion_max_abs_diff_fp32"] < 1e-5
    recall = report["recall"]["cpu"]
    assert [(c["row"], c["width"]) for c in recall["cells"]] == [("softmax", 8), ("skeleton", 8)]
    assert all(c["device"] == "cpu" and c["step_s"] > 0 for c in recall["cells"]) and not recall["unmeasured"]
    table = (out / "gpu.md").read_text()
    for heading in ("# longattn bench gpu", "## Accuracy", "## Forward + backward", "## Training", "## Hugging Face",
                    "## Recall sweep (MQAR)", "### Cost of the recall sweep, preset `cpu` (process CPU time"):
        assert heading in table
    # a second run into the same folder must be asked for
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_verdicts_take_the_faster_row_and_only_measured_lengths():
    def row(name, length, seconds, triton=None, **extra):
        return {"attention": name, "length": length, "triton": triton, "status": "ok", "time_s": seconds, **extra}

    rows = [row("softmax", 16384, 1.0), row("nystrom", 16384, 2.0, False, speedup_vs_softmax=0.5, memory_vs_softmax=0.9),
            row("nystrom", 16384, 0.5, True, speedup_vs_softmax=2.0, memory_vs_softmax=1.2)]
    (nystrom,) = verdicts(rows)
    checks = {c["check"]: c for c in nystrom["checks"]}
    assert set(checks) == {"speed-up vs softmax at N=16384 >= 1.0", "peak memory at N=16384 <= softmax's"}
    assert checks["speed-up vs softmax at N=16384 >= 1.0"]["met"] is True  # the Triton row, the faster one
    assert checks["peak memory at N=16384 <= softmax's"]["met"] is False


def test_budget_gives_unused_time_to_the_parts_still_to_come():
    budget = Budget(100.0)
    with budget.part(0.5, 1.0):
        assert 49 < budget.left() <= 50
    with budget.part(0.25, 0.5):  # half of what is left
        assert 49 < budget.left() <= 50


def test_speed_rows_switch_triton_only_where_a_kernel_runs_in_the_module_form():
    from longattn.attention._triton import interpret_triton
    from longattn.bench.gpu import GpuCheckConfig, kernels_run, speed_plan

    config, cpu = GpuCheckConfig.smoke(), torch.device("cpu")
    with interpret_triton():  # the block-sparse kernels run in the interpreter as they would on a GPU
        assert kernels_run("local", 64, config, cpu)
        assert not kernels_run("fnet", 64, config, cpu)
    assert not kernels_run("local", 64, config, cpu)  # outside it no kernel runs on a CPU
    assert {triton for _, _, triton in speed_plan(["local", "fnet"], config, cpu, print)} == {None}


def _raising_build(monkeypatch, broken: str, calls: list) -> None:
    """attention.build as the bench sees it, raising for ``broken`` and counting the builds of the others."""
    from longattn.bench import gpu

    build = gpu.attention.build

    def fake(name, *args, **kwargs):
        calls.append(name)
        if name == broken:
            raise RuntimeError(f"{name} made to raise")
        return build(name, *args, **kwargs)

    monkeypatch.setattr(gpu.attention, "build", fake)


def test_a_mechanism_that_raises_is_a_recorded_row_and_resume_measures_only_what_is_missing(tmp_path, monkeypatch):
    out = tmp_path / "gpu"
    args = ["bench", "gpu", "--device", "cpu", "--smoke", "--parts", "accuracy", "speed", "--attentions", "softmax",
            "fsat", "linear", "--out", str(out)]
    calls: list[str] = []
    _raising_build(monkeypatch, "fsat", calls)
    saved = []
    from longattn.commands import _bench_gpu

    save = _bench_gpu._save
    monkeypatch.setattr(_bench_gpu, "_save", lambda folder, report: (saved.append(json.loads(json.dumps(report))),
                                                                      save(folder, report)))
    assert main(args) == 0
    report = json.loads((out / "gpu.json").read_text())
    accuracy = {row["attention"]: row for row in report["accuracy"]}
    assert accuracy["fsat"]["bf16"]["status"] == "error" and "made to raise" in accuracy["fsat"]["bf16"]["error"]
    assert all(accuracy[name][label]["status"] == "pass" for name in ("softmax", "linear")
               for label in ("fp32", "bf16", "fp16"))
    speed = {(r["attention"], r["length"]): r for r in report["speed"]}
    assert {r["status"] for k, r in speed.items() if k[0] == "fsat"} == {"error"}
    assert all(r["status"] == "ok" for k, r in speed.items() if k[0] != "fsat")
    # written after every row: the first save holds one accuracy row, a later one every speed row so far
    assert [len(s.get("accuracy", [])) for s in saved][:3] == [1, 2, 3]
    assert any(len(s.get("speed", [])) == 1 for s in saved)
    table = (out / "gpu.md").read_text()
    assert "fsat bf16: RuntimeError: fsat made to raise" in table and "fsat N=64: RuntimeError" in table

    # a run cut short: one speed row left unmeasured, one accuracy row missing; --resume measures those only
    report["speed"][-1] = {**report["speed"][-1], "status": "skipped: the speed part's time share is spent"}
    skipped = (report["speed"][-1]["attention"], report["speed"][-1]["length"])
    report["accuracy"] = [row for row in report["accuracy"] if row["attention"] != "linear"]
    (out / "gpu.json").write_text(json.dumps(report))
    calls.clear()
    assert main([*args, "--resume"]) == 0
    resumed = json.loads((out / "gpu.json").read_text())
    assert calls.count("softmax") == 0 or skipped[0] == "softmax"
    assert [r["attention"] for r in resumed["accuracy"]] == ["softmax", "fsat", "linear"]
    assert {(r["attention"], r["length"]): r["status"] for r in resumed["speed"]}[skipped] == "ok"
    assert set(calls) <= {"linear", skipped[0]} and resumed["unmeasured"] == []
