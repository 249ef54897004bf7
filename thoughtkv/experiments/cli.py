"""`thoughtkv experiment NAME`: the group; each experiment's module is in thoughtkv.experiments.EXPERIMENTS."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser):
    return parser.add_subparsers(dest="experiment", metavar="NAME")


def run(args: argparse.Namespace) -> int:  # reached only without NAME, which the CLI refuses first
    return 2
