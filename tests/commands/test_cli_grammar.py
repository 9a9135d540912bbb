"""The command line's one grammar, checked over the whole parser tree: help everywhere, one list syntax, one
data-folder option, at most ten verbs; the nearest-name hint; the old names as aliases; progress lines."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from longattn.cli import ALIASES, build_parser, main, resolve_aliases
from longattn.commands._args import EntryParser, ListAction, add_list_argument, help_text
from longattn.experiment.progress import GridProgress, duration

# Options that hold several values: each must take them space-separated (nargs + or *).
LIST_OPTIONS = {"attentions", "seeds", "tasks", "models", "datasets", "horizons", "lengths", "levels", "ranks",
                "procs", "grid", "lrs", "batches", "samples", "methods", "only_folds", "image_pair", "glue_tasks",
                "pretrained", "overrides", "corpus_set"}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    if isinstance(parser, EntryParser):
        parser.complete()  # an entry of bench, paper or report adds its options when it is used
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [choice for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for choice in action._choices_actions]


TREE = list(_walk(build_parser()))
OPTIONS = [(" ".join(path) or "longattn", action) for path, parser in TREE for action in parser._actions
           if action.option_strings and action.help != argparse.SUPPRESS
           and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))]


def test_top_level_has_at_most_ten_verbs_each_described(capsys):
    verbs = _subcommands(build_parser())
    assert len(verbs) <= 10
    assert all(verb.help and "\n" not in verb.help for verb in verbs)
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = re.findall(r"^    (\w[\w-]*)\s", capsys.readouterr().out, re.M)
    assert listed == [verb.dest for verb in verbs]


def test_every_subcommand_and_option_has_help():
    assert len(TREE) > 40 and len(OPTIONS) > 300
    missing = [" ".join(path) for path, parser in TREE for sub in _subcommands(parser) if not sub.help]
    assert not missing, f"subcommands without help: {missing}"
    missing = [f"{where} {action.option_strings[0]}" for where, action in OPTIONS if not action.help]
    assert not missing, f"options without help: {missing}"
    for path, parser in TREE:
        parser.format_help()  # every help renders (defaults included)


def test_one_list_syntax():
    for where, action in OPTIONS:
        flag = f"{where} {action.option_strings[0]}"
        assert "comma" not in (help_text(action) or "").lower(), f"{flag} describes a comma list"
        assert not (isinstance(action.default, str) and "," in action.default), f"{flag} defaults to a comma list"
        if action.dest in LIST_OPTIONS:
            assert action.nargs in ("+", "*"), f"{flag} takes one value, not a space-separated list"


def test_one_data_folder_option():
    folders = sorted({flag for _, action in OPTIONS for flag in action.option_strings
                      if re.search(r"-dirs?$", flag) and flag not in getattr(action, "old_spellings", ())})
    assert folders == ["--data-dir"]
    readers = {flag for _, action in OPTIONS for flag in action.option_strings
               if flag.startswith("--run") and flag not in getattr(action, "old_spellings", ())}
    assert readers == {"--run"}  # the folder a command reads


def test_defaults_are_shown():
    help_text = dict((" ".join(path), parser.format_help()) for path, parser in TREE)
    assert "(default: softmax skeleton singular fsat skein nystrom linformer)" in " ".join(
        help_text["compare mechanisms"].split())
    assert "(default: runs/compare)" in help_text["compare mechanisms"]
    assert "(default: 1024 4096 16384)" in " ".join(help_text["bench speed"].split())


def test_presets_in_help_are_the_commands_own():
    help_text = dict((" ".join(path), " ".join(parser.format_help().split())) for path, parser in TREE)
    assert "(cpu, cpu_reduced, paper)" in help_text["paper singularformer-table4"]
    assert "(cpu, paper)" in help_text["pretrain"]
    for command in ("paper singularformer-table4", "pretrain"):
        assert "demo" not in help_text[command] and "standard" not in help_text[command]


def test_list_action_takes_spaces_and_commas_with_a_nearest_name_hint(capsys):
    parser = argparse.ArgumentParser()
    add_list_argument(parser, "--names", names=lambda: ["skeleton", "softmax"], kind="mechanism")
    add_list_argument(parser, "--seeds", item=int, kind="seed", default=[0])
    for argv in (["--names", "softmax", "skeleton"], ["--names", "softmax,skeleton"],
                 ["--names", "softmax,", "skeleton"]):
        assert parser.parse_args(argv).names == ["softmax", "skeleton"]
    assert parser.parse_args([]).seeds == [0]
    assert parser.parse_args(["--seeds", "0,1", "2"]).seeds == [0, 1, 2]
    assert parser.parse_args(["--seeds", "3", "--seeds", "4"]).seeds == [3, 4]
    with pytest.raises(SystemExit):
        parser.parse_args(["--names", "softmax", "skeletn"])
    assert "unknown mechanism 'skeletn' (did you mean 'skeleton'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--seeds", "0", "one"])
    assert "expected a whole number, got 'one'" in capsys.readouterr().err
    assert isinstance(parser._option_string_actions["--seeds"], ListAction)


@pytest.mark.parametrize("argv, says", [
    (["train", "--task", "listop", "--out", "o"], "unknown task 'listop' (did you mean 'listops'?)"),
    (["compare", "sweep", "--config", "x", "--tasks", "imag", "--out", "o"], "(did you mean 'image'?)"),
    (["paper", "singularformer-table4", "--models", "post_lnn"], "unknown model 'post_lnn' (did you mean 'post_ln'?)"),
    (["finetune", "--pretrained", "minilm", "--tasks", "sst", "--data-dir", "d", "--out", "o"],
     "(did you mean 'sst2'?)"),
    (["data", "download", "etm2", "--data-dir", "d"], "unknown dataset 'etm2' (did you mean 'ETTm2'?)"),
    (["paper", "sktformer-tabel2"], "invalid choice: 'sktformer-tabel2'"),
])
def test_names_are_checked_with_a_hint(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_every_alias_names_a_command_of_today():
    paths = {path for path, _ in TREE}
    for old, new in ALIASES.items():
        command = tuple(word for word in new if not word.startswith("-"))[:2]
        assert command in paths or command[:1] in paths, (old, new)
        assert old not in paths  # an old name is no command of its own


def test_old_names_say_what_replaced_them(capsys):
    assert resolve_aliases(["forecast-table", "--out", "x"]) == ["paper", "sktformer-table2", "--out", "x"]
    assert capsys.readouterr().err.strip() == ("note: `longattn forecast-table` is now `longattn paper "
                                               "sktformer-table2`; the old name still works")
    assert resolve_aliases(["bench", "fsat-fig3"]) == ["paper", "fsat-fig3"]
    assert resolve_aliases(["curves", "runs/x"]) == ["report", "curves", "--run", "runs/x"]
    assert resolve_aliases(["curves", "--help"]) == ["report", "curves", "--help"]
    capsys.readouterr()
    assert resolve_aliases(["compare"]) == ["compare", "mechanisms"]  # the README's main job
    assert resolve_aliases(["compare", "--seeds", "0"]) == ["compare", "mechanisms", "--seeds", "0"]
    assert resolve_aliases(["compare", "sweep"]) == ["compare", "sweep"]
    assert resolve_aliases(["compare", "--help"]) == ["compare", "--help"]
    assert capsys.readouterr().err == ""


def test_old_option_spellings_still_work_with_a_note(capsys):
    parser = build_parser()
    args = parser.parse_args(["eval", "--out", "runs/x"])
    assert args.run == "runs/x" and "--out is now --run" in capsys.readouterr().err
    args = parser.parse_args(["finetune", "--pretrained", "minilm", "--glue-dir", "g", "--out", "o"])
    assert args.data_dir == os.path.abspath("g") and "--glue-dir is now --data-dir" in capsys.readouterr().err
    args = parser.parse_args(["paper", "sktformer-table3", "--corpus-dir", "c", "--glue-dir", "g", "--out", "o"])
    assert args.data_dir == ["corpus=c", "glue=g"]
    assert "--corpus-dir is now --data-dir corpus=DIR" in capsys.readouterr().err
    args = parser.parse_args(["paper", "singularformer-table4", "--report"])
    assert args.report and "longattn report crossval" in capsys.readouterr().err
    args = parser.parse_args(["paper", "singularformer-fig6", "--runs", "r"])
    assert args.run == "r"
    for hidden in ("--out DIR", "--glue-dir", "--runs"):
        assert hidden not in parser.format_help()


def test_paper_lists_what_it_reproduces(capsys):
    assert main(["paper"]) == 0
    out = capsys.readouterr().out
    for line in ("sktformer-table2  ", "SKTformer Table 2 / 16:", "singularformer-table4", "Singularformer Table 4:",
                 "sktformer-table5", "fsat-fig3", "FSAT Figure 3:", "sktformer-table3"):
        assert line in out


def test_progress_line_per_run():
    lines: list[str] = []
    progress = GridProgress(3, write=lines.append)
    progress.done("softmax / listops seed 0", 12.4, "test accuracy 0.33")
    progress.failed("skein / listops seed 0", "ValueError: bad")
    progress.skipped("skein / listops seed 1", "an earlier seed of its cell failed")
    assert re.fullmatch(r"\[1/3\] done: softmax / listops seed 0 \(12 s; test accuracy 0.33\); elapsed \d+ s, "
                        r"about \d+ s left", lines[0])
    assert lines[1].startswith("[2/3] failed: skein / listops seed 0: ValueError: bad; elapsed")
    assert lines[2].startswith("[3/3] skipped: skein / listops seed 1") and lines[2].endswith("all 3 ended")
    assert (duration(42), duration(185), duration(8040)) == ("42 s", "3 min 5 s", "2 h 14 min")


def test_data_dir_is_made_absolute_so_a_resume_from_another_directory_is_the_same_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["train", "--task", "listops", "--data-dir", "data/lra", "--out", "o"])
    assert args.data_dir == str(tmp_path / "data" / "lra")


def test_negative_switches_say_what_the_default_does():
    """``--no-X`` stores False: its help must not read "(default: True)", as if skipping were the default."""
    switches = [(where, action) for where, action in OPTIONS if isinstance(action, argparse._StoreFalseAction)]
    assert switches
    formatter = build_parser()._get_formatter()
    for where, action in switches:
        shown = formatter._expand_help(action)
        assert "default: True" not in shown, f"{where} {action.option_strings[0]}: {shown}"
        assert "without it" in shown, f"{where} {action.option_strings[0]} does not say what its absence does"


def test_demo_names_its_clock_and_threads():
    from longattn.commands.demo import clock_label

    assert clock_label(3).startswith("fwd_bwd_ms: wall time of one forward + backward after a warm-up, 3 torch threads")
    assert "1 torch thread on" in clock_label(1)
