"""The long-running examples (examples/hf_generate.py, examples/llama_attention_replacement.py)
tell a CPU user up front that the run takes a while and log their progress to stderr, without
changing what they print to stdout or compute. Run on CPU with the tiny configs."""
import re

import pytest
import torch

pytest.importorskip("transformers")

import flash_attention_sm75 as fa  # noqa: E402
from repo_scripts import load_script, run_script  # noqa: E402

STAMP = r"^\[\d\d:\d\d:\d\d\] "

needs_op = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE, reason="extension not built")


def run_example(*args, timeout=300):
    r = run_script(*args, timeout=timeout, hide_cuda=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def _load(name):
    return load_script(f"examples/{name}.py")


def _progress_lines(stderr):
    lines = [line for line in stderr.splitlines() if re.match(STAMP, line)]
    assert lines, stderr
    return [re.sub(STAMP, "", line) for line in lines]


def _assert_cpu_warning_first(lines):
    first = lines[0]
    assert first.startswith("warning: running on the CPU") and "minute" in first, lines


@needs_op
def test_hf_generate_warns_on_cpu_and_logs_progress_to_stderr():
    r = run_example("examples/hf_generate.py", "--config", "qwen2", "--new-tokens", "3",
                    "--compare")
    lines = _progress_lines(r.stderr)
    _assert_cpu_warning_first(lines)
    assert sum(line.startswith("warning") for line in lines) == 1
    assert any(line.startswith("loading qwen2 on cpu") for line in lines), lines
    assert any(line.startswith("model ready in") for line in lines), lines
    # per-token progress of both generations, ending at the last token
    for label in ("generate", "stock SDPA"):
        steps = [line for line in lines if line.startswith(f"{label}: ")]
        assert steps and steps[-1].startswith(f"{label}: 3/3 new tokens"), lines
    # the results stay on stdout, the progress stays off it
    assert re.search(r"^\[0\] new token ids: \[", r.stdout, re.M), r.stdout
    assert "identical tokens" in r.stdout
    assert not re.search(STAMP, r.stdout, re.M)


@needs_op
def test_llama_attention_replacement_warns_on_cpu_and_logs_progress_to_stderr():
    r = run_example("examples/llama_attention_replacement.py", "--config", "llama",
                    "--prompt-len", "16")
    lines = _progress_lines(r.stderr)
    _assert_cpu_warning_first(lines)
    assert any(line.startswith("loading llama on cpu") for line in lines), lines
    for step in (1, 2, 3):
        assert any(re.match(rf"forward pass {step}/3: all \d+ decoder layers done", line)
                   for line in lines), lines
        assert any(line.startswith(f"forward pass {step}/3 done in") for line in lines), lines
    assert "identical to stock: True" in r.stdout
    assert not re.search(STAMP, r.stdout, re.M)


def test_importing_the_patch_example_configures_no_logging():
    module = _load("llama_attention_replacement")
    assert module.logger.handlers == []  # only main() sets up the progress output
    assert module.apply_patch is fa.apply_patch


@needs_op
def test_generation_progress_does_not_change_the_tokens(caplog):
    hf_generate = _load("hf_generate")
    from devtools.model_configs import load_model

    model = load_model("qwen2", dtype=torch.float32, seed=3)
    model.generation_config.eos_token_id = None
    args = hf_generate.parse_args(["--config", "qwen2", "--batch", "2", "--prompt-len", "12",
                                   "--new-tokens", "5", "--device", "cpu"])
    ids, am, pad_id = hf_generate.build_inputs(args, model, None)
    plain, _ = hf_generate.generate(model, ids, am, pad_id, args.new_tokens)
    progress = hf_generate.generation_progress(ids.shape[1], args.new_tokens, "test", every_s=0)
    with caplog.at_level("INFO", logger="hf_generate"):
        logged, _ = hf_generate.generate(model, ids, am, pad_id, args.new_tokens, progress)
    assert torch.equal(plain, logged)
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test: ")]
    assert [s.split()[1] for s in steps] == [f"{i}/{args.new_tokens}"
                                             for i in range(1, args.new_tokens + 1)]


@pytest.mark.parametrize("script,args", [
    ("hf_generate", ["--device", "cuda"]),
    ("llama_attention_replacement", ["--device", "cuda"]),
    ("llama_attention_replacement", ["--config", "bogus"]),
    ("hf_generate", ["--config", "bogus"]),
    ("hf_generate", ["--device", "bogus"]),
    ("llama_attention_replacement", ["--device", "bogus"]),
    ("llama_attention_replacement", ["--layers", "0"]),
    ("llama_attention_replacement", ["--prompt-len", "0"]),
    ("llama_attention_replacement", ["--model", "/nonexistent/checkpoint"]),
    ("hf_generate", ["--model", "/nonexistent/checkpoint"]),
    ("quickstart", ["--seqlen", "0"]),
    ("quickstart", ["--batch", "-1"]),
    ("quickstart", ["--heads", "x"]),
])
def test_examples_reject_bad_arguments_with_a_usage_error(script, args):
    # Before any model is built: argparse's exit status 2 and a message naming the option (no
    # GPU here: CUDA is hidden), not a traceback from torch or a KeyError.
    r = run_script(f"examples/{script}.py", *args, timeout=120, hide_cuda=True)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    option = args[0]
    assert f"argument {option}" in r.stderr or f"{option} " in r.stderr, r.stderr[-1000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@needs_op
def test_hf_generate_says_when_the_prompt_is_ignored():
    r = run_example("examples/hf_generate.py", "--config", "qwen2", "--new-tokens", "1",
                    "--prompt", "hello there")
    lines = _progress_lines(r.stderr)
    assert any(line.startswith("warning: --prompt is ignored without a tokenizer")
               for line in lines), lines
