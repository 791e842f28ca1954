"""A worker extension class as an RL framework would ship one (--worker-extension-cls; vLLM's mechanism): its
methods run on the worker, `self` being the worker (its model, runner and device)."""

from __future__ import annotations

import torch


class Inspector:
    """Read and change the served model from the worker's side."""

    def num_layers(self) -> int:
        return len(self.model.layers)

    def scale_final_norm(self, factor: float) -> list:
        with torch.no_grad():
            self.model.norm.weight.mul_(factor)
        return self.model.norm.weight[:2].tolist()

    def _private(self) -> None:  # not reachable through collective_rpc
        raise AssertionError("called")
