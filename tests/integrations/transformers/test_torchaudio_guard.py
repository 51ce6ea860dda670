"""The torchaudio guard (integrations/transformers/torchaudio_guard.py) whatever was imported first: a fresh
interpreter imports transformers and the integration in either order, then builds tiny Llama and Mixtral models
from config, or loads saved tiny folders with from_pretrained (their logits equal the saved model's). Where
fairseq's torchaudio is installed and cannot load (this project's `all` extras), `import transformers` first used to
break every model import ("Could not import module 'LlamaForCausalLM'")."""
import json
import subprocess
import sys

import pytest
import torch

from helpers.hf import needs_transformers, transformers
from helpers.paths import REPO

pytestmark = [needs_transformers, pytest.mark.timeout(300)]

SIZES = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32)
FAMILIES = {"llama": dict(SIZES), "mixtral": dict(SIZES, num_local_experts=4, num_experts_per_tok=2)}
IMPORTS = {"transformers first": "import transformers\nimport moe_plugin.integrations.transformers\n",
           "integration first": "import moe_plugin.integrations.transformers\nimport transformers\n"}

CHILD = """
import json, sys
{imports}
import torch
spec = json.loads(sys.argv[1])
for family, sizes in spec["families"].items():
    if spec["way"] == "config":
        config = transformers.AutoConfig.for_model(family, **sizes)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model(torch.randint(0, sizes["vocab_size"], (1, 5)))
    else:
        folder = spec["folders"][family]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        saved = torch.load(folder + "/probe.pt")
        with torch.no_grad():
            torch.testing.assert_close(model(saved["ids"]).logits, saved["logits"], rtol=0, atol=0)
    print(family, type(model).__name__)
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved tiny folder per family, with input ids and the saved model's logits (probe.pt)."""
    out = {}
    for family, sizes in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **sizes))
        model.eval().save_pretrained(folder)
        ids = torch.randint(0, sizes["vocab_size"], (2, 7))
        with torch.no_grad():
            torch.save({"ids": ids, "logits": model(ids).logits}, folder / "probe.pt")
        out[family] = str(folder)
    return out


@pytest.mark.parametrize("way", ["config", "from_pretrained"])
@pytest.mark.parametrize("order", list(IMPORTS))
def test_models_build_and_load_whatever_was_imported_first(order, way, folders):
    spec = {"families": FAMILIES, "way": way, "folders": folders}
    run = subprocess.run([sys.executable, "-c", CHILD.format(imports=IMPORTS[order]), json.dumps(spec)],
                         capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["llama", "LlamaForCausalLM", "mixtral", "MixtralForCausalLM"]
