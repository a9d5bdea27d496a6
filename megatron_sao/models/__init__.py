"""Model families (HF config -> megatron-core GPTModel), the HF<->megatron mapping, and tiny test models."""
