"""Accuracy with its 95% interval: every accuracy figure the project prints carries n and a Wilson CI."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927; Newcombe 1998, method 3).

    Unlike the normal approximation it stays inside [0, 1] and is usable at 0/n and n/n, which matters for
    the small per-policy sample counts we have. Returns (nan, nan) when n == 0.
    """
    if n < 0 or correct < 0 or correct > n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    if n == 0:
        return math.nan, math.nan
    p_hat = correct / n
    z2 = z * z
    denominator = 1 + z2 / n
    center = (p_hat + z2 / (2 * n)) / denominator
    half_width = z / denominator * math.sqrt(p_hat * (1 - p_hat) / n + z2 / (4 * n * n))
    # At 0/n and n/n the bound is exactly 0 (1); the formula gets there only up to rounding.
    low = 0.0 if correct == 0 else max(0.0, center - half_width)
    high = 1.0 if correct == n else min(1.0, center + half_width)
    return low, high


def accuracy_line(correct: int, n: int) -> str:
    """'12/20 = 60.0% [38.7%, 78.1%] (95% Wilson CI, n=20)'."""
    if n == 0:
        return "no scored samples (random weights or no gold answers)"
    return share_line(correct, n)


# -- long generations: samples the token limit stopped ---------------------------------------------

TOKEN_LIMIT_STOP, FINISHED_STOP = "max_new_tokens", "eos"  # samples.stop_reason values


def completion_summary(samples) -> dict[str, int]:
    """Counts behind the long-generation accounting of a samples table (columns stop_reason, correct):
    samples stopped by the token limit (`--max-new-tokens`), and correct / scored over all samples and over
    the finished ones (stopped by EOS; a NaN-stopped sample is neither finished nor cut by the limit)."""
    scored = samples[samples["correct"].notna()]
    finished = scored[scored["stop_reason"] == FINISHED_STOP]
    return {
        "n_samples": len(samples),
        "n_token_limit": int((samples["stop_reason"] == TOKEN_LIMIT_STOP).sum()),
        "n_scored": len(scored),
        "n_correct": int(scored["correct"].astype(bool).sum()),
        "n_finished_scored": len(finished),
        "n_finished_correct": int(finished["correct"].astype(bool).sum()),
    }


def completion_lines(samples) -> list[tuple[str, str]]:
    """(label, text) lines for a run summary: the token-limit share, then accuracy over all samples and over
    the finished ones, each with n and a 95% Wilson CI. Accuracy lines only when something is scored."""
    c = completion_summary(samples)
    if c["n_samples"] == 0:
        return []
    lines = [("token limit", f"{share_line(c['n_token_limit'], c['n_samples'])} stopped by --max-new-tokens")]
    if c["n_scored"]:
        lines += [("accuracy", f"{accuracy_line(c['n_correct'], c['n_scored'])} over all samples"),
                  ("finished", f"{accuracy_line(c['n_finished_correct'], c['n_finished_scored'])} over samples "
                               "that ended (EOS)" if c["n_finished_scored"] else "no scored sample ended (EOS)")]
    return lines


def share_line(k: int, n: int) -> str:
    """'3/20 = 15.0% [5.2%, 36.0%] (95% Wilson CI, n=20)' for any share, n > 0."""
    low, high = wilson_interval(k, n)
    return f"{k}/{n} = {k / n:.1%} [{low:.1%}, {high:.1%}] (95% Wilson CI, n={n})"


# -- traffic: what a policy moved over the link to reach its accuracy -----------------------------

REFERENCE_ARCHITECTURE = "qwen2-7b"  # every run's traffic is also priced at this model's KV bytes per token (bf16)
TRAFFIC_COLUMNS = ["sample_id", "step", "logical_len", "hbm_tokens", "recalled_tokens", "bytes_h2d", "bytes_d2h"]
TRAFFIC_KEYS = (
    "decode_steps", "decode_layer_steps", "hbm_frac", "attended_frac", "recalled_tokens_per_layer_step",
    "recalled_frac", "h2d_bytes_per_token", "d2h_bytes_per_token", "h2d_bytes_per_token_ref",
    "d2h_bytes_per_token_ref",
)


def reference_kv_bytes_per_token() -> int:
    from traces.architectures import get_architecture

    return get_architecture(REFERENCE_ARCHITECTURE).kv_bytes_per_token("bfloat16")


