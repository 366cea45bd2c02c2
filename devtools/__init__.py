"""Helpers for the repository's own tests, examples and benchmarks; not part of the installed
package (setup.py packages only ``flash_attention_sm75``).

* :mod:`devtools.cli` -- argparse checks (positive integers, torch devices, checkpoint
  directories) shared by ``examples/`` and ``benchmarks/``.
* :mod:`devtools.host_reads` -- a ``TorchFunctionMode`` counting host reads of tensor values
  (the synchronisations a code path would make on a GPU), for CPU tests and benchmarks.
* :mod:`devtools.model_configs` -- real architecture configurations (Qwen2-0.5B, Llama-3.2-1B,
  Llama-2-7B shapes) and tiny ones, and random-weight models built from them, for the
  transformers tests, the examples and the end-to-end benchmark.

Importable from the repository root: pytest adds it (``pythonpath`` in pyproject.toml), the
scripts in ``examples/`` and ``benchmarks/`` put the root on ``sys.path`` themselves.
"""
