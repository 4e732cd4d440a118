"""Environment adapters (run on host CPUs) and the AgentGym HTTP protocol."""

from environments.base import SPLITS, Env, EnvError, StepResult, make, register, registered

__all__ = ["SPLITS", "Env", "EnvError", "StepResult", "make", "register", "registered"]
