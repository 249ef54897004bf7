"""The long bundled workload `chains_long`: long enough for a KV budget to bind, in the
bundled vocabulary, with its own held-out split; `chains` itself unchanged."""

from __future__ import annotations

import random

import pytest

from tracer.micro.tokenizer import build_tokenizer
from tracer.tasks import get_task
from tracer.tasks.chains import FILLERS, VAR_LOOKUP, ChainsConfig, generate_problem, heldout_problem
from tracer.tasks.chains_long import (
    LONG_CONFIG,
    heldout_long_problem,
    length_stats,
    lookup_distances,
    sequence_length,
)


def test_long_problems_use_only_the_bundled_vocabulary():
    vocab = build_tokenizer().get_vocab()
    for i in range(50):
        problem = heldout_long_problem(i)
        assert all(w in vocab for w in problem.prompt_words + problem.answer_words)


def test_length_and_lookup_distance_meet_the_issue_bars():
    stats = length_stats(500)
    assert stats["median_length"] >= 512
    assert stats["max_lookup_distance"] >= 256 and stats["share_lookups_ge_256"] >= 0.2
    # Independently: the tokenizer's own count of a problem's tokens (+ <eos>) is what sequence_length says.
    tokenizer = build_tokenizer()
    problem = heldout_long_problem(3)
    assert len(tokenizer(problem.prompt + " " + problem.answer)["input_ids"]) + 1 == sequence_length(problem)


def test_lookup_distance_points_at_the_binding_it_copies():
    problem = heldout_long_problem(7)
    sequence = ["<bos>", *problem.prompt_words, *problem.answer_words]
    offset = 1 + len(problem.prompt_words)
    positions = [offset + j for j, role in enumerate(problem.answer_roles) if role.endswith("lookup")
                 and role != "step_lookup"]
    distances = lookup_distances(problem)
    assert len(distances) == len(positions) > 0
    for position, distance in zip(positions, distances):
        name, value = sequence[position - 1], sequence[position]
        # the nearest earlier word binding this name, found by scanning back (independent of last_binding)
        source = next(p for p in range(position - 1, -1, -1) if sequence[p] == f"{name}={value}")
        assert position - distance == source
    var_distances = [d for d, j in zip(distances, positions) if problem.answer_roles[j - offset] == VAR_LOOKUP]
    assert max(var_distances) >= 256  # the last steps look far back into the prompt


def test_each_step_thinks_all_ten_fillers_once_starting_at_its_result():
    problem = heldout_long_problem(0)
    text = " ".join(problem.answer_words)
    first_step_result = int(problem.answer_words[problem.answer_words.index("=") + 1])
    cycle = " ".join(FILLERS[(first_step_result + j) % 10] for j in range(10))
    # ... and the cycle ends just before it would repeat: the next word starts step 2's statement.
    assert f"r1={first_step_result} . {cycle} r2.x=" in text


def test_task_registry_split_and_chains_unchanged():
    task = get_task("chains_long")
    samples = task.load(20)
    assert [s.sample_id for s in samples] == [f"chains_long/test/{i}" for i in range(20)]
    assert samples[5].gold == heldout_long_problem(5).gold
    assert task.extract_answer(heldout_long_problem(5).answer) == samples[5].gold
    short = {heldout_problem(i).prompt for i in range(2000)}
    assert not any(s.prompt in short for s in task.load(500))
    # `chains` is the task the shipped model was trained on: its held-out problems are what they were.
    assert heldout_problem(0) == generate_problem(random.Random("chains/test/0"), ChainsConfig())
    assert get_task("chains").config == ChainsConfig()
    with pytest.raises(Exception, match="drop --data-file"):
        task.load(1, data_file="x.jsonl")


