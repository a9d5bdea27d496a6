"""Experiments that prove (or not) SAO on this machine: one script per experiment, each with a --quick variant.

harness.py runs an arm through the real processes and reads its records back; learning_efficiency.py,
online_adaptation.py, stability.py and ablations.py each train their arms, print a table, and write a PNG and a
JSON under docs/results/ and the table into docs/results.md (docs/results.md says what each showed).
"""
