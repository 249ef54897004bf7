"""The quantized DDR tier: quantizer error bounds, stored bytes, and the store's put/get round trip."""

from __future__ import annotations

import pytest
import torch

from tracer.quant import (
    BadDdrDtype,
    QuantizedBlockStore,
    dequantize,
    make_block_store,
    quantize,
    relative_errors,
)
from tracer.scorers import H2OScorer

SHAPE = (5, 2, 16, 32)  # blocks, KV heads, block_size, head_dim



def _random_blocks(kind: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=generator)
    if kind == "outliers":  # a few large channels, as real keys have
        x[..., :2] *= 40.0
    elif kind == "shifted":
        x = x * 0.01 + 3.0
    elif kind == "constant_tile":
        x[1, 0] = 0.25
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["normal", "outliers", "shifted", "constant_tile"])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_error_is_within_half_a_step(bits, kind, seed):
    x = _random_blocks(kind, seed)
    tiles = quantize(x, bits)
    x_hat = dequantize(tiles, bits, torch.float32)
    # Independent bound from the definition: half a grid step of each (block, head) tile, plus float rounding.
    spread = x.amax(dim=(2, 3), keepdim=True) - x.amin(dim=(2, 3), keepdim=True)
    half_step = spread / (2**bits - 1) / 2
    assert ((x - x_hat).abs() <= half_step + 1e-6 * x.abs().amax()).all()
    # Relative to the block's max |x|, the error is at most 1/(2^bits - 1).
    assert relative_errors(x, x_hat).abs().max() <= 1 / (2**bits - 1) + 1e-6
    if kind == "constant_tile":
        assert torch.equal(x_hat[1, 0], x[1, 0])


def test_int4_is_tighter_than_nothing_and_int8_tighter_than_int4():
    x = _random_blocks("normal", 3)
    errors = {bits: relative_errors(x, dequantize(quantize(x, bits), bits, torch.float32)).abs().max() for bits in (8, 4)}
    assert 0 < errors[8] < errors[4] / 8  # a 17x finer grid (255 vs 15 steps)


def test_int4_packs_two_codes_per_byte():
    x = _random_blocks("normal", 4)
    tiles4, tiles8 = quantize(x, 4), quantize(x, 8)
    assert tiles4.codes.dtype == torch.uint8 and tiles4.codes.shape == (*SHAPE[:-1], SHAPE[-1] // 2)
    # Unpacking by hand: low nibble = even element, high nibble = odd element; same codes as the 8-bit path
    # would give on the 4-bit grid.
    low, high = tiles4.codes & 0x0F, tiles4.codes >> 4
    levels = 15
    expected = ((x - tiles4.zero) / tiles4.scale).round().clamp(0, levels)
    assert torch.equal(low.float(), expected[..., 0::2]) and torch.equal(high.float(), expected[..., 1::2])
    assert tiles8.codes.shape == SHAPE


@pytest.mark.parametrize("ddr_dtype, bits", [("int8", 8), ("int4", 4)])
def test_store_bytes_equal_the_stored_tensors(ddr_dtype, bits):
    n_heads, block_size, head_dim = SHAPE[1:]
    store = make_block_store(ddr_dtype, n_heads, block_size, head_dim, torch.bfloat16, torch.device("cpu"))
    assert isinstance(store, QuantizedBlockStore)
    keys = _random_blocks("outliers", 5).to(torch.bfloat16)
    values = _random_blocks("normal", 6).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 7, 1, 2])
    row = torch.zeros_like(ids)  # the store holds every row of a batch; these blocks are row 0's
    d2h = store.put(row, ids, keys, values)
    stored = sum(t[0, ids].numel() * t.element_size() for t in store.host.values())
    assert d2h == stored == len(ids) * store.block_bytes()
    # bf16 K+V of a block, and what the codes cost: half (int8) or a quarter (int4), plus 2 float32 per tile.
    plain_block_bytes = 2 * n_heads * block_size * head_dim * 2
    assert store.block_bytes() == plain_block_bytes // (16 // bits) + 2 * 2 * n_heads * 4
    back_ids = torch.tensor([7, 3])
    got_keys, got_values, h2d = store.get(torch.zeros_like(back_ids), back_ids)
    assert h2d == len(back_ids) * store.block_bytes()
    for got, original in ((got_keys, keys[[2, 0]]), (got_values, values[[2, 0]])):
        assert got.dtype == torch.bfloat16
        rel = relative_errors(original.float(), got.float()).abs().max()
        assert rel <= 1 / (2**bits - 1) + 2**-7  # the grid's bound plus bf16 rounding of the result
    # The key bounds recall reads are those of the keys it will bring back.
    assert torch.equal(store.key_min[0, 7], got_keys[0].amin(dim=1)) and torch.equal(store.key_max[0, 3], got_keys[1].amax(dim=1))
    errors = store.pop_quant_error()  # what recall returns (bf16), so bf16 rounding counts too
    assert 0 < errors["quant_rms_rel_err"] <= errors["quant_max_rel_err"] <= 1 / (2**bits - 1) + 2**-8
    assert store.pop_quant_error() == {"quant_max_rel_err": None, "quant_rms_rel_err": None}


