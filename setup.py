"""dschat: a faithful, tested re-implementation of DeepSpeed-Chat (SFT -> reward model -> PPO)."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
version = {}
exec((HERE / "dschat" / "version.py").read_text(), version)

setup(
    name="dschat",
    version=version["__version__"],
    description="DeepSpeed-Chat re-implemented: SFT, reward model, DPO and PPO on DeepSpeed ZeRO",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # A real package (upstream's namespace package ships an empty wheel).
    packages=find_packages(include=["dschat", "dschat.*"]),
    package_data={"dschat": ["data/builtin_prefs/*.jsonl", "py.typed"]},
    include_package_data=False,
    install_requires=[
        "torch>=2.6",  # weights_only=True cannot be bypassed from 2.6 (CVE-2025-32434)
        "deepspeed>=0.16,<0.20",
        "transformers>=5.0,<6",
        "datasets>=3.0",
        "peft>=0.13",
        "accelerate>=1.0",
        "bitsandbytes>=0.45",
        "gguf>=0.10",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "numpy>=1.24",
        "filelock>=3.20.1",  # no symlink truncation of the lock path (CVE-2025-68146)
        "tensorboard>=2.14",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=8"],
    },
)
