"""Rollout: prompts -> engines -> agent loop -> trajectories for the bus.

protocol.py (SGLang wire contract) and client.py (HTTP client + router over engines); sglang_launcher.py (real
SGLang servers on GPU clusters) and engine/ (the embedded CPU engine with the same API); agent_loop.py (multi-turn
episodes with exact token/mask/log-prob/version accounting); envs/ (tasks, tools, rewards; plug-in registry);
prompts.py (JSONL prompts, resumable cursor); worker.py (the rollout worker pushing each finished trajectory).
"""
