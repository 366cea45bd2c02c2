"""argparse helpers shared by the examples and benchmarks (repository tooling, not installed).

Bad command-line values stop with argparse's usage error (exit status 2, a message naming the
option) before any model or tensor is built, instead of a traceback from torch or transformers.
"""
from __future__ import annotations

import argparse
import os

import torch


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def check_device(parser: argparse.ArgumentParser, option: str, text: str) -> torch.device:
    """``torch.device(text)``, or ``parser.error`` naming ``option`` if torch cannot parse it or
    it names CUDA on a machine without a CUDA GPU."""
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"{option} {text}: not a torch device (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"{option} {text}: no CUDA GPU is available here (use {option} cpu)")
    return device


def check_model_dir(parser: argparse.ArgumentParser, option: str, path) -> None:
    """``parser.error`` naming ``option`` unless ``path`` (a local checkpoint) is None or a
    directory."""
    if path and not os.path.isdir(path):
        parser.error(f"{option} {path}: no such directory (a local checkpoint directory is "
                     "expected; use --config NAME for random weights)")
