"""The fairseq adapter end to end on CPU: binarize a generated corpus, fairseq-train the MoE LM and
translation model for 30 updates, resume, fairseq-eval-lm, fairseq-generate, fairseq-hydra-train,
and clear errors for bad flags. fairseq runs in a subprocess: each command as `python -m fairseq_cli.*` runs it,
one after another in one interpreter (helpers.fairseq.run_modules)."""
import os
import subprocess
import sys

import pytest

from helpers.docs_blocks import runnable_blocks
from helpers.fairseq import CPU, TINY_LM, TINY_MT, needs_fairseq, run_modules, train_losses, user_dir
from helpers.paths import REPO

pytestmark = needs_fairseq

UPDATES = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus):
    return {"root": str(tmp_path_factory.mktemp("fairseq")), **corpus}


def lm_args(data, save_dir, max_update):
    return [data["lm"], "--user-dir", user_dir(), "--task", "language_modeling", *TINY_LM,
            "--criterion", "moe_cross_entropy", "--optimizer", "adam", "--lr", "0.005", "--dropout", "0",
            "--tokens-per-sample", "64", "--sample-break-mode", "complete", "--batch-size", "8",
            "--max-update", max_update, "--save-dir", save_dir, "--no-epoch-checkpoints", *CPU]


def mt_args(data, save_dir, max_update):
    return [data["mt"], "--user-dir", user_dir(), "--task", "translation", *TINY_MT,
            "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--optimizer", "adam",
            "--lr", "0.005", "--dropout", "0", "--max-tokens", "400", "--max-update", max_update,
            "--save-dir", save_dir, "--no-epoch-checkpoints", *CPU]


# each ends fairseq-train as argparse's own errors do: `prog: error: message`, one line, exit status 2
BAD_FLAGS = [
    (["--moe-second-expert-policy", "sampling"], "--moe-second-expert-policy 'sampling' is not supported"),
    (["--moe-top-k", "9"], "--moe-top-k: MoEConfig.top_k=9 is invalid: must be between 1 and num_experts=4"),
    (["--moe-freq", "3"], "--moe-freq 3 with --decoder-layers 2 gives no MoE layer"),
    (["--moe-ep-size", "2"], "--moe-ep-size 2 needs a distributed run"),
    (["--moe-expert-count", "0"], "--moe-expert-count: MoEConfig.num_experts=0 is invalid"),
    (["--moe-capacity-factor", "nan"], "--moe-capacity-factor: MoEConfig.capacity_factor=nan is invalid"),
    (["--moe-router", "foo"], "--moe-router: MoEConfig.router='foo' is invalid"),
    (["--moe-ep-size", "3"], "--moe-ep-size: ep_size=3 cannot hold num_experts=4"),
    (["--moe-gate-loss-wt", "-1"], "--moe-gate-loss-wt -1.0 is invalid"),
]
ONE_LINE_CASES = (3, 5)   # also run as the console script fairseq-train, its stderr alone: --moe-ep-size 2, nan


