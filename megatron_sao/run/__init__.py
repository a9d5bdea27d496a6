"""The run: engines -> rollout workers -> bus -> learner -> weight sync -> engines.

learn.py is the learner's loop (every learner rank); local.py starts the engines, a rollout worker and the learner
on this machine (launch.mode=local, what ./launch.sh runs); rollout/cli.py is the rollout worker process.
"""
