"""Train the bundled micro reasoning model on `chains`, with plain PyTorch, from one seeded command:

    python -m tracer.micro train --out DIR [--seed 0] [--max-steps 2400] [--threads 1]

Recipe (measured in shared/notes/micro-model-first-try.md): a curriculum of four stages that advances when the
stage's probe shows variable look-ups learned; a recall side-task mixed in so that look-ups are most of the
signal; loss on chain-of-thought tokens only; old-result look-ups raised to 50% of steps in the final stage; a
cosine decay to lr/10 over the last 40% of steps (the final stage is forced there). Batches are a pure function of
(seed, step), so a resumed run sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from tracer.micro.tokenizer import PAD, TOKENIZER_SUBFOLDER, build_tokenizer
from tracer.tasks.chains import (
    ROLES,
    VAR_LOOKUP,
    ChainsConfig,
    Problem,
    generate_problem,
    generate_recall,
    generate_statement_recall,
    heldout_problem,
)
from tracer.tasks.chains_long import LONG_CONFIG, heldout_long_problem

IGNORE = -100
N_HELDOUT_GUARD = 2000  # training rejects any problem whose prompt equals one of the first held-out prompts


@dataclass(frozen=True)
class Stage:
    chains: ChainsConfig
    recall_share: float  # share of the batch that is a recall side-task (half variables, half statements)


EVAL_CONFIG = ChainsConfig()  # the held-out distribution (old-result share 0.2)
# Long programs come in early (stage 1 reaches 6 steps, stage 2 all 8): in the previous recipe 5-8-step
# problems appeared only in the last stage and their statement look-ups never caught up.
STAGES = (
    Stage(ChainsConfig(2, 4, 1, 3, fillers_per_step=0), recall_share=0.4),
    Stage(ChainsConfig(3, 8, 2, 6), recall_share=0.4),
    Stage(ChainsConfig(5, 10, 3, 8), recall_share=0.3),
    Stage(replace(EVAL_CONFIG, old_result_share=0.5), recall_share=0.15),  # old results are learnt last
)
# `chains_long`: fine-tuned from the shipped `chains` model, which already does every look-up; what is
# new is the ten-phrase filler cycle after each step (and when it ends) and look-ups ~500 tokens back. Stage 0
# teaches the cycle on short programs (cheap batches), stage 1 stretches the programs, stage 2 is the held-out
# distribution with old-result look-ups raised as in `chains`. The recall side tasks stay at 10% so that the
# look-ups learnt before are kept.
LONG_STAGES = (
    Stage(ChainsConfig(3, 8, 2, 4, fillers_per_step=10), recall_share=0.1),
    Stage(ChainsConfig(6, 12, 4, 8, fillers_per_step=10), recall_share=0.1),
    Stage(replace(LONG_CONFIG, old_result_share=0.5), recall_share=0.1),
)


@dataclass(frozen=True)
class Recipe:
    stages: tuple[Stage, ...]
    eval_config: ChainsConfig  # the held-out distribution: the last stage's probe uses it
    heldout: object  # index -> held-out Problem; training rejects any problem equal to one of them


RECIPES = {  # task -> its curriculum; a plain dict, built here once
    "chains": Recipe(STAGES, EVAL_CONFIG, heldout_problem),
    "chains_long": Recipe(LONG_STAGES, LONG_CONFIG, heldout_long_problem),
}
RECALL_RESULT_SHARE = 0.3  # share of result names (`r7=3`) among the variable-recall side task's names


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    max_steps: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    final_lr: float = 3e-4
    warmup_steps: int = 200
    decay_fraction: float = 0.4  # cosine decay over the last 40% of steps
    weight_decay: float = 0.05
    clip_norm: float = 1.0
    earlier_stage_share: float = 0.3
    probe_every: int = 100
    probe_size: int = 128
    advance_var_lookup: float = 0.95
    advance_sequence_exact: float = 0.5
    checkpoint_every: int = 250
    log_every: int = 25
    threads: int = 2
    kv_heads: int = 3  # 6 query heads share 3 KV heads (GQA, as in the Qwen2 / R1-distill models)
    composed_embeddings: bool = True
    task: str = "chains"  # a key of RECIPES
    init_from: str = ""  # a model directory to fine-tune from (weights only; a fresh optimizer), "" = scratch

    def __post_init__(self) -> None:
        from thoughtkv_base import UserError

        if self.task not in RECIPES:
            raise UserError(f"train --task {self.task!r}: known tasks are {', '.join(RECIPES)}")
        if self.init_from and not (Path(self.init_from) / "model.safetensors").is_file():
            raise UserError(f"train --init-from {self.init_from}: no model.safetensors there; give a model directory")

    @property
    def stages(self) -> tuple[Stage, ...]:
        return RECIPES[self.task].stages


def model_config(vocab_size: int, pad_id: int, bos_id: int, eos_id: int, kv_heads: int = 3) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_start = decay_start_step(cfg)
    if step < decay_start:
        return cfg.lr
    progress = (step - decay_start) / max(1, cfg.max_steps - decay_start)
    return cfg.final_lr + 0.5 * (cfg.lr - cfg.final_lr) * (1 + math.cos(math.pi * progress))


def decay_start_step(cfg: TrainConfig) -> int:
    return int(cfg.max_steps * (1 - cfg.decay_fraction))


STATEMENT_WORD = re.compile(r"^(r\d+)\.(x|op|y)=(.+)$")  # r7.x=q
BINDING_WORD = re.compile(r"^([a-z]|r\d+)=(\d)$")  # b=4, r7=3


def word_parts(word: str) -> list[str]:
    """The shared parts a word's embedding is built from: `r7.x=q` = r7 + field x + q; `b=4` = b + 4 + field
    bind; a name, digit or operator is its own part (shared with every composite word that contains it)."""
    if match := STATEMENT_WORD.match(word):
        return [match[1], f"field:{match[2]}", match[3]]
    if match := BINDING_WORD.match(word):
        return [match[1], match[2], "field:bind"]
    if re.fullmatch(r"[a-z]|r\d+|\d|[-+*]", word):
        return [word]
    return []


class MicroLM(torch.nn.Module):
    """The Qwen2 model with, during training only, *composed* tied embeddings: row(w) = free(w) + sum of the
    rows of w's parts (`word_parts`). `r7.y=q` is rare, but r7, the y field and q are seen all the time, so its
    embedding (and, tied, its output row) is learnt from every problem; without this, look-ups of late steps
    lagged (tracer/assets/micro/history.md, run 3). `bake()` writes the composed rows into the ordinary
    embedding matrix: the exported model is a plain `Qwen2ForCausalLM`."""

    def __init__(self, model: Qwen2ForCausalLM, vocab: dict[str, int], composed: bool = True) -> None:
        super().__init__()
        self.model = model
        part_names = sorted({part for word in vocab for part in word_parts(word)}) if composed else []
        part_index = {name: i for i, name in enumerate(part_names)}
        composition = torch.zeros(len(vocab), len(part_names))
        for word, row in vocab.items():
            for part in word_parts(word) if composed else []:
                composition[row, part_index[part]] = 1.0
        self.register_buffer("composition", composition, persistent=False)
        std = model.config.initializer_range
        self.parts = torch.nn.Parameter(torch.randn(len(part_names), model.config.hidden_size) * std)

    def embedding_matrix(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight + self.composition @ self.parts

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        weight = self.embedding_matrix()
        hidden = self.model.model(inputs_embeds=weight[input_ids], attention_mask=attention_mask).last_hidden_state
        return hidden @ weight.T  # tied output head (Qwen2's lm_head has no bias)

    @torch.no_grad()
    def bake(self) -> None:
        self.model.model.embed_tokens.weight.copy_(self.embedding_matrix())
        self.parts.zero_()


class Encoder:
    """Problem -> token ids with labels on the chain of thought (and <eos>) only."""

    def __init__(self, tokenizer) -> None:
        self.vocab = tokenizer.get_vocab()
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.pad_id = self.vocab[PAD]

    def encode(self, problem: Problem) -> tuple[list[int], list[int], list[str]]:
        prompt = [self.bos_id] + [self.vocab[w] for w in problem.prompt_words]
        answer = [self.vocab[w] for w in problem.answer_words] + [self.eos_id]
        roles = ["prompt"] * len(prompt) + list(problem.answer_roles) + ["copy"]
        labels = [IGNORE] * len(prompt) + answer
        return prompt + answer, labels, roles

    def batch(self, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[str]]]:
        encoded = [self.encode(p) for p in problems]
        width = max(len(ids) for ids, _, _ in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        roles = []
        for row, (ids, labs, rls) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(labs)] = torch.tensor(labs)
            mask[row, : len(ids)] = 1
            roles.append(rls)
        return input_ids, mask, labels, roles


def training_batch(step: int, stage: int, cfg: TrainConfig, heldout_prompts: set[str]) -> list[Problem]:
    """The batch of `step`: a pure function of (seed, step, stage)."""
    rng = random.Random(f"chains/train/{cfg.seed}/{step}")
    problems = []
    while len(problems) < cfg.batch_size:
        use_stage = stage
        if stage > 0 and rng.random() < cfg.earlier_stage_share:
            use_stage = rng.randrange(stage)
        if rng.random() < cfg.stages[use_stage].recall_share:
            if rng.random() < 0.5:
                problems.append(generate_recall(rng, result_share=RECALL_RESULT_SHARE))
            else:
                problems.append(generate_statement_recall(rng))
            continue
        problem = generate_problem(rng, cfg.stages[use_stage].chains)
        if problem.prompt not in heldout_prompts:
            problems.append(problem)
    return problems


@torch.no_grad()
def teacher_forced_metrics(model, encoder: Encoder, problems: list[Problem], batch_size: int = 64) -> dict:
    """Per-role next-token accuracy and whole-answer exactness, teacher-forced (`model` is a `MicroLM` or a
    plain causal LM)."""
    correct = {role: 0 for role in ROLES}
    total = {role: 0 for role in ROLES}
    exact = 0
    model.eval()
    for start in range(0, len(problems), batch_size):
        input_ids, mask, labels, roles = encoder.batch(problems[start : start + batch_size])
        if isinstance(model, MicroLM):
            logits = model(input_ids, mask)
        else:
            logits = model(input_ids=input_ids, attention_mask=mask).logits
        predicted = logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        hit = (predicted == target) | (target == IGNORE)
        exact += int(hit.all(dim=1).sum())
        for row, row_roles in enumerate(roles):
            for pos, role in enumerate(row_roles[1:]):
                if target[row, pos] != IGNORE:
                    total[role] += 1
                    correct[role] += int(predicted[row, pos] == target[row, pos])
    model.train()
    metrics = {f"acc_{r}": round(correct[r] / total[r], 4) for r in ROLES if total[r]}
    metrics["sequence_exact"] = round(exact / len(problems), 4)
    return metrics


def probe_set(stage: int, size: int, task: str = "chains") -> list[Problem]:
    recipe = RECIPES[task]
    config = recipe.eval_config if stage == len(recipe.stages) - 1 else recipe.stages[stage].chains
    prefix = "chains" if task == "chains" else task  # `chains` keeps its original probe seeds
    return [generate_problem(random.Random(f"{prefix}/probe/{stage}/{i}"), config) for i in range(size)]


def save_checkpoint(directory: Path, lm: MicroLM, optimizer, state: dict) -> None:
    """Weights and optimizer as safetensors plus a JSON state, written beside and then renamed into place."""
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    lm.model.save_pretrained(tmp)
    save_file({"parts": lm.parts.detach().clone()}, str(tmp / "embedding_parts.safetensors"))
    tensors, layout = {}, []
    for index, (param_id, param_state) in enumerate(optimizer.state_dict()["state"].items()):
        layout.append([param_id, sorted(param_state)])
        for key, value in param_state.items():
            tensors[f"{index}.{key}"] = torch.as_tensor(value).clone()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**state, "optimizer_layout": layout}, indent=1))
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        directory.rename(old)
        tmp.rename(directory)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(directory)


def load_checkpoint(directory: Path, lm: MicroLM, optimizer) -> dict:
    state = json.loads((directory / "state.json").read_text())
    lm.model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    lm.model.tie_weights()
    with torch.no_grad():
        lm.parts.copy_(load_file(str(directory / "embedding_parts.safetensors"))["parts"])
    tensors = load_file(str(directory / "optimizer.safetensors"))
    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = {
        param_id: {key: tensors[f"{index}.{key}"] for key in keys}
        for index, (param_id, keys) in enumerate(state["optimizer_layout"])
    }
    optimizer.load_state_dict(optimizer_state)
    return state


def _truncate_log(log_path: Path, step: int) -> None:
    """Drop log entries after the checkpoint being resumed: the log then reads like one uninterrupted run."""
    if log_path.is_file():
        entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        kept = [e for e in entries if e.get("step", 0) <= step]
        log_path.write_text("".join(json.dumps(e) + "\n" for e in kept))


def train(out: Path, cfg: TrainConfig, resume: bool = True, stop_at: int | None = None) -> None:
    """Train to `cfg.max_steps` (resuming from `out/checkpoint` if there is one); `stop_at` ends this invocation
    early at that step, with a checkpoint, as an interruption would."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    encoder = Encoder(tokenizer)
    config = model_config(len(tokenizer), encoder.pad_id, encoder.bos_id, encoder.eos_id, cfg.kv_heads)
    model = Qwen2ForCausalLM(config)
    lm = MicroLM(model, encoder.vocab, composed=cfg.composed_embeddings)
    lm.train()
    decay, no_decay = [], []
    for name, param in lm.named_parameters():
        (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98),
    )
    stages = cfg.stages
    heldout_prompts = {RECIPES[cfg.task].heldout(i).prompt for i in range(N_HELDOUT_GUARD)}
    log_path = out / "train_log.jsonl"
    checkpoint_dir = out / "checkpoint"
    step, stage, elapsed_before = 0, 0, 0.0
    if resume and (checkpoint_dir / "state.json").exists():
        state = load_checkpoint(checkpoint_dir, lm, optimizer)
        step, stage, elapsed_before = state["step"], state["stage"], state["elapsed_s"]
        print(f"resumed from {checkpoint_dir} at step {step}, stage {stage}", flush=True)
        _truncate_log(log_path, step)
        logged = json.loads(log_path.read_text().splitlines()[0]) if log_path.is_file() else {}
        changed = {k: v for k, v in asdict(cfg).items() if k in logged and logged[k] != v and k != "threads"}
        if changed:  # e.g. a shorter --max-steps decided before the decay phase: say so in the log
            with log_path.open("a") as f:
                f.write(json.dumps({"event": "resume", "step": step, "changed": changed}) + "\n")
    else:
        if cfg.init_from:  # fine-tune: the exported model is plain (baked), so parts start at zero = same function
            model.load_state_dict(load_file(str(Path(cfg.init_from) / "model.safetensors")), strict=False)
            model.tie_weights()
        log_path.write_text(json.dumps({"event": "config", **asdict(cfg), "n_params": model.num_parameters(),
                                        "stages": [asdict(s) for s in stages]}) + "\n")
    tokenizer.save_pretrained(out / TOKENIZER_SUBFOLDER)
    probes = {s: probe_set(s, cfg.probe_size, cfg.task) for s in range(len(stages))}
    log = log_path.open("a")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        print(json.dumps(entry), flush=True)

    started = time.perf_counter()
    tokens_since, loss_sum, loss_count = 0, 0.0, 0
    while step < cfg.max_steps:
        if stop_at is not None and step >= stop_at:
            elapsed = elapsed_before + time.perf_counter() - started
            save_checkpoint(checkpoint_dir, lm, optimizer, {"step": step, "stage": stage, "elapsed_s": elapsed})
            log.close()
            return
        if step >= decay_start_step(cfg) and stage < len(stages) - 1:
            stage = len(stages) - 1
            record({"event": "stage", "step": step, "stage": stage, "reason": "decay phase"})
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        input_ids, mask, labels, _ = encoder.batch(training_batch(step, stage, cfg, heldout_prompts))
        logits = lm(input_ids, mask)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), cfg.clip_norm)
        optimizer.step()
        step += 1
        tokens_since += int(mask.sum())
        loss_sum += loss.item()
        loss_count += 1
        elapsed = elapsed_before + time.perf_counter() - started
        if step % cfg.log_every == 0:
            record({"step": step, "stage": stage, "loss": round(loss_sum / loss_count, 4),
                    "lr": round(lr_at(step - 1, cfg), 6), "elapsed_s": round(elapsed, 1),
                    "tokens_per_s": round(tokens_since / max(1e-9, time.perf_counter() - started), 0)})
            loss_sum, loss_count = 0.0, 0
        if step % cfg.probe_every == 0 or step == cfg.max_steps:
            metrics = teacher_forced_metrics(lm, encoder, probes[stage])
            record({"event": "probe", "step": step, "stage": stage, "elapsed_s": round(elapsed, 1), **metrics})
            advance = (
                metrics.get(f"acc_{VAR_LOOKUP}", 0) >= cfg.advance_var_lookup
                and metrics["sequence_exact"] >= cfg.advance_sequence_exact
            )
            if advance and stage < len(stages) - 1:
                stage += 1
                record({"event": "stage", "step": step, "stage": stage, "reason": "probe thresholds met"})
        if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
            save_checkpoint(checkpoint_dir, lm, optimizer, {"step": step, "stage": stage, "elapsed_s": elapsed})
    lm.bake()  # the plain model now computes what the composed one did; the final probe below runs it as such
    model.save_pretrained(out)
    tokenizer.save_pretrained(out / TOKENIZER_SUBFOLDER)
    final = teacher_forced_metrics(model, encoder, probes[len(stages) - 1])
    record({"event": "done", "step": step, "elapsed_s": round(elapsed_before + time.perf_counter() - started, 1),
            **final})
    log.close()


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "train_log.jsonl")


def export_model(run_dir: Path, assets_dir: Path) -> None:
    """Copy a finished run's model, tokenizer and training log (not its checkpoint) into the package."""
    import shutil

    missing = [name for name in MODEL_FILES if not (run_dir / name).is_file()]
    if missing:
        from thoughtkv_base import UserError

        raise UserError(f"{run_dir} lacks {', '.join(missing)}: the training has not finished; rerun train to resume")
    assets_dir.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy2(run_dir / name, assets_dir / name)
    build_tokenizer().save_pretrained(assets_dir / TOKENIZER_SUBFOLDER)
