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
    package_data={"dschat": ["data/builtin_prefs/*.jsonl", "data/builtin_prefs/samples/*.jsonl",
                             "data/wordgame/*.jsonl", "py.typed"]},
    include_package_data=False,
    # Each entry: what imports it. dschat's own imports, or a library's import for a feature dschat uses
    # (an optional dependency of that library, so dschat must declare it). Transitive requirements of
    # these (tqdm, packaging, ...) are their business and not repeated here.
    install_requires=[
        "torch>=2.6",  # dschat (everywhere); weights_only=True cannot be bypassed from 2.6 (CVE-2025-32434)
        "deepspeed>=0.16,<0.20",  # dschat (engines, ZeRO, launcher)
        "transformers>=5.0,<6",  # dschat (models, tokenizers, schedulers)
        "datasets>=3.0",  # dschat (dschat/data: hub and local datasets)
        "peft>=0.13",  # dschat (dschat/models/peft_adapter.py: LoraConfig of exported and loaded LoRA adapters)
        "accelerate>=1.0",  # transformers' HfDeepSpeedConfig, which dschat uses to build ZeRO-3 models partitioned
        "bitsandbytes>=0.45",  # dschat (dschat/models/lora.py: the 4-bit QLoRA base)
        "gguf>=0.10",  # transformers' GGUF reader, which dschat uses to unpack the embedded SmolLM2
        "safetensors>=0.4",  # dschat (saved models, adapters, data caches)
        "tokenizers>=0.20",  # dschat (dschat/models/tiny.py: the tiny models' BPE)
        "huggingface_hub>=1.0",  # dschat (dschat/models/registry.py: hub ids, the offline cache)
        "numpy>=1.24",  # dschat (data splits, checkpointed random states)
        "filelock>=3.20.1",  # dschat (data cache, tiny/embedded model builds); no symlink truncation of the lock path (CVE-2025-68146)
        "tensorboard>=2.14",  # torch.utils.tensorboard, which dschat uses for --enable_tensorboard
        "matplotlib>=3.7",  # dschat (dschat/eval/plots.py: the report's figures)
        "requests>=2.32",  # dschat (dschat/remote_reward.py: --reward_url's client)
    ],
    extras_require={
        # python -m dschat.serve (dschat/serve/app.py)
        "serve": ["fastapi>=0.115", "uvicorn>=0.30"],
        # --report_to wandb / mlflow (dschat/training/trackers.py); mlflow-skinny has the tracking
        # client and the file store dschat writes by default
        "wandb": ["wandb>=0.20"],
        "mlflow": ["mlflow-skinny>=3.0"],
        # tests/serve/test_serve_actor.py: the official OpenAI client against a served actor;
        # tests/training/test_trackers.py: W&B and MLflow runs read back;
        # pytest-xdist: the suite's files on two worker processes (the README's test command)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "fastapi>=0.115", "uvicorn>=0.30", "openai>=1.40", "wandb>=0.20",
                 "mlflow-skinny>=3.0"],
    },
)
