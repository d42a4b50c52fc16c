"""KIVI 2-bit KV cache for Hugging Face transformers models."""

import kivi.attention  # noqa: E402,F401,I001  (registers the "kivi" attention function)
from kivi.cache import KiviCache, PagedKVCache  # noqa: E402
from kivi.config import KiviConfig
from kivi.models import SUPPORTED_MODEL_TYPES, check_supported, default_model, load

__all__ = ["KiviConfig", "KiviCache", "PagedKVCache", "SUPPORTED_MODEL_TYPES", "check_supported",
           "default_model", "load"]
