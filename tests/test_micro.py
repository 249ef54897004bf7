"""The bundled micro model: tokenizer round-trip, offline loading from the package, a 20-sample full-cache
accuracy smoke test through the tracer's own code path, and the training loop's determinism and resume."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tracer.micro.tokenizer import build_tokenizer
from tracer.micro.train import (
    N_HELDOUT_GUARD,
    STAGES,
    TrainConfig,
    decay_start_step,
    lr_at,
    train,
    training_batch,
)
from tracer.models import MICRO_DIR
from tracer.tasks.chains import generate_problem, generate_recall, generate_statement_recall, heldout_problem

needs_model = pytest.mark.skipif(not (MICRO_DIR / "model.safetensors").is_file(), reason="micro model not trained yet")


def test_tokenizer_round_trips_every_generated_word():
    tokenizer = build_tokenizer()
    rng = random.Random(0)
    side_tasks = [generate_recall(rng, result_share=0.3) for _ in range(10)]
    side_tasks += [generate_statement_recall(rng) for _ in range(10)]
    for problem in [generate_problem(rng) for _ in range(50)] + side_tasks:
        text = problem.prompt + " " + problem.answer
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.unk_token_id not in ids
        assert len(ids) == 1 + len(problem.prompt_words) + len(problem.answer_words)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@needs_model
def test_committed_tokenizer_matches_the_code_and_loads_through_autotokenizer():
    from transformers import AutoTokenizer

    committed = AutoTokenizer.from_pretrained(MICRO_DIR, subfolder="tokenizer", local_files_only=True)
    built = build_tokenizer()
    assert committed.get_vocab() == built.get_vocab()
    text = heldout_problem(3).prompt
    assert committed(text)["input_ids"] == built(text)["input_ids"]
    assert (committed.bos_token, committed.eos_token, committed.pad_token) == ("<bos>", "<eos>", "<pad>")


@needs_model
def test_model_loads_offline_from_the_package(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tracer.models import load_model

    loaded = load_model("micro", device="cpu")
    config = loaded.model.config
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    assert loaded.manifest["random_weights"] is False
    assert config.num_hidden_layers == 3 and config.hidden_size == 192
    assert config.num_key_value_heads < config.num_attention_heads  # GQA, like the Qwen2 / R1-distill family
    assert (MICRO_DIR / "model.safetensors").stat().st_size <= 20 * 1024 * 1024
    assert 1_000_000 < loaded.manifest["n_params"] < 3_000_000
    text = heldout_problem(0).prompt  # the loader found the word-level tokenizer (one id per word)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text), skip_special_tokens=True) == text
    assert len(loaded.tokenizer.encode(text)) == 1 + len(text.split())


@needs_model
def test_twenty_held_out_problems_full_cache_accuracy_smoke(tmp_path):
    """The same code path as `thoughtkv trace --model micro --task chains --policy full`."""
    from tracer.run import TraceConfig, run_trace
    from traces.reader import open_run

    config = TraceConfig(model="micro", task="chains", out=str(tmp_path / "run"), n_samples=20, policy="full",
                         max_new_tokens=320, access=False)
    samples = open_run(run_trace(config, progress=False)).samples()
    assert len(samples) == 20
    assert (samples["stop_reason"] == "eos").all()
    # The committed model scores 500/500 on the held-out problems (tracer/micro/README.md); the bar is
    # 95%, so 19/20 is what a model meeting it gets here (a broken path or model scores ~2/20, chance).
    assert samples["correct"].sum() >= 19


def test_training_batches_are_deterministic_and_never_contain_held_out_problems():
    cfg = TrainConfig()
    held_out = {heldout_problem(i).prompt for i in range(N_HELDOUT_GUARD)}
    for stage in range(len(STAGES)):
        batch = training_batch(11, stage, cfg, held_out)
        assert batch == training_batch(11, stage, cfg, held_out)
        assert len(batch) == cfg.batch_size
        assert not {p.prompt for p in batch} & held_out
    # The guard works: with the first held-out prompts as the "training" stream they are all rejected.
    rng_batch = training_batch(0, len(STAGES) - 1, cfg, set())
    guarded = training_batch(0, len(STAGES) - 1, cfg, {p.prompt for p in rng_batch})
    assert not {p.prompt for p in guarded} & {p.prompt for p in rng_batch if "recall" not in p.prompt}


def test_learning_rate_schedule_warms_up_holds_then_decays_to_the_final_rate():
    cfg = TrainConfig(max_steps=1000, warmup_steps=100)
    assert lr_at(0, cfg) == pytest.approx(cfg.lr / 100)
    assert lr_at(99, cfg) == pytest.approx(cfg.lr)
    assert lr_at(decay_start_step(cfg) - 1, cfg) == pytest.approx(cfg.lr)
    assert decay_start_step(cfg) == 600
    assert lr_at(999, cfg) == pytest.approx(cfg.final_lr, rel=1e-3)
    decay = [lr_at(s, cfg) for s in range(600, 1000)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_interrupted_training_resumes_to_the_same_weights(tmp_path: Path):
    from safetensors.torch import load_file

    small = dict(batch_size=4, warmup_steps=2, probe_every=2, probe_size=4, checkpoint_every=100, log_every=1, threads=1)
    train(tmp_path / "straight", TrainConfig(max_steps=4, **small), resume=False)
    train(tmp_path / "resumed", TrainConfig(max_steps=4, **small), resume=False, stop_at=3)
    train(tmp_path / "resumed", TrainConfig(max_steps=4, **small), resume=True)
    straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6)


def test_composed_embeddings_share_parts_and_bake_into_a_plain_qwen2_model():
    from transformers import Qwen2ForCausalLM

    from tracer.micro.train import Encoder, MicroLM, model_config, word_parts

    assert word_parts("r7.y=q") == ["r7", "field:y", "q"]
    assert word_parts("b=4") == ["b", "4", "field:bind"]
    assert word_parts("hmm") == []
    torch.manual_seed(0)
    encoder = Encoder(build_tokenizer())
    model = Qwen2ForCausalLM(model_config(len(encoder.vocab), encoder.pad_id, encoder.bos_id, encoder.eos_id))
    lm = MicroLM(model, encoder.vocab)
    with torch.no_grad():
        lm.parts.normal_()  # parts far from zero, so a wrong composition shows
    # A statement word's row = its free row + the rows of its step, field and operand parts.
    vocab, matrix = encoder.vocab, lm.embedding_matrix()
    free = model.model.embed_tokens.weight
    parts = {name: lm.parts[i] for i, name in enumerate(sorted({p for w in vocab for p in word_parts(w)}))}
    expected = free[vocab["r7.y=q"]] + parts["r7"] + parts["field:y"] + parts["q"]
    torch.testing.assert_close(matrix[vocab["r7.y=q"]], expected)
    torch.testing.assert_close(matrix[vocab["hmm"]], free[vocab["hmm"]])
    input_ids, mask, _, _ = encoder.batch([generate_problem(random.Random(i)) for i in range(3)])
    with torch.no_grad():
        composed = lm(input_ids, mask)
        lm.bake()
        plain = model(input_ids=input_ids, attention_mask=mask).logits
    torch.testing.assert_close(plain, composed, rtol=1e-5, atol=1e-5)
