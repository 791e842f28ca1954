"""Executes SchedulerOutputs on a model: batch tensors, forward, logits, sampling."""
