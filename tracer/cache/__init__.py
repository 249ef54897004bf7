"""The tiered KV cache: per layer, blocks of `block_size` positions live in HBM (pages of a pool on the compute
device), in DDR (`tracer.transfer.PinnedBlockStore`, host memory) or are evicted (only their ids are kept).
The design, and why it is built this way: docs/design/tracer.md. The files, in the order a step uses them:

- `hf`: `TieredCache` (a transformers `Cache`), `TieredLayer` / `TieredRow` (one row as a batch-1 cache);
- `layer`: `PagedLayer`, one decoder layer's rows, and the order of a step's work on it;
- `rows`: `TierSettings`, `RowState` (a row's host-side counts);
- `pool`: the page pool and block tables (allocation, views, packing); `append`: new K/V into the pages;
- `recall` (staging the chosen DDR blocks) and `recall_rules` (which blocks: a registry);
- `scoring`: scores, importance and block masses after attention;
- `placement` (targets, offload, free, pack, promote) and `placements` (what each policy moves: a registry);
- `step`: what a step's layers share (host plans, score tables, masses, the deferred work of layers alike);
- `copies`: the step's one device->host copy of what it recorded; `indexing`: host-built device indices.
"""

from tracer.cache.copies import DeferredCopies
from tracer.cache.hf import RowStore, TieredCache, TieredLayer, TieredRow
from tracer.cache.layer import PagedLayer
from tracer.cache.placements import PLACEMENTS, Placement, counts_are_exact
from tracer.cache.recall_rules import RECALL_RULES, RecallRule
from tracer.cache.rows import RowState, TierSettings, UnsupportedBatch

__all__ = [
    "PLACEMENTS", "RECALL_RULES", "DeferredCopies", "PagedLayer", "Placement", "RecallRule", "RowState", "RowStore",
    "TierSettings", "TieredCache", "TieredLayer", "TieredRow", "UnsupportedBatch", "counts_are_exact",
]
