"""The one error type of the trace format: every reader, writer and validation failure raises it."""

from __future__ import annotations

from thoughtkv_base import UserError


class TraceFormatError(UserError):
    """A trace run is missing, corrupt, truncated, of another schema version, or does not match the
    manifest. The message is one line naming the file and the problem (the CLI prints it and exits 2)."""
