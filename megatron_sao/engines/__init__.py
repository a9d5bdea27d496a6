"""Engines: where generation runs, and the one way every other stage talks to them.

protocol.py (SGLang's HTTP API: /generate fields, the weight-update protocol of each release, the release table) ->
client.py (HTTP client of one engine, the router over many) -> sglang_launcher.py (real SGLang servers on GPU
clusters, or embedded engines, started and stopped) and embedded/ (the CPU engine serving the same API and
enforcing the same rules). Below rollout/ (generation), weight_sync/ (pushes) and launch/ (placement), which
import it; it imports nothing above config/, bus/ and distributed/.
"""
