"""megatron-sao: SAO (single-rollout asynchronous optimization) RL post-training for MoE LLMs.

Data flow, one folder per stage:
    rollout/ (engines, agent loop, environments) -> bus/ (trajectory bus) -> learner/ (value, then policy
    update on megatron-core models from models/) -> weight_sync/ (reshard + broadcast) -> back to the engines.
The maths lives in algo/, the config tree in config/, the CPU platform layer in platform/ and the
torch.distributed / megatron parallel-state bootstrap in distributed/.
"""

__version__ = "0.1.0"
