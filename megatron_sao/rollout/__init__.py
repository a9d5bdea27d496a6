"""Rollout: prompts -> engines -> agent loop -> trajectories for the bus.

agent_loop.py (multi-turn episodes with exact token/mask/log-prob/version accounting, through engines/client.py);
envs/ (tasks, tools, rewards; plug-in registry); prompts.py (JSONL prompts, resumable cursor); worker.py (the
rollout worker pushing each finished trajectory); cli.py (`python -m megatron_sao rollout`). The engines it
generates on live in engines/.
"""
