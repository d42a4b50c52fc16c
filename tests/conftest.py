import os

import pytest
import torch

# Triton kernels run in the interpreter on machines without a GPU. This must be set before any module
# defining @triton.jit functions is imported, so it lives here rather than in a test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / torch.empty_like give NaN-filled tensors (restored after the test), so an element a kernel
    does not write fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama on the CPU (vocabulary engine_cases.VOCAB, 2 layers, 4/2 heads of 32) with the "kivi"
    attention hook and no EOS: the engine tests' model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import kivi  # noqa: F401  (registers the "kivi" attention function)
    from tests.engine_cases import VOCAB

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="kivi").eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def tiny_model(tmp_path):
    """A model folder holding only a config: enough for every check a job makes before Ray starts."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")
