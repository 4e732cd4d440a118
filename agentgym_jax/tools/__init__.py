"""Tools around a run: the trajectory viewer and metric plots."""
