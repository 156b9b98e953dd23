"""The models under evaluation: loading the actors and the reward model, answering the held-out
prompts, per-token log-probs, reward scores, and the reward model's held-out accuracy.

Both actors answer with the same decoding settings and the same random stream (seeded sampling;
greedy with ``--greedy``). Token ids are scored as step 3 scores them (right-padded, the value at
the last real token).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from dschat.errors import UserError
from dschat.eval.heldout import EvalSettings
from dschat.gold_judge import gold_score
from dschat.models.build import create_critic_model, load_pretrained
from dschat.models.families import POSITION_TABLE_MODEL_TYPES
from dschat.models.registry import is_adapter_folder, load_config, resolve_model_path
from dschat.models.reward_inputs import encode_for_reward, reward_max_length
from dschat.models.reward_model import (check_critic_folder, is_reward_model_folder, last_token_index,
                                        not_a_critic_message, refuse_reward_model)
from dschat.models.tokenizer import end_token_ids, generate_eos, load_hf_tokenizer, tokenizer_differences
from dschat.paths import step3_part
from dschat.rl_math.logprobs import gather_log_probs
from dschat.runtime.zero3 import zero3_pass


# -------------------------------------------------------------------------------------------------
# Models
# -------------------------------------------------------------------------------------------------
def pick_device(name: str = "auto", flag: str = "--device") -> Any:
    """The torch device ``name`` (the option ``flag``) means: ``auto`` is CUDA when there is a GPU, else
    the CPU. A name that is no torch device, or a CUDA device this machine does not have, is one
    :class:`UserError` line naming ``flag`` -- checked before any model loads (the report and
    inference/chatbot.py share this check)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"{flag} {name!r} is not a torch device; give cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{flag} {name}: this machine has no CUDA device; give {flag} cpu or {flag} auto")
        if device.index is not None and device.index >= count:
            raise UserError(f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
                            f"give one of those, {flag} cpu or {flag} auto")
    elif device.type != "cpu":
        raise UserError(f"{flag} {name!r}: dschat runs models on cpu or cuda; give cpu, cuda, cuda:N or auto")
    return device


def check_not_step3_root(path: str | Path, flag: str) -> None:
    """Refuse, in one line naming ``flag``, a step-3 output root given where a reward model is wanted."""
    critic = step3_part(path, "critic")
    if critic is not None:
        raise UserError(f"{flag} {path} is a step-3 output folder, not a reward model; pass the step-2 "
                        f"--output_dir, or {critic} for step 3's critic")


def _check_folder(path: str | Path, what: str, adapters: bool = False) -> Path:
    folder = Path(path).expanduser()
    if adapters and is_adapter_folder(folder):
        resolve_model_path(str(folder))  # the adapter and the base it names: one line for a bad one
        return folder
    if not (folder / "config.json").is_file():
        raise UserError(f"{what} {folder} is not a model folder (no config.json); pass the step's --output_dir")
    return folder


def check_actor_folder(path: str | Path) -> Path:
    """``path`` as a model folder that is an actor (step 1 or 3), not a step-2 reward model; returned as
    the folder to load. A step-3 output root means its ``actor/`` (as inference/chatbot.py takes it)."""
    folder = step3_part(path, "actor") or _check_folder(path, "actor folder")
    refuse_reward_model(folder, str(folder), "pass a step-1 or step-3 actor folder")
    return folder


def check_reward_folder(path: str | Path, flag: str = "--reward") -> Path:
    """``path`` (the option ``flag``) as a reward-model folder: a step-2 output, its LoRA ``lora_adapter/``
    (with the value head beside the adapter) or a one-label sequence classifier."""
    check_not_step3_root(path, flag)
    folder = _check_folder(path, "reward-model folder", adapters=True)
    if not is_reward_model_folder(folder):
        raise UserError(not_a_critic_message(str(folder), flag))
    check_critic_folder(folder, str(folder), flag)  # a classifier of more than one label
    return folder


def check_answer_room(folders: Sequence[Path], prompts: Sequence[str], max_new_tokens: int) -> None:
    """Refuse (one line, before any model loads) a ``--max_new_tokens`` that, after the longest of
    ``prompts``, runs past the position table of an actor in ``folders`` (a family that computes its
    positions is not refused): generation would index past it (an ``IndexError`` mid-report)."""
    for folder in folders:
        try:
            config = load_config(resolve_model_path(str(folder)))
        except UserError:  # an adapter folder's model is its base's: loading it says what is wrong
            continue
        limit = getattr(config, "max_position_embeddings", None)
        if getattr(config, "model_type", "") not in POSITION_TABLE_MODEL_TYPES or not isinstance(limit, int):
            continue
        tokenizer = load_hf_tokenizer(str(folder))
        longest = max((len(tokenizer(p)["input_ids"]) for p in prompts), default=0)
        if longest + max_new_tokens > limit:
            raise UserError(f"--max_new_tokens {max_new_tokens} after the longest held-out prompt's {longest} tokens "
                            f"runs past the {limit} positions of {folder} (max_position_embeddings); give "
                            f"--max_new_tokens {max(limit - longest, 1)} or less")