def test_long_training_batches_are_deterministic_and_skip_held_out_problems():
    from tracer.micro.train import RECIPES, TrainConfig, training_batch

    cfg = TrainConfig(task="chains_long", batch_size=8)
    held_out = {heldout_long_problem(i).prompt for i in range(200)}
    for stage in range(len(RECIPES["chains_long"].stages)):
        batch = training_batch(5, stage, cfg, held_out)
        assert batch == training_batch(5, stage, cfg, held_out)
        assert not any(p.prompt in held_out for p in batch)
    final = [p for p in training_batch(0, 2, cfg, set()) if "recall" not in p.prompt_words]
    guarded = training_batch(0, 2, cfg, {p.prompt for p in final})
    assert not any(p.prompt in {q.prompt for q in final} for p in guarded)
    assert LONG_CONFIG.fillers_per_step == 10
    with pytest.raises(Exception, match="known tasks"):
        TrainConfig(task="nope")


def test_fine_tune_shortened_before_the_decay_resumes_to_the_shorter_runs_weights(tmp_path):
    """The recipe's claim in tracer/assets/micro_long/README.md: a run whose --max-steps is lowered at a
    checkpoint before its decay phase ends with the weights of a run started with the lower value."""
    import json

    import torch
    from safetensors.torch import load_file

    from tracer.micro.train import TrainConfig as Config
    from tracer.micro.train import train
    from tracer.models import MICRO_DIR

    small = dict(task="chains_long", init_from=str(MICRO_DIR), batch_size=2, warmup_steps=2, probe_every=2,
                 probe_size=2, checkpoint_every=2, log_every=1, threads=1)
    train(tmp_path / "straight", Config(max_steps=5, **small), resume=False)
    train(tmp_path / "shortened", Config(max_steps=8, **small), resume=False, stop_at=2)
    train(tmp_path / "shortened", Config(max_steps=5, **small), resume=True)
    straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    shortened = load_file(str(tmp_path / "shortened" / "model.safetensors"))
    for name in straight:
        torch.testing.assert_close(shortened[name], straight[name], rtol=1e-5, atol=1e-6)
    log = [json.loads(line) for line in (tmp_path / "shortened" / "train_log.jsonl").read_text().splitlines()]
    assert {"event": "resume", "step": 2, "changed": {"max_steps": 5}} in log


def test_bundled_long_model_thinks_the_whole_long_chain_and_answers(tmp_path):
    """The shipped tracer/assets/micro_long through `thoughtkv trace`'s code path: the full 492-token chain of
    thought (what makes the workload long), ending at <eos>, with the right answer. Its 500-problem accuracy is
    in tracer/assets/micro_long/README.md; three problems here keep the test short."""
    from tracer.micro.table_long import MODEL_DIR
    from tracer.run import TraceConfig, run_trace
    from traces.reader import open_run

    config = TraceConfig(model=str(MODEL_DIR), task="chains_long", out=str(tmp_path / "run"), n_samples=3,
                         policy="full", max_new_tokens=600, access=False)
    samples = open_run(run_trace(config, progress=False)).samples()
    for row in samples.itertuples():
        index = int(row.sample_id.rsplit("/", 1)[1])
        assert row.generated_text.split() == heldout_long_problem(index).answer_words  # token for token
        assert row.correct and row.stop_reason == "eos" and row.generated_tokens == 492


