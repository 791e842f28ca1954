"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the controller that decides
who speculates. Verification lives in the runner (sampling/rejection.py)."""