def load_actor(path: str | Path, device: Any) -> tuple[Any, Any]:
    """A causal LM (eval mode) and its tokenizer from a step-1 or step-3 actor folder."""
    folder = check_actor_folder(path)
    config = load_config(str(folder))  # refuses a model that needs its own code
    tokenizer = load_hf_tokenizer(str(folder))
    model = load_pretrained(AutoModelForCausalLM, str(folder), config=config, dtype=torch.float32).to(device).eval()
    return model, tokenizer


def load_reward(path: str | Path, device: Any) -> tuple[Any, Any]:
    """The reward model (strict load: body + value head; a sequence classifier's ``score`` row as the
    value head; a step-2 ``lora_adapter/`` merged into its base) and its tokenizer."""
    folder = check_reward_folder(path)
    tokenizer = load_hf_tokenizer(str(folder))
    model = create_critic_model(str(folder), tokenizer, None, rlhf_training=True)
    return model.to(device).eval(), tokenizer


def empty_cache(device: Any) -> None:
    """Give the memory of deleted models back to the GPU (nothing to do on a CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _by_length(lengths: Sequence[int], size: int) -> Iterable[list[int]]:
    """Batches of indices, shortest first: scoring batches of similar lengths pad (and compute) little.
    Each row's result does not depend on its batch (right padding, masked)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return (order[start : start + size] for start in range(0, len(order), size))


def _pad(rows: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[Any, Any]:
    """(ids, attention_mask) tensors, padded on the left (generation) or right (scoring)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if not row:
            continue
        sl = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, sl] = torch.tensor(row, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


# -------------------------------------------------------------------------------------------------
# Generation, log-probs, reward scores
# -------------------------------------------------------------------------------------------------
@dataclass
class Samples:
    """One actor's answers. ``response_ids`` stop at (and include) the first EOS."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    ended: list[bool]  # the answer ended with an end id (EOS; not cut at max_new_tokens)


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], settings: EvalSettings) -> Samples:
    """Answer every prompt with ``settings``' decoding, seeded so both actors see the same randomness.
    An answer ends at any id of :func:`~dschat.models.tokenizer.end_token_ids` (as step 3's rollouts)."""
    ends, pad = end_token_ids(model, tokenizer), tokenizer.pad_token_id
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=settings.do_sample,
        temperature=settings.temperature if settings.do_sample else None,
        top_k=settings.top_k if settings.do_sample else None,
        top_p=settings.top_p if settings.do_sample else None,
        eos_token_id=generate_eos(ends),
        pad_token_id=pad,
    )
    device = next(model.parameters()).device
    torch.manual_seed(settings.seed)  # the same random stream for every actor evaluated
    out = Samples([], [], [], [], [])
    for chunk in _batches(list(prompts), settings.generation_batch_size or settings.batch_size):
        # Phase-3 prompts are tokenised without truncation (dschat.data.prompt_dataset) and left-padded.
        rows = [tokenizer(p)["input_ids"] for p in chunk]
        ids, mask = _pad(rows, pad, left=True)
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
        for prompt, row, gen in zip(chunk, rows, generated[:, ids.shape[1]:].tolist()):
            answer: list[int] = []
            ended = False
            for token in gen:
                answer.append(token)
                if token in ends:
                    ended = True
                    break
            if not ended:  # drop right padding after an early stop of other rows
                while answer and answer[-1] == pad and pad not in ends:
                    answer.pop()
            out.prompts.append(prompt)
            out.prompt_ids.append(list(row))
            out.response_ids.append(answer)
            out.texts.append(tokenizer.decode(answer, skip_special_tokens=True))
            out.ended.append(ended)
    return out


