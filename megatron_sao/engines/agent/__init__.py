"""The push agent: a process beside an engine that receives a shard-aware push for it and hands each of its TP ranks
its slice over SGLang's /update_weights_from_tensor (`python -m megatron_sao agent`).

handover.py (what each engine rank takes and how: the engine's own /weight_shards blocks with load_format "direct",
or, for SGLang, full HF tensors with only the rank's own experts, load_format None) -> ranks.py (the agent's ranks:
one per engine TP rank, each joining the learner's update groups as that engine rank and receiving its slice ahead
of the handover) -> server.py (the HTTP face the learner pushes to: the weight protocol answered here, everything
else passed to the engine; the handover at the session's end). Started by cli.py. To the learner an agent is an
engine that takes `sharded_bucket` pushes and keeps serving while they arrive (protocol.PUSH_AGENT).
"""
