"""Turning logits into tokens: penalties, truncation, seeded sampling, log-probabilities."""
