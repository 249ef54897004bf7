"""Chunked prefill equals one prefill: a prompt prefilled in chunks (every chunk attends the prefix so far and its
own tokens causally; placement and the record wait for the last chunk) gives the logits, tokens, recorded rows
(one prefill row per layer carrying every prompt token), scores and final tiers of the unchunked run, for full,
evict and hierarchy, at batch 1 and batched; and the trace CLI records the chunk size."""

from __future__ import annotations

import pytest
import torch
from test_batched import POLICIES, RECORDED, settings, tiny_model

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, prefill_chunks
from tracer.recorder import Recorder

PROMPTS = [list(range(3, 3 + n)) for n in (61, 17, 40)]  # 61 tokens: chunks 13+16+16+16 with chunk 16
MAX_NEW = 24


def run(model, policy: str, chunk: int | None, batch_size: int = 1) -> dict[int, tuple]:
    jobs = [DecodeJob(i, ids, settings(policy), Recorder()) for i, ids in enumerate(PROMPTS)]
    cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
    out = {}
    for job, result in decode_batch(model, jobs, cache, batch_size, MAX_NEW, set(), keep_logits=True,
                                    prefill_chunk_tokens=chunk):
        rows = {name: list(job.recorder.columns[name]) for name in (*RECORDED, "query_tokens")}
        layer = result.cache.layers[1]
        out[job.key] = (result.generated_ids, torch.stack(result.logits), rows, layer.final_tiers().tolist(),
                        layer.token_scores.clone() if layer.token_scores is not None else None,
                        len(job.recorder.step_us))
    return out


def test_prefill_chunks_cover_the_prompt_in_order():
    assert prefill_chunks(61, 16) == [slice(0, 13), slice(13, 29), slice(29, 45), slice(45, 61)]  # remainder first
    assert prefill_chunks(64, 16) == [slice(0, 16), slice(16, 32), slice(32, 48), slice(48, 64)]
    assert prefill_chunks(16, 16) == [slice(0, 16)] and prefill_chunks(5, None) == [slice(0, 5)]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("batch_size", [1, 3])
def test_chunked_prefill_equals_one_prefill(policy, batch_size):
    model = tiny_model("qwen2")
    whole = run(model, policy, None, batch_size)
    for chunk in (16, 7):
        chunked = run(model, policy, chunk, batch_size)
        for key, (tokens, logits, rows, tiers, scores, n_steps) in whole.items():
            got_tokens, got_logits, got_rows, got_tiers, got_scores, got_steps = chunked[key]
            assert got_tokens == tokens and got_steps == n_steps == MAX_NEW, (chunk, key)
            assert (got_logits - logits).abs().max().item() <= 1e-4, (chunk, key)
            assert got_rows == rows, (chunk, key)  # the same placement, and one prefill row of every prompt token
            assert got_tiers == tiers
            if scores is not None:  # the buffers grow in different steps; the scored positions are compared
                n = len(PROMPTS[key]) + MAX_NEW - 1
                torch.testing.assert_close(got_scores[:n], scores[:n], rtol=1e-5, atol=1e-6)
        prefill = [q for q, s in zip(rows["query_tokens"], rows["step"]) if s == 0]
        assert prefill == [len(PROMPTS[key])] * model.config.num_hidden_layers


def test_trace_records_and_checks_the_prefill_chunk(tmp_path, capsys):
    from thoughtkv.cli import main
    from traces.reader import open_run

    out = tmp_path / "run"
    assert main(["trace", "--model", "micro", "--task", "chains", "--n-samples", "1", "--max-new-tokens", "4",
                 "--prefill-chunk-tokens", "8", "--out", str(out)]) == 0
    assert open_run(out).manifest["tracer"]["prefill_chunk_tokens"] == 8
    capsys.readouterr()
    assert main(["trace", "--model", "micro", "--task", "chains", "--n-samples", "1", "--prefill-chunk-tokens", "0",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "--prefill-chunk-tokens must be at least 1" in capsys.readouterr().err


def test_fresh_rows_are_prefilled_together_within_one_chunks_scores():
    """m rows padded to L attend m x L x L prefill scores: grouped within chunk x chunk, all at once unchunked."""
    from tracer.decode import _prefill_groups

    assert _prefill_groups([0, 1, 2], [100, 100, 100], 256) == [[0, 1, 2]]  # 3 x 100^2 <= 256^2
    assert _prefill_groups([0, 1, 2], [200, 200, 100], 256) == [[0], [1], [2]]  # 2 x 200^2 > 256^2
    assert _prefill_groups([4, 5, 6, 7], [60, 250, 10, 10], 256) == [[4], [5], [6, 7]]
    assert _prefill_groups([0, 1, 2], [200, 5000, 100], None) == [[0, 1, 2]]


@pytest.mark.parametrize("scorer", ["snapkv", "rkv"])
def test_a_window_scorer_sees_the_unchunked_prefills_last_queries(scorer):
    """snapkv and rkv score a prefill by its last `window` queries (32 and 8): with the remainder chunked first,
    the last chunk is a whole one, so a chunk of at least the window gives the unchunked run's scores and
    placement (with the remainder last, the 61-token prompt's last chunk of 40 would hold 21 queries: fewer than
    snapkv's window)."""
    from tracer.cache import TierSettings
    from tracer.scorers import build_scorer
    from traces.policy import PolicySpec

    model = tiny_model("qwen2")
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, recall_k=2, block_size=4, sink_tokens=4, window_tokens=8,
                      scorer=scorer)

    def scores(chunk: int | None) -> tuple[list[torch.Tensor], list]:
        job = DecodeJob(0, PROMPTS[0], TierSettings(spec=spec, scorer=build_scorer(scorer)), Recorder())
        [(_, result)] = decode_batch(model, [job], TieredCache(model.config.num_hidden_layers, job.settings), 1, 1,
                                     set(), prefill_chunk_tokens=chunk)
        return [layer.token_scores[: len(PROMPTS[0])].clone() for layer in result.cache.layers], \
            job.recorder.columns["offloaded_block_ids"]

    (whole, moved), (chunked, chunked_moved) = scores(None), scores(40)
    assert chunked_moved == moved and sum(map(len, moved)) > 0
    for want, got in zip(whole, chunked, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
