"""Why a speculated query misses (`thoughtkv experiment recall-design --agreement`): per layer, the share of the
true DDR attention mass held by the blocks picked under the current query, under the query speculated from the
previous layer's input and under the previous step's query."""

from __future__ import annotations

import json
from pathlib import Path

from thoughtkv.experiments.recall_design_settings import AGREEMENT_CELL, AGREEMENT_N
from thoughtkv_base.markdown import markdown_table


def agreement_lines(agreement: dict | None) -> list[str]:
    """The per-layer agreement of the speculated queries' picks with the current query's (`speculation_agreement`)."""
    if not agreement:
        return []
    layers = sorted(agreement["layers"], key=int)
    header = ("query the picks are made under", *(f"layer {layer}" for layer in layers))
    rows = [(label, *(f"{100 * agreement['layers'][layer][key]:.1f}%" for layer in layers))
            for key, label in (("current", "the current query (quest-per-head)"),
                               ("prev-layer", "prev-layer's (layer i's from layer i-1's input)"),
                               ("prev-step", "prev-step's (the layer's previous step's)"))]
    return [
        f"Why (measured: `speculation_agreement`, {agreement['n']} problems decoded under prev-layer-per-head at "
        f"{agreement['hbm_budget']:.0%} HBM, recall ≤ {agreement['recall_budget']:.0%}, "
        f"{agreement['requests']} batched recall requests per layer): of the attention the current query puts on the DDR blocks "
        "(an exact softmax, as the oracle's), the share quest-per-head's picks hold when made under each query, per "
        "layer, at the same step over the same blocks. A pick follows the look-up the current step makes: the "
        "previous step's query made the previous look-up, and on this 3-layer model prev-layer speculates layer 0 "
        "from the previous step and layer 1 from the token embedding alone (layer 0's input), so only layer 2's "
        "speculation starts from a hidden state that has attended; a deep model has one such layer in its first "
        "two, not two in three.",
        "",
        *markdown_table(header, (row for row in rows)),
    ]


# -- the served frontier point ---------------------------------------------------------------------------------


def _ddr_mass(request) -> list:
    """Per recalling row: [Hkv, n_blocks] the current query's true attention mass (mean over each KV head's query
    group, an exact softmax over the row's resident and DDR keys, as the oracle rule computes it) on each block
    in DDR (0 elsewhere)."""
    import torch

    layer, rows = request.layer, request.rows
    row_ids = list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()
    in_ddr = layer.ddr.bounds.in_ddr(rows, request.n_blocks)
    scaling = request.scaling if request.scaling is not None else layer.head_dim ** -0.5
    out = []
    for i, row in enumerate(row_ids):
        ddr_ids = in_ddr[i].nonzero().squeeze(1)
        stored = layer.slot_pos[row, layer.main_slots] >= 0
        resident = layer.keys[row][:, layer.main_slots][:, stored]
        ddr_keys = layer.ddr.get(torch.full_like(ddr_ids, row), ddr_ids, row=row)[0]
        ddr_keys = ddr_keys.permute(1, 0, 2, 3).flatten(1, 2).to(resident.dtype)
        keys = torch.cat([resident, ddr_keys], 1).float()
        weights = torch.softmax(torch.einsum("hgd,hkd->hgk", request.query[i].float(), keys) * scaling, -1)
        mass = torch.zeros(keys.shape[0], request.n_blocks)
        mass[:, ddr_ids] = weights[..., resident.shape[1]:].mean(1).view(keys.shape[0], len(ddr_ids), -1).sum(2)
        out.append(mass)
    return out


def _captured(choice, masses) -> list[float]:
    """Per row: the DDR attention mass each KV head's own picks hold, averaged over the KV heads."""
    out = []
    for i, (n, mass) in enumerate(zip(choice.per_row, masses, strict=True)):
        ids, picks = choice.ids[i, :n], choice.head_picks[i, :n].t()  # [Hkv, n]
        out.append(float((mass[:, ids] * picks).sum(1).mean()))
    return out


def speculation_agreement(work: Path, n_samples: int = AGREEMENT_N, log=print) -> dict:
    """Per layer, the current query's attention mass on the DDR blocks (`_ddr_mass`: what a recall can bring back)
    that quest-per-head's picks hold under the current query and under each speculated query (prev-layer's,
    prev-step's), at the same step over the same blocks, as a share of all of it: `n_samples` problems of the
    table's workload decoded under prev-layer-per-head at `AGREEMENT_CELL` (the trajectory is a speculative
    rule's), every recall request scored three ways. Cached as WORK/speculation_agreement.json."""
    import dataclasses
    import shutil
    from collections import defaultdict

    from tracer.cache import recall_rules
    from tracer.micro.table_long import HIERARCHY_SCORER, trace_config
    from tracer.micro.table_long import Cell as LongCell
    from tracer.run import run_trace
    from traces.layout import write_atomic

    totals: dict = defaultdict(lambda: defaultdict(float))
    rules = {"current": recall_rules.QuestPerHead(), "prev-layer": recall_rules.PrevLayerPerHead(),
             "prev-step": recall_rules.PrevStepPerHead()}
    requests = defaultdict(int)

    class Measured(recall_rules.PrevLayerPerHead):
        def select(self, request):
            masses, layer = _ddr_mass(request), str(request.layer.layer_idx)
            choices = {key: rule.select(request) for key, rule in rules.items()}
            for key, choice in choices.items():
                totals[layer][key] += sum(_captured(choice, masses))
            totals[layer]["all"] += sum(float(m.sum(1).mean()) for m in masses)
            requests[layer] += 1
            return choices["prev-layer"]

    registry, name = recall_rules.RECALL_RULES, "prev-layer-per-head"
    kept = registry[name]
    hbm, recall = AGREEMENT_CELL
    shutil.rmtree(work / "agreement", ignore_errors=True)  # (a run resumed would decode nothing)
    config = trace_config(LongCell("hierarchy", hbm, HIERARCHY_SCORER, 0.0, recall, name), work / "agreement",
                          n_samples, batch_size=16)
    registry[name] = Measured()  # (this measurement's decode only; restored below)
    try:
        log(f"recall-design: measuring the speculation agreement on {n_samples} problems")
        run_trace(dataclasses.replace(config, out=str(work / "agreement" / "run"), threads=1), progress=False)
    finally:
        registry[name] = kept
    result = {"n": n_samples, "hbm_budget": hbm, "recall_budget": recall,
              "requests": min(requests.values()) if requests else 0,
              "layers": {layer: {k: v / max(t["all"], 1e-30) for k, v in t.items() if k != "all"}
                         for layer, t in totals.items()}}
    write_atomic(work / "speculation_agreement.json", lambda temp: temp.write_text(json.dumps(result, indent=1)))
    return result
