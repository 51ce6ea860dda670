"""DeepSpeed's CPU comm op is built once before these tests start DeepSpeed (helpers.plugin); the generated corpus
is binarized once for every fairseq test module (its two fairseq-preprocess commands in one interpreter, which
imports fairseq once: helpers.fairseq.run_modules)."""
import pytest

from helpers.fairseq import binarize


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_comm_op(deepspeed_comm_op_built):
    pass


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """{"lm": the LM data folder, "mt": the translation data folder}, read-only to the tests."""
    lm, mt = binarize(str(tmp_path_factory.mktemp("fairseq_corpus")))
    return {"lm": lm, "mt": mt}
