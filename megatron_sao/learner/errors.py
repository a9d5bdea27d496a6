"""Errors the learner raises that the command line turns into a message (light: no torch / megatron import)."""


class NonFiniteTraining(RuntimeError):
    """Optimizer steps keep getting NaN/Inf gradients (learner.max_nonfinite_updates in a row)."""
