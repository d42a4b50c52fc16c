"""The engine's GPU memory (pipeline/actors/engine/memory.py): what MLP chunks take out of the measured activation
workspace, that the measurement gives its blocks back to the device, and a real out-of-memory error in the middle
of a CUDA graph capture."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(DEVICE == "cpu", reason="measure_workspace counts CUDA allocations")
def test_mlp_chunks_shrink_the_measured_workspace():
    """The engine's workspace measurement (a prefill forward's peak) under MLP chunks: wide MLPs' gate/up products
    dominate it, so chunks of 256 of 4,096 tokens must take most of it away."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import kivi_kernels
    from kivi.fused import FusedLayers
    from pipeline.actors.engine.memory import measure_workspace

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=8192, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                                  max_position_embeddings=8192, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(DEVICE).eval()
    whole = measure_workspace(model, 4096, 300, 1)
    with FusedLayers(model, kivi_kernels.get_ops("triton"), mlp_chunk_tokens=256):
        chunked = measure_workspace(model, 4096, 300, 1)
    assert chunked < 0.4 * whole, (chunked, whole)


@pytest.mark.skipif(DEVICE == "cpu", reason="measure_workspace counts CUDA allocations")
def test_measured_workspace_leaves_nothing_reserved():
    """The workspace forward's blocks go back to the device: the cache allocated next must not be carved out of
    them (without expandable segments that fragmented a 40 GiB build into an out-of-memory error)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.actors.engine.memory import measure_workspace

    hidden = int(torch.randint(2, 5, ()).item()) * 64
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  max_position_embeddings=8192, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(DEVICE).eval()
    measure_workspace(model, 8192, 300, 4)  # once first: cuBLAS's workspace and the like stay, as they would
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    workspace = measure_workspace(model, 8192, 300, 4)
    assert workspace > 8192 * 4 * hidden * 2  # the gate/up products of 8,192 tokens were really measured
    assert torch.cuda.memory_reserved() - reserved <= 2**21, (torch.cuda.memory_reserved(), reserved)


@pytest.mark.skipif(DEVICE == "cpu", reason="a real CUDA out-of-memory error inside a CUDA graph capture")
def test_out_of_memory_while_capturing_a_graph_rebuilds_and_completes(monkeypatch):
    """The allocator fails in the middle of torch.cuda.graph (64 TiB asked for while the first decode graph is
    captured): the capture is abandoned, the build retries on a smaller budget, and the requests give the tokens
    of an engine that never failed."""
    from pipeline.actors.engine import model_runner
    from tests.engine_cases import gpu_fp32_tokens, requests

    seed = int(torch.randint(0, 1000, ()))
    reqs = requests([90, 300, 17], [20, 35, 12], seed=seed)
    expected, _ = gpu_fp32_tokens(reqs, max_batch_size=4)
    real_body, failures = model_runner.ModelRunner._decode_graph_body, []

    def body(self, batch, short=False):
        if torch.cuda.is_current_stream_capturing() and not failures:
            failures.append(batch)
            torch.empty(2**46, dtype=torch.uint8, device=DEVICE)
        return real_body(self, batch, short)

    monkeypatch.setattr(model_runner.ModelRunner, "_decode_graph_body", body)
    tokens, engine = gpu_fp32_tokens(reqs, max_batch_size=4)
    assert len(failures) == 1 and engine.stats()["oom_retries"] == 1  # the first (widest) graph failed
    assert tokens == expected, f"seed {seed}"
    assert len(engine.runner.graphs) == len(engine.runner.buckets) + len(
        model_runner.padded_widths(4))
