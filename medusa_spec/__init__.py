"""Medusa-style tree speculative decoding for any transformers causal LM, lossless."""

from .accept import Sampling
from .base import UnsupportedModelError
from .config import MedusaConfig
from .generate import GenerateOutput, GenerationStats
from .model import MedusaModel
from .tree import build_tree, default_tree, grow_tree, validate_choices

__all__ = ["MedusaConfig", "MedusaModel", "GenerateOutput", "GenerationStats", "Sampling", "UnsupportedModelError",
           "build_tree", "default_tree", "grow_tree", "validate_choices"]
__version__ = "0.1.0"
