"""The placement policy contract: every setting of a tiered-KV run, defaulted and validated once, and the
target arithmetic as plain functions of (spec, logical length). Torch-free.

One spec travels whole (nanoGPT's `GPTConfig`, kvpress's `ScorerPress.__post_init__`): the tracer builds its
tiered cache from it, `run.json["policy"]` is `spec.to_manifest()`, the simulator's placement, what-if and synth
replay it, analysis labels and joins on `spec.key()`. Nothing else re-checks a budget.

Policies:
- `full`: everything stays in HBM (the reference);
- `evict`: pure eviction to the HBM budget (StreamingLLM / H2O / TOVA by scorer);
- `hierarchy`: the lowest-`evict_ratio` share is evicted, what exceeds the HBM budget lives in DDR, and each
  decode step recalls the top `recall_blocks(L)` DDR blocks for the current query (by `recall_rule`).

Budgets (`hbm_budget`, `recall_budget`) are a fraction of the current logical length (0 < b <= 1) or an absolute
token count (a whole number > 1). Placement is at block granularity, after attention; the first
`ceil(sink_tokens / block_size)` blocks and the blocks overlapping the recent window (the last `window_tokens`
positions, incl. the partial block) are protected: always in HBM. When those protected tokens alone exceed the
budget, the run keeps more than asked — `protected_excess` says so and the tracer prints and records it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields, replace

from thoughtkv_base import UserError
from thoughtkv_base.options import SHARED, TEXT, Flag, add_flags, flag_name

POLICIES = ("full", "evict", "hierarchy")
DDR_DTYPES = ("same", "int8", "int4")
# How the recalled DDR blocks are chosen. The text is what run.json records (the v1 tracer wrote the quest
# text verbatim; `from_manifest` reads the name before the colon, and bare names as synth wrote them).
RECALL_RULES = {
    "quest": "quest: top-recall_k DDR blocks by max_heads sum_d max(q*kmin, q*kmax), current query",
    "quest-per-head": "quest-per-head: each KV head recalls its own top-recall_k DDR blocks by "
    "max_group sum_d max(q*kmin, q*kmax); a block is copied when any head picks it",
    # A ceiling, not a deployable rule: the DDR blocks with the largest true attention mass under the current
    # query (the tracer computes an exact softmax over every resident and DDR key: a full attention per layer).
    "oracle": "oracle: top-recall_k DDR blocks by true attention mass under the current query "
    "(exact softmax over resident and DDR keys; a ceiling, costs a full attention)",
    # The scorer's scores from earlier steps (the tracer: its token scores summed per block; the simulator: its
    # block scores from recorded masses): known before the layer runs, so its copy may be prefetched.
    "score": "score: top-recall_k DDR blocks by the scorer's scores from earlier steps (known before the layer runs)",
    # Speculative: the quest bound under a query made before the layer runs, so the copy may be prefetched.
    # prev-layer: layer i's query from the hidden state entering layer i-1 (InfiniGen's speculation; layer 0: its
    # previous step's query); prev-step: the layer's query of the previous decode step.
    "prev-layer": "prev-layer: top-recall_k DDR blocks by max_heads sum_d max(q*kmin, q*kmax), q = layer i's query "
    "from layer i-1's input (its norm, q_proj, RoPE at the current position; layer 0: the previous step's)",
    "prev-layer-per-head": "prev-layer-per-head: each KV head its own top-recall_k DDR blocks by the quest bound "
    "under prev-layer's query; a block is copied when any head picks it",
    "prev-step": "prev-step: top-recall_k DDR blocks by max_heads sum_d max(q*kmin, q*kmax), q = the layer's query "
    "of the previous decode step",
    "prev-step-per-head": "prev-step-per-head: each KV head its own top-recall_k DDR blocks by the quest bound "
    "under prev-step's query; a block is copied when any head picks it",
    # Simulator-only (computed from recorded masses): the current query's attention mass over the blocks, as the
    # trace recorded it (the oracle, approximated from what the traced run attended).
    "query": "query",
}
TRACER_RECALL_RULES = ("quest", "quest-per-head", "oracle", "score", "prev-layer", "prev-layer-per-head",
                       "prev-step", "prev-step-per-head")
# Rules whose choice is known before the layer runs (it reads nothing of the layer's current query), so the copy
# can overlap earlier compute (the simulator's `--overlap layer-prefetch`). The tracer's rules declare the same
# (`RecallRule.uses_query`; tests/test_recall_design.py holds the two together).
PREFETCHABLE_RECALL_RULES = ("score", "prev-layer", "prev-layer-per-head", "prev-step", "prev-step-per-head")
# Rules where each KV head picks its own blocks and the union is copied (up to n_kv_heads times one rule's).
PER_HEAD_RECALL_RULES = ("quest-per-head", "prev-layer-per-head", "prev-step-per-head")


def recall_is_prefetchable(rule: str) -> bool:
    """Whether a recall rule's choice is known before the layer's query exists (layer prefetch is valid)."""
    return rule in PREFETCHABLE_RECALL_RULES


class PolicyError(UserError):
    """An impossible or malformed placement setting (one line, exit 2)."""


def parse_budget(value, what: str = "--hbm-budget") -> float:
    """A fraction in (0, 1] or a whole token count > 1, from a number or its text; PolicyError otherwise."""
    if isinstance(value, bool):
        raise PolicyError(f"{what} {value!r} is not a number; give a fraction in (0, 1] or a token count")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"{what} {value!r} is not a number; give a fraction in (0, 1] or a token count") from None
    if not number > 0 or math.isinf(number) or (number > 1 and number != int(number)):
        raise PolicyError(f"{what} {value!r} must be a fraction in (0, 1] or a whole token count > 1")
    return number


def budget_tokens(budget: float, logical_len: int) -> int:
    """A budget in tokens at this logical length: ceil(fraction * L), or the token count itself."""
    if budget <= 1:
        return math.ceil(budget * logical_len - 1e-9)
    return int(budget)


def _is_fraction(budget: float) -> bool:
    return budget <= 1


# The cache geometry: the fields that shape blocks and what never leaves HBM. A tiered layer-step's cost
# depends on them, so calibration times its decoders with a run's geometry (tracer.calibrate.cache_geometry)
# and the simulator warns when a profile was timed with another (simulator.costs.geometry_warning).
CACHE_GEOMETRY_KEYS = ("block_size", "window_tokens", "sink_tokens")


@dataclass(frozen=True)
class PolicySpec:
    policy: str = "full"
    hbm_budget: float = 1.0  # fraction of the logical length (<= 1) or tokens (whole number > 1)
    evict_ratio: float = 0.0  # hierarchy: share of the logical length evicted (lowest scores first)
    block_size: int = 16  # tokens per KV block: the unit of placement and of every copy
    sink_tokens: int = 4  # attention sinks: the first positions never leave HBM
    window_tokens: int = 32  # the recent window never leaves HBM
    recall_k: int = 4  # hierarchy: DDR blocks recalled per layer and decode step
    recall_budget: float | None = None  # hierarchy: instead of recall_k, a fraction of L or tokens per step
    recall_rule: str = "quest"
    scorer: str = "h2o"
    promote: bool = False  # a recalled block may take a weaker resident block's place in HBM
    ddr_dtype: str = "same"  # how DDR stores offloaded blocks: same | int8 | int4
    # hierarchy: a per-(sequence, layer) LRU of recalled blocks kept in HBM (blocks; 0: none): a recalled block
    # still in it costs no copy (bytes_h2d counts misses only); its capacity counts in the HBM bytes
    recall_buffer_blocks: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the parsed values once, here
        if self.policy not in POLICIES:
            raise PolicyError(f"unknown policy {self.policy!r}; use one of {', '.join(POLICIES)}")
        set_(self, "hbm_budget", parse_budget(self.hbm_budget, "--hbm-budget"))
        evict = _number(self.evict_ratio, "--evict-ratio")
        if not 0.0 <= evict < 1.0:
            raise PolicyError(f"--evict-ratio {self.evict_ratio!r} must be in [0, 1)")
        set_(self, "evict_ratio", evict)
        for name, low in (("block_size", 1), ("sink_tokens", 0), ("window_tokens", 0), ("recall_k", 0),
                          ("recall_buffer_blocks", 0)):
            set_(self, name, _whole(getattr(self, name), "--" + name.replace("_", "-"), low))
        if self.recall_budget is not None:
            set_(self, "recall_budget", parse_budget(self.recall_budget, "--recall-budget"))
        rule = str(self.recall_rule).split(":")[0].strip()
        if rule not in RECALL_RULES:
            raise PolicyError(f"unknown --recall-rule {self.recall_rule!r}; use one of {', '.join(RECALL_RULES)}")
        set_(self, "recall_rule", rule)
        if not isinstance(self.promote, bool):
            raise PolicyError(f"promote {self.promote!r} must be true or false")
        if self.ddr_dtype not in DDR_DTYPES:
            raise PolicyError(f"--ddr-dtype {self.ddr_dtype!r}: use one of {', '.join(DDR_DTYPES)}")
        if self.ddr_dtype != "same" and self.policy != "hierarchy":
            raise PolicyError(
                f"--ddr-dtype {self.ddr_dtype} applies to the hierarchy policy only (got --policy {self.policy})"
            )

    # -- derived facts -----------------------------------------------------------------------------------
    @property
    def uses_ddr(self) -> bool:
        return self.policy == "hierarchy"

    @property
    def budget_is_fraction(self) -> bool:
        return _is_fraction(self.hbm_budget)

    def effective(self) -> PolicySpec:
        """The settings that act under this policy (the rest reset to their defaults): what run.json records
        and what two runs are compared on. Evict ignores eviction ratio, recall and DDR settings; full also the
        budget."""
        if self.policy == "hierarchy":
            return self
        base = dict(recall_k=0, recall_budget=None, evict_ratio=0.0, promote=False, ddr_dtype="same",
                    recall_buffer_blocks=0)
        if self.policy == "full":
            base["hbm_budget"] = 1.0
        return replace(self, **base)

    def key(self) -> tuple:
        """A hashable identity of the effective settings (analysis joins on it; floats exact, never rounded)."""
        return tuple(getattr(self.effective(), f.name) for f in fields(self))

    def identity(self) -> str:
        """`key()` as one canonical string: a column analysis joins traced runs and projections on (exact
        values from the one spec, so no rounding is needed for two copies of a setting to meet)."""
        spec = self.effective()
        return "|".join(f"{f.name}={getattr(spec, f.name)!r}" for f in fields(self))

    def label(self) -> str:
        """A short human label, e.g. `hierarchy b=0.3 e=0 k=4` or `evict b=512t h2o`."""
        spec = self.effective()
        if spec.policy == "full":
            return "full"
        budget = f"{spec.hbm_budget:g}" if spec.budget_is_fraction else f"{int(spec.hbm_budget)}t"
        text = f"{spec.policy} b={budget} {spec.scorer}"
        if spec.policy == "hierarchy":
            recall = f"k={spec.recall_k}" if spec.recall_budget is None else f"r={spec.recall_budget:g}"
            text += f" e={spec.evict_ratio:g} {recall}"
        return text

    # -- run.json --------------------------------------------------------------------------------------------
    def to_manifest(self) -> dict:
        """run.json `policy`: the v1 keys (unchanged for v1 settings), new settings in `params` when set."""
        spec = self.effective()
        params = {"promote": spec.promote, "budget_is_fraction": spec.budget_is_fraction, "ddr_dtype": spec.ddr_dtype}
        if spec.recall_budget is not None:
            params["recall_budget"] = spec.recall_budget
        if spec.recall_buffer_blocks:
            params["recall_buffer_blocks"] = spec.recall_buffer_blocks
        return {
            "name": spec.policy,
            "hbm_budget": spec.hbm_budget if spec.budget_is_fraction else int(spec.hbm_budget),
            "evict_ratio": spec.evict_ratio,
            "block_size": spec.block_size,
            "scorer": spec.scorer,
            "recall_k": spec.recall_k,
            "recall_rule": RECALL_RULES[spec.recall_rule] if spec.uses_ddr else None,
            "sink_tokens": spec.sink_tokens,
            "window_tokens": spec.window_tokens,
            "params": params,
        }

    @classmethod
    def from_manifest(cls, policy: dict) -> PolicySpec:
        """Read run.json `policy` (v1 as the tracer and synth wrote it): the inverse of `to_manifest`."""
        params = policy.get("params") or {}
        name = policy.get("name", "full")
        if name not in POLICIES:
            raise PolicyError(f"run.json policy {name!r} is not one of {', '.join(POLICIES)}; re-collect the trace")
        rule = str(policy.get("recall_rule") or "quest")
        if name != "hierarchy" or rule.split(":")[0].strip().lower() in ("none", "null", ""):
            rule = "quest"  # nothing is recalled outside the hierarchy: v1 writers put none/null/their own text here
        elif rule.split(":")[0].strip() not in RECALL_RULES:
            rule = "query"  # a v1 text naming no known rule: a recall by the current query, as v1's simulator read it
        try:
            return cls._from_manifest_values(policy, params, name, rule)
        except PolicyError as exc:  # name the run.json key the value came from, not the flag that sets it
            text = str(exc)
            for f in fields(cls):
                key = f"policy.params.{f.name}" if f.name in MANIFEST_PARAMS else f"policy.{f.name}"
                text = text.replace(f"--{f.name.replace('_', '-')} ", f"{key} ").replace(
                    f"--{f.name.replace('_', '-')}", key)
            raise PolicyError(f"run.json {text}") from None

    @classmethod
    def _from_manifest_values(cls, policy: dict, params: dict, name: str, rule: str) -> PolicySpec:
        return cls(
            policy=name,
            hbm_budget=policy.get("hbm_budget") or 1.0,
            evict_ratio=policy.get("evict_ratio") or 0.0,
            block_size=policy["block_size"],
            sink_tokens=policy.get("sink_tokens") or 0,
            window_tokens=policy.get("window_tokens") or 0,
            recall_k=policy.get("recall_k") or 0,
            recall_budget=params.get("recall_budget"),
            recall_rule=rule,
            scorer=policy.get("scorer") or "h2o",
            promote=bool(params.get("promote", False)),
            ddr_dtype=params.get("ddr_dtype") or "same",
            recall_buffer_blocks=params.get("recall_buffer_blocks") or 0,
        )

    def as_dict(self) -> dict:
        return asdict(self)


# The PolicySpec fields run.json keeps under policy.params (to_manifest), the others directly under policy.
MANIFEST_PARAMS = ("recall_budget", "promote", "ddr_dtype", "recall_buffer_blocks")


def _number(value, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"{what} {value!r} is not a number") from None
    if math.isnan(number):
        raise PolicyError(f"{what} {value!r} is not a number")
    return number


def _whole(value, what: str, low: int) -> int:
    number = _number(value, what)
    # isfinite first: int(inf) raises OverflowError; 2**31 tokens is beyond any context (and any int32 column)
    if not math.isfinite(number) or number != int(number) or number < low or number >= 2**31:
        raise PolicyError(f"{what} {value!r} must be a whole number >= {low} (and below 2**31)")
    return int(number)


# ---------------------------------------------------------------- target arithmetic -------------------------
# Plain functions of (spec, logical length): the tracer (torch) and the simulator (numpy) both call these, so
# the rule exists once. Block ids are logical: block i holds positions [i * block_size, (i + 1) * block_size).


def n_blocks(spec: PolicySpec, logical_len: int) -> int:
    return -(-logical_len // spec.block_size)


def hbm_target_tokens(spec: PolicySpec, logical_len: int) -> int | None:
    """Tokens the budget allows in HBM at this length; None when there is no limit (full)."""
    if spec.policy == "full":
        return None
    return budget_tokens(spec.hbm_budget, logical_len)


def evict_target_blocks(spec: PolicySpec, logical_len: int) -> int:
    """Blocks that must be evicted by now: floor(evict_ratio * L) tokens, rounded down to whole blocks."""
    if spec.policy != "hierarchy":
        return 0
    return math.floor(spec.evict_ratio * logical_len) // spec.block_size


def movable_range(spec: PolicySpec, logical_len: int) -> tuple[int, int]:
    """Blocks [first, end) that may leave HBM: complete, not a sink block, not overlapping the recent window."""
    bs = spec.block_size
    first = -(-spec.sink_tokens // bs)
    end = min(logical_len // bs, max(0, logical_len - spec.window_tokens) // bs)
    return first, max(first, end)


def protected_tokens(spec: PolicySpec, logical_len: int) -> int:
    """Tokens that stay in HBM whatever the budget (sink blocks, recent window, the partial block)."""
    first, end = movable_range(spec, logical_len)
    return logical_len - (end - first) * spec.block_size


def room_blocks(spec: PolicySpec, logical_len: int) -> int | None:
    """Movable blocks the budget leaves room for in HBM; None when unlimited."""
    target = hbm_target_tokens(spec, logical_len)
    if target is None:
        return None
    return max(0, target - protected_tokens(spec, logical_len)) // spec.block_size


def recall_blocks(spec: PolicySpec, logical_len: int) -> int:
    """DDR blocks to recall per layer at a decode step of this length: `recall_k`, or the recall budget in
    tokens (a fraction of L or a count) rounded down to whole blocks, so the recalled tokens never exceed it."""
    if spec.policy != "hierarchy":
        return 0
    if spec.recall_budget is None:
        return spec.recall_k
    return budget_tokens(spec.recall_budget, logical_len) // spec.block_size


@functools.lru_cache(maxsize=256)
def peak_hbm_tokens(spec: PolicySpec, max_prompt: int, max_len: int) -> int:
    """The most tokens one sequence holds in HBM, for prompts of up to `max_prompt` tokens decoded up to
    `max_len`: the whole prompt before its placement (prefill), then at each length the blocks placement keeps
    (sink, window, partial block and the movable blocks the room allows) plus the block the next token opens
    before placement (every token under the full policy). Recall's staging comes on top (`max_recall_blocks`).
    The tracer sizes its page pools with it once (tracer/cache/pool.py) and the preflight their bytes
    (tracer/run.py `kv_buffer_bytes`)."""
    bs, resident = spec.block_size, max_prompt
    for length in range(max_prompt, max_len + 1):
        if hbm_target_tokens(spec, length) is None:
            resident = max(resident, length)
            continue
        first, end = movable_range(spec, length)
        movable = end - first
        kept = n_blocks(spec, length) - movable + min(room_blocks(spec, length), movable)
        resident = max(resident, (kept + 1) * bs)
    return resident


def max_recall_blocks(spec: PolicySpec, max_logical_len: int, n_kv_heads: int = 1) -> int:
    """The most blocks one decode step can recall up to this length (sizes staging slots): under quest-per-head
    the union of every KV head's picks (a per-head rule), up to `n_kv_heads` times one rule's."""
    most = max(recall_blocks(spec, max_logical_len), recall_blocks(spec, 1))
    return most * n_kv_heads if spec.recall_rule in PER_HEAD_RECALL_RULES else most


def protected_excess(spec: PolicySpec, logical_len: int) -> str | None:
    """One line when the protected tokens alone exceed the HBM budget at this length (the run then keeps more
    than asked), else None."""
    target = hbm_target_tokens(spec, logical_len)
    if target is None:
        return None
    protected = protected_tokens(spec, logical_len)
    if protected <= target:
        return None
    return (
        f"--hbm-budget {spec.hbm_budget:g} allows {target} tokens at length {logical_len}, but the sink "
        f"({spec.sink_tokens}) and recent window ({spec.window_tokens}) keep {protected} in HBM: the effective "
        f"budget is {protected / max(logical_len, 1):.1%}; lower --sink-tokens/--window-tokens or raise the budget"
    )


def recall_warning(spec: PolicySpec) -> str | None:
    """One line when a hierarchy recalls nothing: attention to its DDR blocks is then silently dropped, as if
    they were evicted (what the v1 `traces synth` default did)."""
    if spec.uses_ddr and spec.recall_k == 0 and spec.recall_budget is None:
        return ("warning: hierarchy with --recall-k 0 recalls nothing: the attention its DDR blocks would get is "
                "dropped, as with eviction; set --recall-k or --recall-budget")
    return None


# ---------------------------------------------------------------- command-line flags -------------------------
# Generated from the fields, so every command spells a setting the same way and keeps the one default above.
FLAG_HELP = {
    "policy": "full | evict | hierarchy",
    "hbm_budget": "HBM budget: a fraction of the logical length in (0, 1] or a whole token count > 1",
    "evict_ratio": "hierarchy: share of the logical length evicted, lowest scores first, in [0, 1)",
    "block_size": "tokens per KV block, the unit of placement and of every copy (1 = per token)",
    "sink_tokens": "first positions that never leave HBM (attention sinks)",
    "window_tokens": "most recent positions that never leave HBM",
    "recall_k": "hierarchy: DDR blocks recalled per layer and decode step",
    "recall_budget": "hierarchy: recall per step a fraction of the context (<= 1) or a token count (> 1), in "
    "whole blocks, instead of --recall-k",
    "recall_rule": "hierarchy: how recalled blocks are chosen: " + ", ".join(RECALL_RULES)
    + " (quest*: key bounds; oracle: true attention, a ceiling; score: earlier steps' scores, prefetchable; "
    "prev-layer*, prev-step*: key bounds under a query speculated from the previous layer's input or the previous "
    "step, prefetchable; query: the simulator's oracle from recorded masses)",
    "scorer": "block importance: h2o | tova | snapkv | keynorm | rkv | recency | random | oracle | vatp | gradient "
    "(the simulator computes h2o, tova, recency, random, oracle from masses)",
    "promote": "hierarchy: a recalled block that outscores a resident one takes its HBM place",
    "ddr_dtype": "hierarchy: how DDR stores offloaded blocks: same | int8 | int4",
    "recall_buffer_blocks": "hierarchy: a per-layer LRU of this many recalled blocks per sequence kept in HBM; a "
    "recalled block still in it is not copied again (its HBM counts in the resident bytes)",
}


@functools.cache
def policy_flag(name: str) -> Flag:
    """The flag of one PolicySpec field, made once: `--policy`, `--hbm-budget`, ... take text, which the spec
    parses and checks (its messages name the flag); the help shows the spec's default."""
    default = getattr(PolicySpec(), name)
    if name in SHARED:  # also a simulator option (--recall-buffer-blocks): one definition
        return SHARED[name].use(help=FLAG_HELP[name], default_text=str(default))
    if name == "promote":
        return Flag("--promote", FLAG_HELP[name], None, action="store_true", default=None, group="policy")
    return Flag(flag_name(name), FLAG_HELP[name], TEXT, metavar=name.upper(), default_text=str(default),
                group="policy")