def test_long_table_grid_is_the_issues_grid(tmp_path):
    from tracer.micro.table_long import cells, headline, trace_config, write_markdown

    grid = cells("all")
    assert len(grid) == 1 + 4 * (3 + 3 * 2) + 3 and len({c.name for c in grid}) == len(grid)
    hierarchy = [c for c in grid if c.policy == "hierarchy" and c.recall_rule == "quest"]
    assert {(c.hbm_budget, c.recall_budget, c.evict_ratio) for c in hierarchy} == {
        (b, r, e) for b in (0.1, 0.2, 0.3, 0.5) for r in (0.05, 0.1, 0.2) for e in (0.0, 0.1)}
    per_head = [c for c in grid if c.recall_rule == "quest-per-head"]  # the figure's rule comparison
    assert {(c.hbm_budget, c.recall_budget, c.evict_ratio) for c in per_head} == {(0.3, r, 0.0) for r in (0.05, 0.1, 0.2)}
    assert trace_config(per_head[0], tmp_path, 200).recall_rule == "quest-per-head"
    assert {(c.hbm_budget, c.scorer) for c in grid if c.policy == "evict"} == {
        (b, s) for b in (0.1, 0.2, 0.3, 0.5) for s in ("recency", "h2o", "tova")}
    assert [c.hbm_budget for c in cells("key")[1:]] == [0.3] * 9
    cell = hierarchy[0]
    config = trace_config(cell, tmp_path, 200)
    assert (config.policy, config.hbm_budget, config.recall_budget, config.task) == (
        "hierarchy", cell.hbm_budget, cell.recall_budget, "chains_long")
    assert trace_config(grid[0], tmp_path, 200).n_samples == 500  # the full cell is the 500-problem check
    assert headline(tmp_path).startswith("In one sentence: not yet")
    write_markdown(tmp_path / "t.md", tmp_path)
    assert "Cells not run yet: 40 of 40." in (tmp_path / "t.md").read_text()
    assert (tmp_path / "capacity_accuracy_long.csv").read_text() == ""  # no cell has run: no rows


def test_accuracy_vs_recall_figure_draws_every_cell_of_the_csv():
    """One curve per (HBM budget, recall rule) of the hierarchy cells with nothing evicted, pure eviction's best
    scorer at zero recall per budget, the full cache as a band; evict-0.1 cells are not on it."""
    import pandas as pd

    from analysis.figures import accuracy_vs_recall

    rows = [dict(policy="full", hbm_budget=1.0, scorer="h2o", evict_ratio=0.0, recall_rule=None, n=500,
                 accuracy=1.0, ci_low=0.99, ci_high=1.0, recalled_frac=0.0)]
    for budget in (0.5, 0.3):
        for scorer, accuracy in (("recency", 0.0), ("h2o", 0.04)):
            rows.append(dict(policy="evict", hbm_budget=budget, scorer=scorer, evict_ratio=0.0, recall_rule=None,
                             n=50, accuracy=accuracy, ci_low=0.0, ci_high=0.1, recalled_frac=0.0))
        for rule in (("quest", "quest-per-head") if budget == 0.3 else ("quest",)):
            for evict in (0.0, 0.1):
                for recall in (0.05, 0.1, 0.2):
                    rows.append(dict(policy="hierarchy", hbm_budget=budget, scorer="h2o", evict_ratio=evict,
                                     recall_rule=rule, n=50, accuracy=recall * 2, ci_low=recall, ci_high=recall * 3,
                                     recalled_frac=recall * 0.95))
    figure = accuracy_vs_recall(pd.DataFrame(rows))
    ax = figure.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["full cache (n=500)", "HBM 50%, recall quest (n=50)", "HBM 50%, pure eviction (h2o, n=50)",
                      "HBM 30%, recall quest (n=50)", "HBM 30%, recall quest-per-head (n=50)",
                      "HBM 30%, pure eviction (h2o, n=50)"]
    data_lines = [container.lines[0] for container in ax.containers]  # one errorbar container per series
    curves = [line for line in data_lines if len(line.get_xdata()) == 3]
    assert len(data_lines) == 5 and len(curves) == 3
    assert all(list(line.get_xdata()) == pytest.approx([0.0475, 0.095, 0.19]) for line in curves)
    assert all(list(line.get_ydata()) == pytest.approx([0.1, 0.2, 0.4]) for line in curves)


def test_capacity_long_refuses_a_figure_with_no_runs(tmp_path, capsys):
    from thoughtkv.cli import main

    assert main(["experiment", "capacity-long", "--out", str(tmp_path / "docs"), "--runs", str(tmp_path / "runs"),
                 "--figure-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no hierarchy cell has run yet" in err[0]