def traffic_summary(steps, kv_bytes_per_token: int, reference_kv_bytes: int | None = None) -> dict[str, float]:
    """Traffic of a run from its steps table (`TRAFFIC_COLUMNS`), decode steps only (step >= 1; the prefill's
    one-time offload of the prompt is left out):

    - `hbm_frac`, `attended_frac`: mean over decode layer-steps of hbm_tokens / logical_len and of
      (hbm_tokens + recalled_tokens) / logical_len — the share of the context attention actually saw;
    - `recalled_tokens_per_layer_step` (mean recalled_tokens) and `recalled_frac` (mean recalled / logical_len);
    - `h2d_bytes_per_token`, `d2h_bytes_per_token`: bytes copied over all layers and decode steps, divided by
      the number of decode steps (each decode step generates one token);
    - `*_ref`: the same access pattern priced at `REFERENCE_ARCHITECTURE`'s bf16 KV bytes per token, i.e. the
      bytes scaled by reference_kv_bytes / kv_bytes_per_token (the run's own KV bytes per token, all layers; a
      quantised DDR tier keeps its compression ratio).

    The fractions are means of per-row ratios, so every layer-step weighs the same whatever its length.
    An empty table (no decode step) gives NaN fractions and zero bytes.
    """
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be positive, got {kv_bytes_per_token}")
    reference_kv_bytes = reference_kv_bytes or reference_kv_bytes_per_token()
    decode = steps[steps["step"] >= 1]
    n_rows = len(decode)
    n_steps = len(decode[["sample_id", "step"]].drop_duplicates()) if n_rows else 0
    if n_rows == 0:
        nan = float("nan")
        return dict(zip(TRAFFIC_KEYS, (0, 0, nan, nan, nan, nan, 0.0, 0.0, 0.0, 0.0)))
    logical = decode["logical_len"].astype("float64")
    hbm = decode["hbm_tokens"].astype("float64")
    recalled = decode["recalled_tokens"].astype("float64")
    h2d = float(decode["bytes_h2d"].sum()) / n_steps
    d2h = float(decode["bytes_d2h"].sum()) / n_steps
    scale = reference_kv_bytes / kv_bytes_per_token
    return {
        "decode_steps": n_steps,
        "decode_layer_steps": n_rows,
        "hbm_frac": float((hbm / logical).mean()),
        "attended_frac": float(((hbm + recalled) / logical).mean()),
        "recalled_tokens_per_layer_step": float(recalled.mean()),
        "recalled_frac": float((recalled / logical).mean()),
        "h2d_bytes_per_token": h2d,
        "d2h_bytes_per_token": d2h,
        "h2d_bytes_per_token_ref": h2d * scale,
        "d2h_bytes_per_token_ref": d2h * scale,
    }


def run_traffic(trace) -> dict[str, float]:
    """`traffic_summary` of a `traces.reader.TraceRun` (committed samples only), priced with its manifest."""
    return traffic_summary(trace.steps(columns=TRAFFIC_COLUMNS), int(trace.manifest["model"]["kv_bytes_per_token"]))


def bytes_text(value: float) -> str:
    """Bytes with an SI prefix, 3 significant digits: '57.3 kB'."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} B"


def traffic_line(traffic: dict[str, float]) -> str:
    """'attended 93.5% of the context (HBM 28.5% + recalled 65.0% = 76.2 tokens/layer-step); H2D 1.2 MB/token,
    D2H 3.1 kB/token; at qwen2-7b bf16: H2D 22 MB/token, D2H ... (decode steps only, n=4,210 steps)'."""
    if traffic["decode_layer_steps"] == 0:
        return "no decode steps"
    return (
        f"attended {traffic['attended_frac']:.1%} of the context (HBM {traffic['hbm_frac']:.1%} + recalled "
        f"{traffic['recalled_frac']:.1%} = {traffic['recalled_tokens_per_layer_step']:.1f} tokens/layer-step); "
        f"H2D {bytes_text(traffic['h2d_bytes_per_token'])}/token, D2H {bytes_text(traffic['d2h_bytes_per_token'])}"
        f"/token; priced at {REFERENCE_ARCHITECTURE} bf16: H2D {bytes_text(traffic['h2d_bytes_per_token_ref'])}"
        f"/token, D2H {bytes_text(traffic['d2h_bytes_per_token_ref'])}/token "
        f"(decode steps only, n={traffic['decode_steps']:,})"
    )
