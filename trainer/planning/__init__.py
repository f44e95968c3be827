"""Sizing a run without training: parameter, FLOP and memory arithmetic, and a cluster run's time and cost."""
