"""transformers' custom_generate folder for medusa_spec:
`base_model.generate(..., custom_generate=medusa_spec.hf_generate.CUSTOM_GENERATE, trust_remote_code=True,
medusa_heads=...)`. transformers copies and runs this file; the code it runs is medusa_spec.hf_generate."""

from medusa_spec.hf_generate import generate

__all__ = ["generate"]