def test_store_grows_and_keeps_what_it_held():
    store = QuantizedBlockStore(2, 16, 32, torch.float32, torch.device("cpu"), "int8")
    first = _random_blocks("normal", 7)
    store.put(torch.zeros(5, dtype=torch.long), torch.arange(5), first, first)
    store.reserve(3, 201)  # past the initial capacity (1 row, 64 blocks): the caller names the bounds
    store.put(torch.tensor([2]), torch.tensor([200]), first[:1], first[:1])
    keys, _, _ = store.get(torch.zeros(5, dtype=torch.long), torch.arange(5))
    assert torch.equal(store.get(torch.tensor([2]), torch.tensor([200]))[0], keys[:1])
    assert relative_errors(first, keys).abs().max() <= 1 / 255 + 1e-6


def test_same_is_the_pinned_pool_store_and_bad_names_are_refused():
    from tracer.transfer import PinnedBlockStore

    assert type(make_block_store("same", 2, 16, 32, torch.float32, torch.device("cpu"))) is PinnedBlockStore
    with pytest.raises(BadDdrDtype, match="int8, int4"):
        make_block_store("fp8", 2, 16, 32, torch.float32, torch.device("cpu"))
    with pytest.raises(BadDdrDtype, match="even head_dim"):
        QuantizedBlockStore(2, 16, 33, torch.float32, torch.device("cpu"), "int4")


# -- the quantized tier inside the tiered cache ----------------------------------------------------------------


def _tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _logit_gap_at_full_recall(ddr_dtype: str, steps: int = 48):
    """Max |logits - DynamicCache logits| over `steps` teacher-forced decode steps of hierarchy at a 25% HBM
    budget with every DDR block recalled each step (recall_k > blocks), and the cache afterwards."""
    from transformers import DynamicCache

    from tracer.cache import TieredCache, TierSettings
    from tracer.decode import use_tiered_attention
    from tracer.recorder import Recorder
    from traces.policy import PolicySpec

    model = _tiny_model()
    use_tiered_attention(model)
    tokens = torch.randint(0, 96, (40 + steps,), generator=torch.Generator().manual_seed(1))
    settings = TierSettings(
        spec=PolicySpec(policy="hierarchy", hbm_budget=0.25, block_size=4, sink_tokens=4, window_tokens=8,
                        recall_k=1000, promote=False, ddr_dtype=ddr_dtype), scorer=H2OScorer(),
    )
    recorder = Recorder()
    tiered, reference = TieredCache(2, settings, recorder), DynamicCache()
    gap, prompt = 0.0, 40
    with torch.no_grad():
        for start, end in [(0, prompt), *((p, p + 1) for p in range(prompt, prompt + steps))]:
            ids, positions = tokens[None, start:end], torch.arange(start, end)[None]
            got = model(input_ids=ids, position_ids=positions, cache=tiered).logits[0, -1]
            want = model(input_ids=ids, position_ids=positions, cache=reference).logits[0, -1]
            gap = max(gap, float((got - want).abs().max()))
            recorder.end_step(0.0)
    return gap, tiered, recorder, float(want.abs().max())


# Stated tolerance: int8 at full recall stays within 1% of the logits' magnitude of the full cache
# (measured here ~1e-3 of it); int4 is far coarser; same is exact (1e-5, the tracer's own guarantee).
INT8_LOGIT_TOLERANCE = 0.01


