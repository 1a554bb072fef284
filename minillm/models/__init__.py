"""Model families, one file each, found through the registry (registry.py) and imported lazily."""

from .registry import get_model_class, hf_architectures, model_type_of, model_types, register_model

__all__ = ["get_model_class", "hf_architectures", "model_type_of", "model_types", "register_model"]
