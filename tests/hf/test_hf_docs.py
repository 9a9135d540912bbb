"""docs/hf.md's examples run as written (with the bundled MiniLM), and its tables are filled in."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_examples_run(minilm_path, capsys):
    assert len(BLOCKS) >= 2
    namespace: dict = {}
    for block in BLOCKS:  # later blocks use names from earlier ones, as a reader would
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "'name': 'skeleton'" in out  # the reloaded model's recorded conversion


def test_mechanism_table_lists_every_mechanism():
    from longattn.attention import available

    text = DOC.read_text()
    for name in available():
        assert f"| `{name}`" in text, name
