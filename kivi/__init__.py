"""KIVI 2-bit KV cache for Hugging Face transformers models."""

from kivi.config import KiviConfig
from kivi.models import SUPPORTED_MODEL_TYPES, check_supported, default_model, load

import kivi.attention  # noqa: E402,F401,I001  (registers the "kivi" attention function)
from kivi.cache import KiviCache, PagedKVCache  # noqa: E402

__all__ = ["KiviConfig", "KiviCache", "PagedKVCache", "SUPPORTED_MODEL_TYPES", "check_supported",
           "default_model", "load"]