def response_logprobs(model: Any, samples: Samples, batch_size: int, pad_id: int,
                      temperature: float = 1.0) -> list[list[float]]:
    """log pi(a_t | prefix) of every answer token of ``samples`` under ``model``'s logits divided by
    ``temperature`` (the sampling temperature, as step 3 scores its rollouts; 1 for greedy answers)."""

    device = next(model.parameters()).device
    pairs = list(zip(samples.prompt_ids, samples.response_ids))
    result: list[list[float]] = [[] for _ in pairs]
    for chunk in _by_length([len(p) + len(r) for p, r in pairs], batch_size):
        ids, mask = _pad([pairs[i][0] + pairs[i][1] for i in chunk], pad_id, left=False)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            # Right padding: the default positions 0..len-1 are the real ones (no position_ids,
            # which some families' forward does not take).
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
            logp = gather_log_probs(logits, ids[:, 1:])  # (B, T-1): logp of token t+1
        for row, i in enumerate(chunk):
            prompt, answer = pairs[i]
            start = len(prompt) - 1  # position predicting the first answer token
            result[i] = logp[row, start : start + len(answer)].tolist()
    return result


def reward_scores(
    reward_model: Any, reward_tokenizer: Any, samples: Samples, actor_tokenizer: Any, batch_size: int
) -> list[float]:
    """The reward model's end score of each (prompt, answer), scored on the generated token ids as
    step 3 does when the tokenizers agree, else on the text rendered and re-tokenised for the reward
    model (a sequence classifier's chat template if its tokenizer has one, cut to its maximum length
    keeping the end: :func:`~dschat.models.reward_inputs.encode_for_reward`)."""
    same_tokens = not tokenizer_differences(reward_tokenizer, actor_tokenizer)
    template = getattr(reward_model, "reads_chat_template", True)
    max_length = reward_max_length(reward_tokenizer, getattr(reward_model, "config", None))
    rows = []
    for prompt, p_ids, r_ids, text, ended in zip(
        samples.prompts, samples.prompt_ids, samples.response_ids, samples.texts, samples.ended
    ):
        if same_tokens:
            rows.append(p_ids + r_ids)
        else:
            rows.append(encode_for_reward(reward_tokenizer, prompt, text, ended, max_length, template=template))
    return score_sequences(reward_model, rows, reward_tokenizer.pad_token_id, batch_size)


def score_sequences(reward_model: Any, rows: Sequence[Sequence[int]], pad_id: int, batch_size: int) -> list[float]:
    """End score (value at the last real token) of each token sequence."""

    device = next(reward_model.parameters()).device
    scores: list[float] = [0.0] * len(rows)
    for chunk in _by_length([len(r) for r in rows], batch_size):
        ids, mask = _pad([rows[i] for i in chunk], pad_id, left=False)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad(), zero3_pass(reward_model):  # a ZeRO-3 engine's pass, for its prefetch trace
            values = reward_model.forward_value(input_ids=ids, attention_mask=mask, return_value_only=True)
        end = last_token_index(mask)
        for i, score in zip(chunk, values.float().gather(1, end.unsqueeze(1)).squeeze(1).tolist()):
            scores[i] = score
    return scores


def pairwise_accuracy(
    reward_model: Any, tokenizer: Any, pairs: Sequence[dict], settings: EvalSettings
) -> dict[str, float | int]:
    """Held-out accuracy of the reward model, with the gold judge deciding which answer is better.

    Texts are built as step 2 builds them: ``prompt + answer + EOS`` (dschat's default end of
    conversation), truncated at ``max_seq_len``. Pairs the judge scores equal are skipped.
    """
    texts, labels, agree = [], [], 0
    for row in pairs:
        gold_c, gold_r = gold_score(row["prompt"], row["chosen"]), gold_score(row["prompt"], row["rejected"])
        if gold_c == gold_r:
            continue
        agree += gold_c > gold_r
        labels.append(gold_c > gold_r)  # True: the dataset's "chosen" is the judge's better answer
        eot = tokenizer.eos_token or ""
        for answer in (row["chosen"], row["rejected"]):
            texts.append(tokenizer(row["prompt"] + answer + eot, max_length=settings.max_seq_len, truncation=True)["input_ids"])
    if not labels:
        raise UserError("no held-out pair has distinct gold-judge scores; nothing to measure the reward model on")
    scores = score_sequences(reward_model, texts, tokenizer.pad_token_id, settings.batch_size)
    chosen, rejected = scores[0::2], scores[1::2]
    correct = sum((c > r) == label for c, r, label in zip(chosen, rejected, labels))
    return {
        "heldout_accuracy_vs_gold": correct / len(labels),
        "n_pairs": len(labels),
        "dataset_labels_agree_with_gold": agree / len(labels),
        "mean_chosen_score": statistics.fmean(chosen),
        "mean_rejected_score": statistics.fmean(rejected),
    }


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of two equal-length samples (``statistics.correlation``); ``None`` when it
    is undefined (fewer than two points, or either sample constant)."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} against {len(ys)} values")
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return None
