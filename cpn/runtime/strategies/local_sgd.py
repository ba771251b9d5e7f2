"""``local_sgd``: every site trains H steps alone, then the sites' parameters are averaged.

It is DiLoCo with the outer optimiser fixed to plain averaging (outer SGD, lr 1, no momentum): the
same elastic leader exchange, the same hierarchical shape (intra-site every step, WAN every H).
"""

from __future__ import annotations

import torch

from cpn.runtime.strategies.diloco import DiLoCo


class LocalSGD(DiLoCo):
    name = "local_sgd"

    def _outer_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.theta], lr=1.0, momentum=0.0)
