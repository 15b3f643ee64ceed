"""Medusa-style tree speculative decoding for any transformers causal LM, lossless."""

from .accept import Sampling
from .base import UnsupportedModelError
from .config import MedusaConfig
from .dflash import load_dflash
from .dflash_propose import generate_with_dflash
from .draft import generate_with_draft, self_draft
from .generate import generate_with_lookup
from .model import MedusaModel
from .output import GenerateOutput, GenerationStats
from .tree import DynamicTree, build_tree, default_tree, grow_tree, validate_choices

__all__ = ["MedusaConfig", "MedusaModel", "GenerateOutput", "GenerationStats", "Sampling", "UnsupportedModelError",
           "DynamicTree", "build_tree", "default_tree", "grow_tree", "validate_choices", "generate_with_draft",
           "generate_with_lookup", "self_draft", "generate_with_dflash", "load_dflash"]
__version__ = "0.1.0"