def hydra_overrides(data, out):
    return [f"task.data={data['lm']}", f"common.user_dir={user_dir()}", "common.cpu=true",
            "optimization.max_update=3", "+model.decoder_embed_dim=32", "+model.decoder_ffn_embed_dim=64",
            "+model.decoder_layers=2", "model.moe_expert_count=4", "task.tokens_per_sample=64",
            f"checkpoint.save_dir={out / 'ckpt'}", "common.log_interval=1", "dataset.num_workers=0",
            "dataset.required_batch_size_multiple=1", f"hydra.run.dir={out / 'hydra'}"]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Every fairseq command of this module's tests, in the order the tests were written, one after another in one
    interpreter (helpers.fairseq.run_modules: fairseq imported once, not 11 times): {name: CompletedProcess}.
    fairseq-hydra-train goes last (hydra changes the working folder)."""
    lm, mt = os.path.join(data["root"], "lm"), os.path.join(data["root"], "mt")
    bad = [str(tmp_path_factory.mktemp("bad_flag")) for _ in BAD_FLAGS]
    hydra = tmp_path_factory.mktemp("hydra")
    commands = {
        "lm": ("fairseq_cli.train", lm_args(data, lm, UPDATES)),
        "lm resumed": ("fairseq_cli.train", lm_args(data, lm, UPDATES + 3)),
        "eval_lm": ("fairseq_cli.eval_lm", [data["lm"], "--user-dir", user_dir(), "--path",
                                            os.path.join(lm, "checkpoint_best.pt"), "--tokens-per-sample", "64",
                                            "--batch-size", "8", "--cpu", "--num-workers", "0"]),
        "mt": ("fairseq_cli.train", mt_args(data, mt, UPDATES)),
        "generate": ("fairseq_cli.generate", [data["mt"], "--user-dir", user_dir(), "--path",
                                              os.path.join(mt, "checkpoint_last.pt"), "--beam", "2", "--batch-size",
                                              "16", "--max-len-b", "20", "--cpu", "--num-workers", "0"]),
        **{f"bad flag {i}": ("fairseq_cli.train", lm_args(data, out, 1) + flags)
           for i, ((flags, _), out) in enumerate(zip(BAD_FLAGS, bad))},
        "hydra": ("fairseq_cli.hydra_train", ["--config-dir", os.path.join(REPO, "configs", "fairseq"),
                                              "--config-name", "transformer_lm_moe"] + hydra_overrides(data, hydra)),
    }
    done = run_modules(commands.values(), cwd=data["root"], timeout=900, check=False)
    return {"lm dir": lm, "mt dir": mt, "hydra dir": hydra, **dict(zip(commands, done))}


def succeeded(run):
    assert run.returncode == 0, f"{run.args[0]} failed ({run.returncode}):\n{run.stdout[-6000:]}"
    return run.stdout


def test_user_dir_is_printed_and_registers_once_under_both_names(tmp_path):
    path = user_dir()
    assert os.path.isfile(os.path.join(path, "__init__.py"))
    assert os.path.basename(path) == "fairseq_moe"
    # the installed package first, then fairseq's --user-dir import of the same folder by its base name
    script = (f"import argparse, sys\n"
              f"import moe_plugin.integrations.fairseq_moe\n"
              f"from fairseq import utils\n"
              f"utils.import_user_module(argparse.Namespace(user_dir={path!r}))\n"
              f"assert 'fairseq_moe' in sys.modules\n"
              f"from fairseq.models import ARCH_MODEL_REGISTRY\n"
              f"from fairseq.criterions import CRITERION_REGISTRY\n"
              f"print(sorted(a for a in ARCH_MODEL_REGISTRY if 'moe' in a), sorted(c for c in CRITERION_REGISTRY "
              f"if 'moe' in c))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("['transformer_iwslt_de_en_moe', 'transformer_lm_moe', 'transformer_lm_moe_base', "
            "'transformer_lm_moe_small', 'transformer_moe'] ['moe_cross_entropy', "
            "'moe_label_smoothed_cross_entropy']") in out.stdout


def test_lm_loss_falls_and_gate_statistics_are_logged(runs):
    save_dir, log = runs["lm dir"], succeeded(runs["lm"])
    losses = train_losses(log)
    assert max(losses) == UPDATES
    assert losses[UPDATES] < 0.6 * losses[1], losses
    last = [line for line in log.splitlines() if "| train_inner |" in line][-1]
    for key in ("moe_gate_loss=", "moe_dropped=", "moe_share_e0=", "moe_share_e3="):
        assert key in last
    assert os.path.isfile(os.path.join(save_dir, "checkpoint_last.pt"))


def test_lm_resumes_from_checkpoint_last(runs):
    succeeded(runs["lm"])
    log = succeeded(runs["lm resumed"])
    assert f"@ {UPDATES} updates" in log and "Loaded checkpoint" in log
    assert sorted(train_losses(log)) == [UPDATES + 1, UPDATES + 2, UPDATES + 3]


def test_eval_lm_on_the_trained_lm(runs):
    succeeded(runs["lm"])
    log = succeeded(runs["eval_lm"])
    perplexity = float(log.split("Perplexity:")[1].split()[0])
    assert 1.0 < perplexity < 8.0   # 24-word counting corpus: far below the 28 symbols of the dictionary


def test_translation_loss_falls(runs):
    save_dir, log = runs["mt dir"], succeeded(runs["mt"])
    losses = train_losses(log)
    assert max(losses) == UPDATES
    assert losses[UPDATES] < losses[1] - 1.0, losses
    assert os.path.isfile(os.path.join(save_dir, "checkpoint_last.pt"))


def test_generate_with_the_trained_translation_model(runs):
    succeeded(runs["mt"])
    log = succeeded(runs["generate"])
    hypotheses = [line for line in log.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 40
    assert "BLEU4" in log


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[message for _, message in BAD_FLAGS])
def test_bad_flag_fails_before_training_with_a_clear_message(runs, case):
    proc, message = runs[f"bad flag {case}"], BAD_FLAGS[case][1]
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert f"train.py: error: {message}" in proc.stdout and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert "Start iterating over samples" not in proc.stdout and "model: " not in proc.stdout


@pytest.mark.parametrize("case", ONE_LINE_CASES, ids=[BAD_FLAGS[case][1] for case in ONE_LINE_CASES])
def test_bad_flag_ends_fairseq_train_in_one_line_with_exit_status_2(data, case, tmp_path):
    """The console script as a user runs it: stderr is the one line `fairseq-train: error: ...` (fairseq's log
    goes to stdout)."""
    command = os.path.join(os.path.dirname(sys.executable), "fairseq-train")
    flags, message = BAD_FLAGS[case]
    done = subprocess.run([command, *lm_args(data, str(tmp_path), "1"), *flags], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"fairseq-train: error: {message}"), done.stderr


def test_hydra_train_with_the_lm_config(runs):
    log = succeeded(runs["hydra"])
    assert "model: TransformerLanguageModelMoE" in log and "num_updates=3" in log
    assert os.path.isfile(runs["hydra dir"] / "ckpt" / "checkpoint_last.pt")


def test_readme_recipe_is_the_docs_runnable_recipe():
    """The main README's fairseq commands are docs/fairseq.md's runnable block (which tests/test_docs.py runs and
    checks), apart from that block's temporary folder and its 5 updates instead of 50."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    recipe = readme.split("<!-- fairseq-recipe:start -->")[1].split("<!-- fairseq-recipe:end -->")[0]
    block = next(code for block_id, _, code, _ in runnable_blocks() if block_id == "fairseq-1").splitlines()
    assert block[0] == "cd $REPO && D=$(mktemp -d)" and block[-1] == "rm -rf $D", block
    docs = "\n".join(block[1:-1]).replace("$D/", "").replace("--max-update 5 ", "--max-update 50 ")
    assert recipe.split() == docs.split()
