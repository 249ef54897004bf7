"""Oracle (upper bound, not deployable): the attention each position receives over the whole generation in"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thoughtkv_base import UserError
from tracer.scorers.base import Scorer
from tracer.transfer import host_to_device


@dataclass
class OracleScorer(Scorer):
    """Oracle (upper bound, not deployable): the attention each position receives over the whole generation in
    a full-cache greedy pass over the same prompt (summed over its decode steps, mean over heads, per layer).

    The decode loop runs that pass first and fills `future_importance`; positions the full pass never reached
    score 0 (they are recent, so the window protects them in practice).
    """

    name: str = "oracle"
    batchable = False  # each sample has its own full pass
    future_importance: list[torch.Tensor] | None = None  # per layer, [positions]

    def score(self, obs, previous):
        if self.future_importance is None:
            raise UserError("the oracle scorer needs a full-cache pass first; use tracer.run (it runs one)")
        table = self.future_importance[obs.layer_idx]
        if table.device != previous.device or table.dtype != torch.float32:  # once per layer, not per step
            table = self.future_importance[obs.layer_idx] = host_to_device(table.float(), previous.device) \
                if table.device.type == "cpu" else table.to(previous.device, torch.float32)
        scores = torch.zeros(previous.shape[0], obs.logical_len, dtype=torch.float32, device=previous.device)
        n = min(obs.logical_len, table.shape[0])
        scores[:, :n] = table[:n]
        return scores
