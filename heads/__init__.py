"""Trained heads shipped with medusa_spec, one adapter folder per base model, each with its card.

This folder is installed as the package `medusa_spec.shipped_heads` (pyproject.toml maps it), so
`default_model.HEADS_DIR` finds the same files in a source checkout, an editable install and a
wheel; only the adapter files (medusa_config.json, medusa_heads.safetensors) go into the wheel.
"""