def add_policy_arguments(parser, skip: tuple[str, ...] = (), default_text: dict[str, str] | None = None) -> None:
    """Add `--policy`, `--hbm-budget`, ... (one per PolicySpec field; `default_text[name]` where the caller
    decides a default, e.g. a model's trace_defaults.json)."""
    notes = default_text or {}
    add_flags(parser, *(policy_flag(f.name).use(default_text=notes[f.name]) if f.name in notes
                        else policy_flag(f.name) for f in fields(PolicySpec) if f.name not in skip))


# Flags that only act under the hierarchy: given with another policy they would be silently dropped
# (`PolicySpec.effective`), so a command line that names them there is refused instead.
HIERARCHY_ONLY_FLAGS = ("recall_k", "recall_budget", "evict_ratio", "promote", "recall_buffer_blocks")


def given_flags(args) -> dict:
    """The policy flags given on the command line (argparse leaves the others None)."""
    return {f.name: getattr(args, f.name) for f in fields(PolicySpec) if getattr(args, f.name, None) is not None}


def check_given(given: dict) -> None:
    """Refuse flags that cannot all act: --recall-k with --recall-budget (the budget would silently win), and a
    hierarchy-only flag with another policy (it would silently do nothing)."""
    if given.get("recall_k") is not None and given.get("recall_budget") is not None:
        raise PolicyError("--recall-k and --recall-budget both set how much to recall; give one of them")
    policy = given.get("policy", PolicySpec.policy)
    named = [f"--{name.replace('_', '-')}" for name in HIERARCHY_ONLY_FLAGS if given.get(name) not in (None, False)]
    if policy != "hierarchy" and named:
        raise PolicyError(f"{', '.join(named)} appl{'ies' if len(named) == 1 else 'y'} to the hierarchy policy only "
                          f"(got --policy {policy}); drop {'it' if len(named) == 1 else 'them'} or use --policy hierarchy")


def spec_from_args(args, **overrides) -> PolicySpec:
    """The PolicySpec the flags of `add_policy_arguments` describe (unset flags keep the spec's defaults)."""
    given = given_flags(args)
    spec = PolicySpec(**{**given, **overrides})  # each value checked first (an unknown policy says so)
    check_given(given)
    return spec
