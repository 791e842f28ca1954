"""Tensor and pipeline parallelism: the groups the layers use, and joining a run's rendezvous."""
