"""HF <-> megatron checkpoint conversion and logit parity (tools/convert_hf_to_megatron.py,
tools/convert_megatron_to_hf.py, tools/check_parity.py are thin CLIs over these modules).

Names, shapes and layout transforms all come from models/mapping.py (with the family modules); the on-disk key
scheme of the megatron side is models/checkpoint.py. See docs/conversion.md.
"""
