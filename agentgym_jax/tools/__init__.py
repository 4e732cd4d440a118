"""Tools around a run, outside the training path: the trajectory viewer, metric plots and the
memory planner."""
