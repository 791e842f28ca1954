"""Tensor parallelism: the rank group the layers use, and joining a run's rendezvous."""
