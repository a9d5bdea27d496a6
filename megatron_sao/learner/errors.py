"""Errors the learner raises that the command line turns into a message (light: no torch / megatron import)."""


class NonFiniteTraining(RuntimeError):
    """Optimizer steps keep getting NaN/Inf gradients (learner.max_nonfinite_updates in a row)."""


class NoProducers(RuntimeError):
    """The learner waited for a batch with no rollout worker connected to the bus for bus.producer_wait_s."""