def test_int8_at_full_recall_stays_close_to_the_full_cache():
    gaps = {}
    for ddr_dtype in ("same", "int8", "int4"):
        gap, cache, recorder, scale = _logit_gap_at_full_recall(ddr_dtype)
        gaps[ddr_dtype] = gap / scale
        assert sum(layer.n_ddr_blocks for layer in cache.layers) > 10  # most of the cache does live in DDR
    assert gaps["same"] <= 1e-5
    assert 0 < gaps["int8"] <= INT8_LOGIT_TOLERANCE
    assert gaps["int4"] > 4 * gaps["int8"]


@pytest.mark.parametrize("ddr_dtype, bits", [("same", None), ("int8", 8), ("int4", 4)])
def test_recorded_bytes_are_the_stored_tensors(ddr_dtype, bits):
    _, cache, recorder, _ = _logit_gap_at_full_recall(ddr_dtype, steps=24)
    steps = recorder.steps_table()
    n_heads, block_size, head_dim = 2, 4, 16
    # Bytes of one block from the shapes alone: fp32 K+V, or codes (+ a float32 scale and zero per head).
    block_bytes = 2 * n_heads * block_size * head_dim * 4 if bits is None else (
        2 * (n_heads * block_size * head_dim * bits // 8 + 2 * n_heads * 4))
    for row in range(len(steps["step"])):
        assert steps["bytes_d2h"][row] == len(steps["offloaded_block_ids"][row]) * block_bytes
        assert steps["bytes_h2d"][row] == len(steps["recalled_block_ids"][row]) * block_bytes
        assert steps["ddr_kv_bytes"][row] == steps["ddr_blocks"][row] * block_bytes
        quantized_now = bits is not None and len(steps["offloaded_block_ids"][row]) > 0
        assert (steps["quant_max_rel_err"][row] is not None) == quantized_now
        if quantized_now:
            assert 0 < steps["quant_rms_rel_err"][row] <= steps["quant_max_rel_err"][row] <= 1 / (2**bits - 1) + 1e-6
    assert sum(steps["bytes_d2h"]) > 0 and sum(steps["bytes_h2d"]) > 0
    # ... and equal to what the stores really hold: every DDR block's tensors, numel * element_size.
    for layer in cache.layers:
        store = layer.ddr
        ddr_ids = (layer.block_tier == 1).nonzero().squeeze(1)
        tensors = list(store.host.values()) if bits is not None else [store.keys, store.values]
        held = sum(t[ddr_ids].numel() * t.element_size() for t in tensors)
        assert held == layer.n_ddr_blocks * block_bytes


def test_trace_run_records_quantized_bytes_and_errors(tmp_path):
    """Through `run_trace` to Parquet and back: the trace's bytes are those of the int4 blocks, and the
    quantization error columns are filled exactly on the rows that offloaded something."""
    from tracer.models import ByteTokenizer, LoadedModel, _manifest
    from tracer.run import TraceConfig, run_trace
    from traces import open_run

    model = _tiny_model()
    model.resize_token_embeddings(320, mean_resizing=False)  # ByteTokenizer's ids
    loaded = LoadedModel(model, ByteTokenizer(), "test:tiny", True, _manifest(model, "test:tiny", "float32", None, True))
    config = TraceConfig(
        model="test:tiny", task="chains", out=str(tmp_path / "run"), policy="hierarchy", hbm_budget=0.3,
        block_size=4, sink_tokens=4, window_tokens=8, recall_k=2, max_new_tokens=24, device="cpu", ddr_dtype="int4",
    )
    run = open_run(run_trace(config, progress=False, loaded=loaded))
    run.validate()
    assert run.manifest["policy"]["params"]["ddr_dtype"] == "int4"
    steps = run.steps()
    block_bytes = 2 * (2 * 4 * 16 // 2 + 2 * 2 * 4)  # K+V: 2 heads x 4 tokens x 16 dims at 4 bits, + scale/zero
    assert (steps["bytes_d2h"] == steps["offloaded_block_ids"].map(len) * block_bytes).all()
    assert (steps["bytes_h2d"] == steps["recalled_block_ids"].map(len) * block_bytes).all()
    assert (steps["ddr_kv_bytes"] == steps["ddr_blocks"] * block_bytes).all()
    offloaded = steps["offloaded_block_ids"].map(len) > 0
    assert offloaded.any() and steps["recalled_block_ids"].map(len).sum() > 0
    assert steps["quant_max_rel_err"].notna().eq(offloaded).all()
    assert steps.loc[offloaded, "quant_max_rel_err"].max() <= 1 / 15 + 1e-6
