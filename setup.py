import os

from setuptools import Command, find_packages, setup
from setuptools.command.build import build

DEEPSPEED = ["deepspeed==0.19.8"]
FAIRSEQ = ["fairseq-fixed==0.12.3.1"]
# GPU kernels. 3.6 is what torch 2.11's CUDA wheels pin (the oldest torch we support); pip takes the newest
# otherwise. triton 3.6's CPU interpreter fails under numpy 2.4 (that one test skips, saying so).
# triton pulls in no torch and no CUDA wheels.
TRITON = ["triton>=3.6"]
# Hugging Face MoE families (integrations/transformers): the family table and weight layouts follow 5.23
# accelerate: transformers.Trainer needs it (HF Trainer + DeepSpeed, tested with 1.15.0)
TRANSFORMERS = ["transformers==5.23.0", "accelerate==1.15.0"]
# LoRA on the experts through PEFT (moe_plugin.integrations.transformers.peft); TRL's SFTTrainer on it (tested with
# 1.16.0, which installs beside torch 2.13.0 and transformers 5.23.0 without changing either)
LORA = ["peft==0.21.2", "trl==1.16.0"]
IMAGES = ["scikit-learn>=1.0"]   # the handwritten digits of `moe-plugin train` data.task=image (shipped, no download)
# pytest-xdist: the suite runs on one worker per core (at most 4: tests/helpers/plugin.py), whole files per worker.
# ruff: .ci/run's lint gate (ruff.toml). setuptools 70.1 builds wheels without the wheel
# package: tests/test_packaging.py builds this project's wheel in the test environment (no build isolation)
DEV = ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3.5", "ruff==0.17.5", "setuptools>=70.1",
       "tensorboard==2.21.0"]   # the routing-metrics tests read the event files hosts write
# the documentation site (mkdocs.yml, docs/): its hook generates the HF family list from the table (transformers)
DOCS = ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings[python]==1.0.8", "mkdocstrings-python==2.0.11"]

# The "moe" section wherever DeepSpeed starts (integrations/deepspeed/hook.py). site runs the .pth line at every
# interpreter start: unless MOE_PLUGIN_DEEPSPEED_HOOK=0, it puts an import finder at the head of sys.meta_path that
# answers None to every name but "deepspeed", and for that one imports the module (a copy of
# integrations/deepspeed/startup.py, whose DeepSpeedImportHook this stands in for) and asks it.
HOOK_PTH = "moe_plugin_deepspeed_hook.pth"
HOOK_MODULE = "moe_plugin_deepspeed_hook.py"
HOOK_SOURCE = os.path.join("integrations", "deepspeed", "startup.py")
HOOK_LINE = ("import os, sys; os.environ.get('MOE_PLUGIN_DEEPSPEED_HOOK', '1') == '0' "
             # once: site reads a venv's lib64 -> lib link as a second site dir
             "or any(type(f).__name__ == 'DeepSpeedImportHook' for f in sys.meta_path) or sys.meta_path.insert(0, "
             "type('DeepSpeedImportHook', (), {'find_spec': staticmethod(lambda name, *args: "
             "__import__('moe_plugin_deepspeed_hook').find_spec(name, *args) if name == 'deepspeed' else None)})())\n")

class BuildDeepSpeedHook(Command):
    """Write the .pth and its module to the top of what gets installed.

    A wheel (pip install .) installs what is in build_lib. An editable install (pip install -e ., PEP 660)
    installs only setuptools' unpacked editable wheel, which is the install command's install_lib meanwhile."""

    description = "write moe_plugin_deepspeed_hook.pth and its module"
    user_options = []
    editable_mode = False

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        targets = [self.build_lib]
        if self.editable_mode:
            targets.append(self.get_finalized_command("install").install_lib)
        for target in targets:
            self.mkpath(target)
            self.copy_file(HOOK_SOURCE, os.path.join(target, HOOK_MODULE))
            with open(os.path.join(target, HOOK_PTH), "w", encoding="utf-8") as file:
                file.write(HOOK_LINE)

    def get_source_files(self):
        return [HOOK_SOURCE]

    def get_outputs(self):
        return [os.path.join(self.build_lib, name) for name in (HOOK_MODULE, HOOK_PTH)]


class Build(build):
    sub_commands = build.sub_commands + [("build_deepspeed_hook", None)]


setup(
    name="moe_plugin",
    version="0.1.0",
    description="A fast Mixture-of-Experts layer for PyTorch, for DeepSpeed and fairseq",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # every package under moe_plugin/, plus the adapters in integrations/ (installed as moe_plugin.integrations),
    # plus what the package reads at run time (moe_plugin/ops/native.py's shipped): the C++ sources that ops/native.py builds on
    # first use, and the example configs (`moe-plugin train NAME`); tests/test_packaging.py checks a wheel's files
    packages=find_packages(include=["moe_plugin", "moe_plugin.*"])
    + ["moe_plugin.integrations", "moe_plugin.integrations.deepspeed", "moe_plugin.integrations.fairseq_moe",
       "moe_plugin.integrations.transformers", "moe_plugin.csrc", "moe_plugin.configs"],
    package_data={"moe_plugin.integrations.fairseq_moe": ["README.md"], "moe_plugin.csrc": ["*.cpp", "*.h"],
                  "moe_plugin.configs": ["*/*.yaml", "*/*.json"]},
    package_dir={"moe_plugin": "moe_plugin", "moe_plugin.integrations": "integrations", "moe_plugin.csrc": "csrc",
                 "moe_plugin.configs": "configs"},
    install_requires=["torch>=2.11", "omegaconf>=2.1", "tqdm>=4.40", "matplotlib>=3.5", "ninja"],
    extras_require={"deepspeed": DEEPSPEED, "fairseq": FAIRSEQ, "triton": TRITON, "transformers": TRANSFORMERS,
                    "images": IMAGES, "lora": TRANSFORMERS + LORA, "dev": DEV, "docs": TRANSFORMERS + DOCS,
                    "all": DEEPSPEED + FAIRSEQ + TRITON + TRANSFORMERS + LORA + IMAGES + DEV + DOCS},
    entry_points={"console_scripts": ["moe-plugin=moe_plugin.cli:main"]},
    cmdclass={"build": Build, "build_deepspeed_hook": BuildDeepSpeedHook},
)
