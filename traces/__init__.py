"""Trace format v1: the run directory the tracer writes and the simulator and analysis read (no torch).

See traces/README.md for every field, the commit protocol and the access encoding.
"""

from traces.access_model import AccessModel, synth_block_masses
from traces.encoding import decode_block_mass, encode_block_mass, max_relative_error
from traces.errors import TraceFormatError
from traces.manifest import make_manifest, model_manifest
from traces.reader import TraceRun, open_run
from traces.schema import SCHEMA_VERSION
from traces.writer import TraceWriter, WriteBehind

__all__ = [
    "SCHEMA_VERSION",
    "AccessModel",
    "TraceFormatError",
    "TraceRun",
    "TraceWriter",
    "WriteBehind",
    "decode_block_mass",
    "encode_block_mass",
    "make_manifest",
    "max_relative_error",
    "model_manifest",
    "open_run",
    "synth_block_masses",
]
