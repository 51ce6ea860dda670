from setuptools import find_packages, setup

DEEPSPEED = ["deepspeed==0.19.8"]
FAIRSEQ = ["fairseq-fixed==0.12.3.1"]
# GPU kernels. triton 3.6 and older cannot run the CPU tests: their interpreter fails under numpy 2.4;
# 3.7.1 is the version torch 2.13's CUDA wheels pin. triton pulls in no torch and no CUDA wheels.
TRITON = ["triton>=3.7.1"]
# Hugging Face MoE families (integrations/transformers): the family table and weight layouts follow 5.23
# accelerate: transformers.Trainer needs it (HF Trainer + DeepSpeed, tested with 1.15.0)
TRANSFORMERS = ["transformers==5.23.0", "accelerate==1.15.0"]
DEV = ["pytest>=7", "pytest-timeout>=2"]

setup(
    name="moe_plugin",
    version="0.1.0",
    description="A fast Mixture-of-Experts layer for PyTorch, for DeepSpeed and fairseq",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # every package under moe_plugin/, plus the adapters in integrations/ (installed as moe_plugin.integrations)
    packages=find_packages(include=["moe_plugin", "moe_plugin.*"])
    + ["moe_plugin.integrations", "moe_plugin.integrations.deepspeed", "moe_plugin.integrations.fairseq_moe",
       "moe_plugin.integrations.transformers"],
    package_data={"moe_plugin.integrations.fairseq_moe": ["README.md"]},
    package_dir={"moe_plugin": "moe_plugin", "moe_plugin.integrations": "integrations"},
    install_requires=["torch>=2.1", "omegaconf>=2.1", "tqdm>=4.40", "matplotlib>=3.5", "ninja"],
    extras_require={"deepspeed": DEEPSPEED, "fairseq": FAIRSEQ, "triton": TRITON, "transformers": TRANSFORMERS,
                    "dev": DEV, "all": DEEPSPEED + FAIRSEQ + TRITON + TRANSFORMERS + DEV},
    entry_points={"console_scripts": ["moe-plugin=moe_plugin.cli:main"]},
)
