"""Every `moe-plugin` subcommand answers a bad input with exit status 2 and one line that names what was wrong (for
argparse's own errors: its usage, then that line), never a traceback: unknown keys and flags, wrong types,
out-of-range numbers, malformed and missing files, a damaged checkpoint folder."""
import argparse
import subprocess
import sys

import pytest

from moe_plugin.cli import build_parser, main

import helpers.train

TINY = [*helpers.train.TINY, "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "log.plots=false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad inputs on disk: malformed YAML, YAML that is not a mapping, a folder, and a damaged checkpoint (a real
    one from a 2-step run, its shard cut in half)."""
    folder = tmp_path_factory.mktemp("bad_inputs")
    (folder / "malformed.yaml").write_text("model:\n  dim: [1, 2\ntrain: {steps: 3}\n")
    (folder / "list.yaml").write_text("- model\n- train\n")
    (folder / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81")
    helpers.train.run_in(folder / "run", *TINY)
    damaged = folder / "run" / "checkpoints" / "step_000002"
    shard = damaged / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    return {"malformed": folder / "malformed.yaml", "list": folder / "list.yaml", "binary": folder / "binary.yaml",
            "folder": folder, "missing": folder / "missing.yaml", "damaged": damaged,
            "metrics": folder / "run" / "metrics.jsonl"}


# (arguments, with {name} for files' paths; what the error line must say)
CASES = [
    (["train", "moe.num_expertz=4"], "unknown key 'moe.num_expertz' (did you mean 'num_experts'?)"),
    (["train", "train.steps=abc"], "train.steps"),
    (["train", "train.steps=0"], "train.steps=0 is invalid: must be >= 1"),
    (["train", "moe.top_k=99"], "top_k=99 is invalid: must be between 1 and num_experts=8"),
    (["train", "moe.capacity_factor=nan"], "capacity_factor='nan' is invalid: must be a finite number"),
    (["train", "{malformed}"], "malformed.yaml, line 3, column 6: not valid YAML"),
    (["train", "{list}"], "list.yaml: must be a mapping of sections"),
    (["train", "{binary}"], "binary.yaml: not a UTF-8 text file"),
    (["train", "{missing}"], "missing.yaml' does not exist; give a YAML file or a shipped experiment's name: default,"),
    (["train", "{folder}"], "is a folder, not a file"),
    (["train", "no_such_experiment"], "'no_such_experiment' does not exist"),
    (["train", "--nproc-per-node", "0"], "--nproc-per-node=0 is invalid"),
    (["train", "--nproc-per-node", "two"], "argument --nproc-per-node: invalid int value: 'two'"),
    (["train", *TINY, "log.out_dir={folder}/resumed", "train.resume={damaged}"], "the checkpoint is damaged"),
    (["checkpoint", "inspect", "{damaged}"], "DAMAGED checkpoint"),
    (["checkpoint", "convert", "{damaged}", "{folder}/one.pt"], "is damaged"),
    (["checkpoint", "inspect", "{missing}"], "does not exist"),
    (["checkpoint", "inspect", "{metrics}"], "is not a full checkpoint file"),
    (["checkpoint", "rename", "{damaged}"], "invalid choice: 'rename'"),
    (["checkpoint", "convert", "--from", "tutel", "{metrics}", "{folder}/one.pt", "--ranks", "1"],
     "metrics.jsonl' is not a checkpoint torch.load reads"),
    (["checkpoint", "convert", "{damaged}", "{folder}/one.pt", "--ranks", "2"], "--ranks given without --from tutel"),
    (["bench", "--num-experts", "0"], "--num-experts=0 is invalid: must be an integer >= 1"),
    (["bench", "--top-k", "9"], "--top-k=9 is invalid: must be between 1 and --num-experts=8"),
    (["bench", "--tokens", "0"], "--tokens=0 is invalid: must be an integer >= 1"),
    (["bench", "--rounds", "-1"], "--rounds=-1 is invalid"),
    (["bench", "--device", "tpu7"], "--device=tpu7 is invalid: must be cpu or cuda"),
    (["bench", "--skip", "einsum,fast"], "fast is not a candidate; allowed: a comma-separated list of einsum,"),
    (["bench", "--capacity-factor", "inf"], "--capacity-factor=inf is invalid"),
    (["bench", "--num-experts", "8.5"], "argument --num-experts: invalid int value: '8.5'"),
    (["bench", "--activation", "tanh"], "argument --activation: invalid choice: 'tanh'"),
    (["plan", "--world-size", "0"], "--world-size=0 is invalid"),
    (["plan", "--world-size", "2", "{malformed}"], "malformed.yaml, line 3, column 6: not valid YAML"),
    (["plan", "--world-size", "2", "moe.num_expertz=4"], "unknown key 'moe.num_expertz'"),
    (["plan", "--world-size", "2", "--device", "tpu7"], "--device='tpu7' is invalid"),
    (["plan"], "the following arguments are required: --world-size"),
    (["info", "--verbose"], "unrecognized arguments: --verbose"),
    (["fairseq-user-dir", "{folder}"], "unrecognized arguments"),
    (["serve"], "invalid choice: 'serve'"),
]


def test_every_subcommand_has_bad_inputs_here():
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    assert set(commands.choices) <= {arguments[0] for arguments, _ in CASES}


@pytest.mark.parametrize("arguments, says", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_input_is_one_line_and_exit_status_2(arguments, says, files, capsys):
    capsys.readouterr()
    try:
        status = main([argument.format(**files) for argument in arguments])
    except SystemExit as exit:     # argparse's own errors
        status = exit.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert says in lines[-1] and lines[-1].startswith("moe-plugin"), lines
    assert len(lines) == 1 or lines[0].startswith("usage:"), lines     # one line, after argparse's usage


def test_the_command_itself_prints_one_line_for_a_malformed_file(files):
    """What a user sees at the shell: the installed command's entry point, not main() in this process."""
    done = subprocess.run([sys.executable, "-m", "moe_plugin.cli", "train", str(files["malformed"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"moe-plugin train: config file {files['malformed']}, line 3, "
                                                f"column 6: not valid YAML: expected ',' or ']', but got ':'"]
