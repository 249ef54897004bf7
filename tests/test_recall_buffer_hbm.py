"""Hits that copy nothing: with a recall buffer, the GPU's recall reads a hit from the buffer's HBM region
(`tracer.cache.recall.stage_from_buffer`) and gathers only the misses from the DDR store. Against the path that
gathers every chosen block from DDR (the CPU's, forced with `PagedLayer.hits_from_hbm = False`): the same logits
and recorded rows, and the store read for the misses only. On a CPU the region path is forced on; on CUDA it is
the default (tests/gpu/on_device.sh runs this file on the lent GPU, in its transfer-tests phase)."""

from __future__ import annotations

import pytest
import torch
from _helpers import TINY_CONFIGS
from transformers import AutoModelForCausalLM

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
from tracer.cache import TieredCache, TierSettings
from tracer.decode import DecodeJob, decode_batch
from tracer.recorder import Recorder
from tracer.scorers import build_scorer
from tracer.transfer import PinnedBlockStore
from traces.policy import PolicySpec

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
RECORDED = ("recalled_block_ids", "recall_hits", "recall_misses", "bytes_h2d", "hbm_kv_bytes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["quest", "quest-per-head", "prev-layer"])
def test_hits_read_from_the_buffers_hbm_region_give_the_logits_of_gathering_every_block(device, rule, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"](), attn_implementation="thoughtkv",
                                             dtype=torch.float32).eval().to(device)
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, recall_k=3, recall_rule=rule, block_size=4, sink_tokens=4,
                      window_tokens=8, recall_buffer_blocks=4)
    read = [0]  # block ids the DDR store was asked for
    for name in ("get_blocks", "get_into", "get_pages_into"):
        method = getattr(PinnedBlockStore, name)

        def counted(store, *args, method=method, **kwargs):
            read[0] += args[1].numel()
            return method(store, *args, **kwargs)

        monkeypatch.setattr(PinnedBlockStore, name, counted)

    def decode(from_hbm: bool):
        """Three prompts at batch 2 (a row refilled); the region path on or off for every layer."""
        generator = torch.Generator().manual_seed(3)
        jobs = [DecodeJob(i, torch.randint(3, 320, (n,), generator=generator).tolist(),
                          TierSettings(spec=spec, scorer=build_scorer("h2o")), Recorder()) for i, n in
                enumerate((41, 29, 35))]
        cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
        for layer in cache.paged:
            layer.hits_from_hbm = from_hbm if device == "cpu" or not from_hbm else None  # (CUDA: its default)
        read[0] = 0
        logits = {job.key: torch.stack(result.logits).cpu() for job, result in
                  decode_batch(model, jobs, cache, 2, 30, set(), keep_logits=True)}
        return logits, [job.recorder.steps_table() for job in jobs], read[0], cache

    gathered, tables, gathered_reads, _ = decode(False)
    from_hbm, hbm_tables, hbm_reads, cache = decode(True)
    assert all(layer.recall_region is not None and layer.recall_region.device.type == device for layer in cache.paged)
    for key, logits in gathered.items():
        torch.testing.assert_close(from_hbm[key], logits, rtol=0, atol=1e-5)
    for table, hbm_table in zip(tables, hbm_tables, strict=True):
        for name in RECORDED:
            plain = [list(v) if name == "recalled_block_ids" else v for v in table[name]]
            assert [list(v) if name == "recalled_block_ids" else v for v in hbm_table[name]] == plain, name
    misses = sum(v or 0 for table in tables for v in table["recall_misses"])
    hits = sum(v or 0 for table in tables for v in table["recall_hits"])
    assert hits > 20 and hbm_reads == misses and gathered_reads == misses + hits
