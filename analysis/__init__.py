"""Figures, tables and the report from trace runs and simulator results (pandas + matplotlib; never torch).

`thoughtkv plot` (analysis.cli) -> analysis.report.build_report; the numbers live in analysis.stats and
analysis.frames, the drawing in analysis.figures. See analysis/README.md.
"""
