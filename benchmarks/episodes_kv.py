"""Multi-turn episodes: the conversation's KV cache kept between turns against prefilling it again.

    DS_ACCELERATOR=cpu python benchmarks/episodes_kv.py --model smollm2-135m   # the embedded SmolLM2, fp32
    DS_ACCELERATOR=cpu python benchmarks/episodes_kv.py --model smollm2-135m --path dschat-he
    DS_ACCELERATOR=cpu python benchmarks/episodes_kv.py --model tiny-llama

No DeepSpeed engine and no training: :class:`dschat.rlhf.episodes.EpisodePlayer` plays ``--batch``
episodes of the builtin held-out prompts through the rollout generator (``--path``: dschat's sample
loop on the bare Hugging Face model, or dschat's Hybrid Engine; greedy) with an environment that
answers every turn with the same observation and ends the episode after ``--turns`` turns. Every
actor turn is exactly ``--turn_tokens`` tokens (a hook makes the last one EOS: on the module's
forward, or around the decode model's prefill and step), so both modes play the same work:

* ``reuse``: the conversation's KV cache is continued (each turn feeds only the rows' new tokens);
* ``prefill``: ``EpisodePlayer.reuse_kv = False``, each turn prefills the whole conversation again.

The modes take turns, ``--warmup`` + ``--repeats`` plays each; it prints per mode the median play
time and the tokens fed to the model's forwards in one play, the ratio of the medians (from the same
run), and whether the two modes' episodes are equal. Results are appended to
``benchmarks/results.md`` (``--results``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dschat.envs import EnvironmentFactory  # noqa: E402
from dschat.rlhf.episodes import EpisodePlayer  # noqa: E402
from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision  # noqa: E402
from dschat.rlhf.rollout.generator import RolloutGenerator  # noqa: E402
from dschat.rlhf.rollout.sampling import DecodingSettings  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from decode import prompts_for  # noqa: E402
from step3 import publish  # noqa: E402  (one results format for every benchmark)

MODES = ("reuse", "prefill")
PATHS = ("dschat", "dschat-he")
LABELS = {"dschat": "dschat's sample loop", "dschat-he": "dschat's Hybrid Engine, eager, oneDNN-packed weights"}
OBSERVATION = "Thank you. Now say it again in other words, and add one more detail to it."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model folder or dschat short name")
    p.add_argument("--path", choices=PATHS, default="dschat",
                   help="dschat: the sample loop on the module; dschat-he: dschat's Hybrid Engine")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn_tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"), help="append here ('': don't)")
    args = p.parse_args(argv)
    if min(args.batch, args.turns, args.repeats) < 1 or args.turn_tokens < 2 or args.warmup < 0:
        p.error("--batch, --turns and --repeats must be >= 1, --turn_tokens >= 2, --warmup >= 0")
    return args


class _Echo:
    """Answers every turn with :data:`OBSERVATION`; done after ``turns`` turns."""

    def __init__(self, turns: int) -> None:
        self.turns, self.played = turns, 0

    def step(self, answer: str) -> Any:
        self.played += 1
        done = self.played >= self.turns
        return (None if done else OBSERVATION), 0.0, done


class _Engine:
    """What RolloutGenerator uses of a DeepSpeed engine (``.module``), around a bare model."""

    def __init__(self, module: Any) -> None:
        self.module = module


class _FixedTurns:
    """Each rollout's ``n``-th token is EOS for every row; counts the tokens fed. Hooks on the
    module's forward (:meth:`on_module`), or around dschat's decode model (:meth:`on_decode_model`)."""

    def __init__(self, eos: int, n: int) -> None:
        self.eos, self.n, self.step, self.fed = eos, n, 0, 0

    def end(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) next-token logits, changed in place."""
        self.step += 1  # the rollout's prefill is step 1: it gives the first token
        if self.step >= self.n:
            logits[:, self.eos] = logits.max(-1).values + 1.0
        else:
            logits[:, self.eos] = -float("inf")
        return logits

    def on_module(self, model: Any) -> None:
        def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            self.fed += kwargs["input_ids"].numel()

        def end(module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
            self.end(out.logits[:, -1])
            return out

        model.register_forward_pre_hook(count, with_kwargs=True)
        model.register_forward_hook(end, with_kwargs=True)

    def on_decode_model(self) -> Callable[[], None]:
        """Wraps the decode model's passes; returns what puts them back."""
        from dschat.models.decoder.forward import DecodeModel

        prefill, step = DecodeModel.prefill, DecodeModel.step

        def counted_prefill(model: Any, tokens: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            self.fed += tokens.numel()
            return self.end(prefill(model, tokens, *a, **k))

        def counted_step(model: Any, token: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            self.fed += token.numel()
            return self.end(step(model, token, *a, **k))

        DecodeModel.prefill, DecodeModel.step = counted_prefill, counted_step  # type: ignore[method-assign]

        def restore() -> None:
            DecodeModel.prefill, DecodeModel.step = prefill, step  # type: ignore[method-assign]
        return restore


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    device = torch.device("cpu")
    tokenizer = load_hf_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.float32).eval()
    ids, mask = prompts_for(tokenizer, args.batch, device)
    engine = args.path == "dschat-he"
    gen = RolloutGenerator(_Engine(model), tokenizer,
                           decision=HybridEngineDecision(engine, False, dschat_engine=engine),
                           decoding=DecodingSettings("greedy"), max_answer_seq_len=1, zero_stage=0)
    hooks = _FixedTurns(tokenizer.eos_token_id, args.turn_tokens)
    if not engine:
        hooks.on_module(model)
    rollout = gen.rollout

    def each_rollout(*a: Any, **k: Any) -> Any:
        hooks.step = 0
        return rollout(*a, **k)

    gen.rollout = each_rollout  # type: ignore[method-assign]
    player = EpisodePlayer(gen, tokenizer, EnvironmentFactory("episodes_kv:_Echo", lambda row: _Echo(args.turns)),
                           max_turns=args.turns, max_answer_seq_len=1, max_context=1)
    # Room for every turn: the actor's tokens and the observations as rendered (chat template included).
    answer = args.turns * args.turn_tokens + (args.turns - 1) * len(player.observation_ids(OBSERVATION, True)) + 8
    gen.max_answer_seq_len = player.max_answer_seq_len = answer
    player.max_context = ids.shape[1] + answer
    times: dict[str, list[float]] = {m: [] for m in MODES}
    fed: dict[str, int] = {}
    played: dict[str, Any] = {}
    rows = [{"prompt": str(i)} for i in range(args.batch)]
    restore = hooks.on_decode_model() if engine else (lambda: None)
    try:
        for i in range(args.warmup + args.repeats):
            for mode in MODES:
                player.reuse_kv = mode == "reuse"
                hooks.fed = 0
                t0 = time.perf_counter()
                played[mode] = player.play(ids, mask, rows)
                took = time.perf_counter() - t0
                fed[mode] = hooks.fed
                if i >= args.warmup:
                    times[mode].append(took)
                print(f"[{mode}] play {i}{' (warm-up)' if i < args.warmup else ''}: {took:.3f} s, "
                      f"{hooks.fed} tokens fed", flush=True)
    finally:
        restore()
    same = all(torch.equal(getattr(played["reuse"], k), getattr(played["prefill"], k))
               for k in ("sequences", "attention_mask", "observation_mask"))
    assert int(played["reuse"].turns.min()) == args.turns, "every episode plays --turns turns"
    assert gen.last_loop == args.path, f"{gen.last_loop} decoded, not {args.path}"
    median = {m: statistics.median(times[m]) for m in MODES}
    command = "python benchmarks/episodes_kv.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    import transformers

    lines = [
        f"### multi-turn episodes, {datetime.date.today().isoformat()}: {args.model}, {args.batch} episodes x "
        f"{args.turns} turns x {args.turn_tokens} greedy tokens, prompt width {ids.shape[1]}, fp32",
        "",
        f"- device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} threads); torch {torch.__version__}, transformers {transformers.__version__}",
        f"- command: `{command}`",
        f"- median of {args.repeats} plays after {args.warmup} warm-up, the modes taking turns; episodes of the "
        "two modes " + ("equal" if same else "differ"),
        "- reuse: the conversation's KV cache continued between turns; prefill: every turn prefills the whole "
        f"conversation again ({LABELS[args.path]} both)",
        "",
        "| mode | play s (median) | tokens fed to the forwards | prefill s / reuse s |",
        "|---|---|---|---|",
        f"| reuse | {median['reuse']:.3f} | {fed['reuse']} | |",
        f"| prefill | {median['prefill']:.3f} | {fed['prefill']} | {median['prefill'] / median['reuse']:.2f} |",
        "",
    ]
    return publish(lines, args.results)


if __name__ == "__main__":
    main()
