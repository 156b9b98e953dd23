"""Did step 3 work? Held-out evaluation during training, the over-optimization alarm, the best checkpoint.

With ``--eval_interval N`` (0 turns it off, upstream's default; left out, it is ``auto`` when a judge,
``--save_best_by`` or ``--stop_on_overoptimization`` asks for the evaluation, else 0) the actor answers the same
``--eval_prompts K`` held-out prompts -- the first K distinct prompts of the phase-3 *eval* split of
the prompt data, which step 3 never trains on -- once before the first PPO step and after every N
PPO steps. Decoding is the rollout's (``--decoding``, ``--temperature``, ...) drawn from a fixed seed
inside a forked random state, so every evaluation sees the same random numbers (paired comparisons
between evaluations) and training sees exactly the random numbers it would without evaluation.
The prompts are cut into generation batches dealt round robin to the ranks, each batch seeded by its
number (:func:`eval_batches`), and the scores are gathered on every rank: one rank and several answer
alike (with sampled decoding, unless an inference TP group decodes: see :func:`eval_batches`), and
every rank takes the same best-checkpoint and alarm decisions (rank 0 writes).
``--eval_interval auto`` schedules each next evaluation from the costs measured so far, so that
evaluation takes at most 10 % of the step-3 wall time (:mod:`dschat.rlhf.heldout.cost`).

Each evaluation scores the answers by

* the **proxy**: what the run optimises -- the reward model and the ``--reward_fn`` functions, by
  their weights (:class:`~dschat.rewards.RewardMix`);
* the **judges** (``--eval_judge``, repeatable, never trained on): ``gold`` (the embedded data's gold
  judge; refused on other data), a ``module:function`` reward function (loaded by
  :func:`dschat.rewards.load_reward_function`) or a step-2 reward-model folder;
* KL to the reference (mean over answer tokens of ``log pi - log pi_ref``, the k1 estimate), mean
  answer length (tokens, EOS included), EOS rate and the actor's token entropy (mean over answer
  tokens of the entropy of the sampling distribution ``softmax(logits / temperature)``).

**Over-optimization alarm** (:func:`overoptimization_alarm`, a pure function of the evaluation series):
between the newest evaluation and the one ``window`` evaluations earlier, the proxy's mean rose
while a judge's mean fell by more than ``sigmas`` paired standard errors (the standard error of the
per-prompt differences over the same K prompts: the judge's own evaluation noise). It prints one
line; ``--stop_on_overoptimization`` ends the run there, cleanly.

**Best checkpoint** (``--save_best_by judge|proxy|none``): whenever an evaluation beats every earlier
one (by the first judge, or the proxy), the actor -- and the critic and the EMA actor where the run
has them -- are saved to ``<output_dir>/best/`` with ``best.json`` (step and scores), atomically as a
whole (:func:`dschat.runtime.fs.atomic_dir`; each model by :func:`dschat.models.save.save_hf_model`).

One JSON record per evaluation (``"kind": "eval"``) goes to ``metrics.jsonl``; the history, the best
evaluation and the alarm travel in step 3's checkpoints, so a resumed run continues them.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Sequence

import numpy as np
import torch
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from dschat.cli.step3 import EVAL_INTERVAL_AUTO
from dschat.data.collators import SOURCES_KEY, DataCollatorRLHF, drop_padding_columns
from dschat.data.prompt_columns import PromptColumns, load_prompt_columns
from dschat.data.token_dataset import PromptItem
from dschat.errors import UserError
from dschat.eval.metrics_file import EVAL_KIND
from dschat.eval.scoring import Samples, load_reward, reward_scores
from dschat.paths import BEST_DIR, BEST_FILE, METRICS_FILE
from dschat.rlhf.experience import raise_together
from dschat.rlhf.config import EvalConfig, eval_config
from dschat.rlhf.heldout.best import other_series_line, read_best, same_series, save_best, set_earlier_best_aside
from dschat.rlhf.heldout.cost import MAX_EVAL_SHARE, auto_interval, eval_share, planned_ppo_steps
from dschat.rlhf.heldout.alarm import Alarm, EvalPoint, not_finite_line, overoptimization_alarm
from dschat.rlhf.heldout.setup import Judge, check_same_prompts, prompts_digest
from dschat.runtime.dist import all_reduce_sum, gather_json, print_rank_0
from dschat.runtime.fs import open_own, recover_dir
from dschat.runtime.devices import to_device
from dschat.training.checkpoint import TrainingPosition
from dschat.training.progress import TensorBoardLogger

if TYPE_CHECKING:  # the trainer's module does not import this one; kept out of the import graph all the same
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer

__all__ = [
    "BEST_DIR",
    "BEST_FILE",
    "EVAL_KIND",
    "StepThreeEvaluation",
    "eval_batches",
    "token_entropy",
]

#: ``<output_dir>/best``: the best evaluation's models; ``best.json`` inside says which step and why.
#: The ``kind`` of an evaluation record in ``metrics.jsonl`` (training records have none).
#: Added to --seed for the evaluation's decoding: a stream of its own, the same at every evaluation.
EVAL_SEED_OFFSET = 104729


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` per position, computed in fp32. Shape: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ================================================================================================
# The evaluation during training
# ================================================================================================
def eval_batches(n: int, batch_size: int, rank: int, world_size: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """This rank's generation batches of one evaluation of ``n`` prompts: ``(batch number, rows)``,
    each row ``(index, position)``: the prompt at ``position`` of the K, counted as ``index`` or not
    counted when ``index`` is -1 (a repeat that fills a batch).

    The K prompts are cut into ``ceil(K / batch_size)`` batches of ``batch_size``, the last one topped
    up with repeats of the first prompts, and dealt round robin: batch ``b`` goes to rank
    ``b % world_size``. Each batch, and the seed it is decoded with (its number), is the same for any
    number of ranks, so one rank and several give the same answers -- except with sampled decoding
    over an inference TP group (``--inference_tp_size`` > 1), where the group's first member draws
    every row of the group's batches from its own random stream: those answers depend on the TP
    degree (evaluations of one run still share their random numbers, so they stay paired). Every rank gets the same number
    of batches (a rank short of one repeats batch 0, not counted): generation and the forward
    passes are collective under ZeRO-3.
    """
    count = -(-n // batch_size)
    per_rank = -(-count // world_size)
    out = []
    for k in range(per_rank):
        number = rank + k * world_size
        first = number * batch_size if number < count else 0
        rows = [(i if number < count and i < n else -1, i % n) for i in range(first, first + batch_size)]
        out.append((number, rows))
    return out


@dataclass
class _Rows:
    """Per-prompt results of one evaluation on this rank (index = position among the K prompts)."""

    index: list[int] = field(default_factory=list)
    proxy: list[float] = field(default_factory=list)
    judges: dict[str, list[float]] = field(default_factory=dict)
    kl: list[float] = field(default_factory=list)  # summed over the answer's tokens
    entropy: list[float] = field(default_factory=list)  # summed over the answer's tokens
    tokens: list[int] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)


class StepThreeEvaluation:
    """What step 3's ``main`` calls: :meth:`maybe_evaluate` after every PPO step (and before the
    first), :meth:`attach` on each checkpoint position, :meth:`restore` on resume, :meth:`finish`.

    Disabled (every method a no-op) when ``--eval_interval`` is 0.
    """

    def __init__(self, config: EvalConfig | argparse.Namespace, trainer: DeepSpeedPPOTrainer | None = None,
                 prompt_items: Sequence[PromptItem] = (), judges: Sequence[Judge] = (), *,
                 tb: TensorBoardLogger | None = None, rank: int = 0, world_size: int = 1) -> None:
        # ``config``: step 3's evaluation part, or the flags it is built from (an upstream-style Namespace).
        self.config = config if isinstance(config, EvalConfig) else eval_config(config)
        config = self.config
        self.enabled = bool(config.eval_interval) and trainer is not None
        self.auto = config.eval_interval == EVAL_INTERVAL_AUTO
        self.interval = 0 if self.auto else int(config.eval_interval)  # auto: the last one chosen
        self.next_step: int | None = None  # auto: the next evaluation's step, once chosen
        # auto: PPO-step time measured between the calls of maybe_evaluate (evaluations excluded).
        self._mark: tuple[float, int] | None = None
        self._step_seconds, self._steps_timed, self._warmed_up = 0.0, 0, False
        self.trainer = trainer
        self.items = list(prompt_items)
        self.prompts_digest = prompts_digest(self.items)  # a resume must evaluate the same prompts
        self.judges = list(judges)
        self.tb = tb
        self.rank, self.world_size = rank, world_size
        self.window, self.sigmas = 2, config.eval_alarm_sigmas
        self.save_best_by = config.save_best_by
        self.output_dir = Path(config.output_dir) if config.output_dir else None
        self.history: list[EvalPoint] = []
        self.best: dict[str, object] | None = None  # {"step", "by", "score"}
        self.run_id: str | None = None  # set by restore: a fresh run's, or the checkpoint's; in best.json
        self.alarms: list[dict[str, object]] = []
        self.records: list[dict[str, object]] = []  # the evaluations made by this process
        self.logged: list | None = None  # [step, tracker scalars] of the last evaluation (a resume logs it again)
        self.should_stop = False
        self.eval_seconds = 0.0
        self.save_seconds = 0.0
        self.started = time.time()
        self._columns: PromptColumns | None = None
        self._judge_models: dict[str, tuple[torch.nn.Module, PreTrainedTokenizerBase]] = {}
        if not self.enabled:
            return
        self._columns = trainer.prompt_columns
        if self._columns is None and any(j.fn is not None for j in self.judges):
            self._columns = load_prompt_columns(config.data_path, config.data_split, config.seed,
                                                config.data_output_path, config.local_rank, trainer.tokenizer)
        with self._forked_random():  # building a value head draws random numbers: training must not see it
            self._judge_models = {j.name: load_reward(j.folder, trainer.device) for j in self.judges if j.folder}
        if self.save_best_by != "none" and self.output_dir is not None and rank == 0:
            for notice in recover_dir(self.output_dir / BEST_DIR):
                print(f"[eval] {notice}", flush=True)
        every = ("every N PPO steps (--eval_interval auto: N chosen from the measured costs)" if self.auto
                 else f"every {self.interval} PPO steps")
        print_rank_0(f"[eval] held-out evaluation {every} and before the first: "
                     f"{len(self.items)} prompts, judges: {', '.join(j.name for j in self.judges) or 'none'}; "
                     f"best checkpoint by {self._best_series() or 'none'}", rank)

    # ------------------------------------------------------------------ state (checkpoints)
    def state(self) -> dict[str, object]:
        """JSON state for a checkpoint: the series, the best evaluation, the alarms, the timings."""
        return {"history": [{"step": p.step, "proxy": list(p.proxy), "judges": {k: list(v) for k, v in p.judges.items()}}
                            for p in self.history],
                "best": self.best, "alarms": self.alarms, "next_step": self.next_step, "run": self.run_id, "logged": self.logged,
                "prompts": self.prompts_digest, "seconds": [self.eval_seconds, self.save_seconds, time.time() - self.started]}

    def attach(self, position: TrainingPosition) -> TrainingPosition:
        """``position`` (a :class:`~dschat.training.checkpoint.TrainingPosition`) carrying this state."""
        if self.enabled:
            position.extra["evaluation"] = self.state()
        return position

    def restore(self, position: TrainingPosition | None, at_step: int | None = None) -> None:
        """Continue the series, best evaluation and alarms of the checkpoint a run resumes from
        (``position``; None: nothing to resume), and its run id (a fresh run draws one; ``best.json``
        records it). Its evaluation at ``at_step`` (the resumed run's first step) is logged to the
        trackers again: TensorBoard's purge at that step hides the earlier attempt's. Best models
        already in ``best/`` that score higher (by the same series and run) stay the best so far:
        after a roll back to an earlier checkpoint, or a kill between their save and the next
        checkpoint, only a better evaluation replaces them. A run with no evaluation to continue, or
        whose ``best/`` another run saved, sets that ``best/`` aside first (rank 0). Collective."""
        if not self.enabled:
            return
        state = position.extra.get("evaluation") if position is not None else None
        if state:
            self._restore_state(state)
            if self.tb is not None and self.logged is not None and self.logged[0] == at_step:
                self.tb.scalars(at_step, **self.logged[1])
        best_dir = self.output_dir / BEST_DIR if self.output_dir is not None else None
        # rank 0's fresh id and reading of best/: every rank takes them
        drawn, on_disk, present = gather_json(
            [secrets.token_hex(8), *([read_best(best_dir), best_dir.exists()] if best_dir is not None else [None, False])]
            if self.rank == 0 else None)[0]
        ours = state.get("run") if state else None
        # A checkpoint of a dschat that kept no run id: best/ counts as its run's, as it did then.
        self.run_id = ours or (on_disk["run"] if state and on_disk is not None else None) or drawn
        if self._best_series() is None or best_dir is None:
            if self._best_series() is None:  # --save_best_by none now: a checkpoint's best is no one's
                self.best = None
            return
        other_run = ours is not None and on_disk is not None and on_disk["run"] not in (None, ours)
        if not state or other_run:
            # rank 0 renames; a failure stops every rank together
            notice = raise_together(lambda: set_earlier_best_aside(self.output_dir) if self.rank == 0 else None,
                                    "setting best/ aside")
            if notice:
                print_rank_0(f"[eval] {notice}", self.rank)
            self._forget_best_without_models()
            return
        if not present:  # the checkpoint's best models are gone
            self._forget_best_without_models()
            return
        kept = on_disk["by"] if on_disk is not None else (self.best or {}).get("by")
        if kept is not None and not same_series(str(kept), str(self._best_series())):
            raise UserError(other_series_line(best_dir, str(kept), self._best_series(), self.save_best_by))
        if on_disk is None or not _finite(on_disk["score"]):
            return  # an unreadable best.json: no bar
        saved = {key: on_disk[key] for key in ("step", "by", "score")}
        if self.best is None or not _finite(self.best["score"]) or saved["score"] > self.best["score"]:
            self.best = saved
            print_rank_0(f"[eval] the best models in {best_dir} (step {saved['step']}, "
                         f"{saved['by']} {saved['score']:.4f}) stay the best so far: only a higher score replaces "
                         "them", self.rank)

    def _forget_best_without_models(self) -> None:
        """The checkpoint's best evaluation has no models in ``best/``: the next finite evaluation saves them."""
        if self.best is not None:
            print_rank_0(f"[eval] the best models of step {self.best['step']} are not in {self.output_dir / BEST_DIR}: "
                         "the next evaluation saves its models there", self.rank)
            self.best = None

    def _restore_state(self, state: dict[str, Any]) -> None:
        check_same_prompts(state, self.prompts_digest, len(self.items))
        self.history = [EvalPoint(p["step"], tuple(p["proxy"]), {k: tuple(v) for k, v in p["judges"].items()})
                        for p in state["history"]]
        self.best, self.alarms = state["best"], list(state["alarms"])
        self.should_stop = bool(self.alarms) and self.config.stop_on_overoptimization
        self.eval_seconds, self.save_seconds, wall = state["seconds"]
        self.next_step = state.get("next_step")  # auto: the evaluation the interrupted run scheduled
        self.logged = state.get("logged")  # None in a checkpoint of a dschat that kept none
        self.started = time.time() - wall

    # ------------------------------------------------------------------ the evaluation
    def maybe_evaluate(self, global_step: int, epoch: int = 0, at_end: bool = False) -> dict[str, object] | None:
        """Evaluate when ``global_step`` (PPO steps trained) is 0 or a multiple of ``--eval_interval`` (``auto``:
        the first call, then the step :meth:`_schedule` chose, and the planned last step or the run's end,
        ``at_end``) and was not evaluated yet (a resumed run). Collective. Returns the record, else None."""
        if not self.enabled:
            return None
        if self.auto:
            self._time_steps(global_step)
            if self.history and self.next_step is None:
                self.next_step = self._schedule(global_step)
            at_end = at_end or global_step == planned_ppo_steps(self.config, self.trainer)  # evaluated, timed or not
            if self.history and (self.next_step is None or global_step < self.next_step) and not at_end:
                return None
        elif global_step % self.interval != 0:
            return None
        if self.history and self.history[-1].step >= global_step:
            return None
        start = time.time()
        rows = self._gathered(self._evaluate_shard())
        point = EvalPoint(global_step, tuple(rows.proxy), {k: tuple(v) for k, v in rows.judges.items()})
        self.history.append(point)
        seconds = time.time() - start
        self.eval_seconds += seconds
        best_now = self._update_best(point, rows)
        alarm = overoptimization_alarm(self.history, window=self.window, sigmas=self.sigmas,
                                       best_step=None if self.best is None else self.best["step"])
        record = self._record(point, rows, epoch, seconds, alarm, best_now)
        self._log(record, alarm)
        self.records.append(record)
        if alarm is not None:
            self.alarms.append(asdict(alarm))
            if self.config.stop_on_overoptimization:
                self.should_stop = True
                print_rank_0(f"[eval] --stop_on_overoptimization: ending the run at step {global_step} (the best "
                             f"checkpoint is in {self._best_where()})", self.rank)
        self.next_step, self._mark = None, (time.time(), global_step)  # auto: scheduled after the next step
        return record

    def _time_steps(self, global_step: int) -> None:
        """``--eval_interval auto``: time the PPO steps since the last call, but a process's first (warm-up)."""
        now = time.time()
        if self._mark is not None and global_step > self._mark[1]:
            if self._warmed_up:
                self._step_seconds += now - self._mark[0]
                self._steps_timed += global_step - self._mark[1]
            self._warmed_up = True
        self._mark = (now, global_step)

    def _schedule(self, global_step: int) -> int | None:
        """``--eval_interval auto``: the next evaluation's step, from the mean costs measured so far
        (None until a PPO step is timed); rank 0's choice, so that every rank agrees."""
        if not self._steps_timed:
            return None
        last = self.history[-1].step
        spent = self.eval_seconds + self.save_seconds
        eval_seconds, step_seconds = spent / len(self.history), self._step_seconds / self._steps_timed
        planned = planned_ppo_steps(self.config, self.trainer)
        chosen = auto_interval(eval_seconds, step_seconds, planned, since=last, spent=spent) if self.rank == 0 else 0
        interval = int(all_reduce_sum(torch.tensor([chosen], dtype=torch.float64))[0])
        if interval != self.interval:
            self.interval = interval
            share = eval_share(eval_seconds, step_seconds, planned or last + interval, interval, since=last,
                               spent=spent)
            over = f"; above {MAX_EVAL_SHARE:.0%} even so: lower --eval_prompts" if share > MAX_EVAL_SHARE else ""
            print_rank_0(f"[eval] --eval_interval auto: an evaluation takes {eval_seconds:.1f} s and a PPO step "
                         f"{step_seconds:.1f} s (means so far): evaluating every {interval} PPO steps from step "
                         f"{last}, about {share:.1%} of the wall time of {planned or 'the'} planned PPO steps{over}",
                         self.rank)
        return last + interval

    def _forked_random(self) -> ContextManager[None]:
        """Torch (CPU and the current CUDA device) random states forked for the evaluation."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return torch.random.fork_rng(devices=devices)

    def _evaluate_shard(self) -> _Rows:
        trainer, config = self.trainer, self.config
        actor_was_training = trainer.actor_model.module.training
        py_state, np_state = random.getstate(), np.random.get_state()
        collator = DataCollatorRLHF(config.max_prompt_seq_len, config.inference_tp_size)
        rows = _Rows(judges={j.name: [] for j in self.judges})
        batches = eval_batches(len(self.items), config.per_device_generation_batch_size, self.rank, self.world_size)
        try:
            with self._forked_random():
                trainer.eval()
                for number, chunk in batches:
                    # Seeded by the batch's number: its random numbers do not depend on the rank count.
                    torch.manual_seed(int(config.seed) + EVAL_SEED_OFFSET + number)
                    batch = to_device(collator([self.items[at] for _, at in chunk]), trainer.device)
                    batch = drop_padding_columns(batch, "prompt_att_mask", side="left")
                    self._score_batch(batch["prompt"], batch["prompt_att_mask"], [i for i, _ in chunk], rows,
                                      batch.get(SOURCES_KEY))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            if actor_was_training:
                trainer.train()
        return rows

    @torch.no_grad()
    def _score_batch(self, prompts: torch.Tensor, mask: torch.Tensor, index: list[int], rows: _Rows,
                     sources: torch.Tensor | None = None) -> None:
        """Generate, then score one batch of prompts. Shapes: prompts, mask (B, P) left-padded;
        ``sources`` (B, 3): their dataset rows (:mod:`dschat.data.prompt_columns`), or None."""
        trainer = self.trainer
        # answers, or --env's episodes
        generated = trainer.experience.generate_answers(prompts, mask, 0, show=False, sources=sources)
        seq = generated.seq  # (B, L)
        trainer.generator.scoring_mode()
        att, pos = generated.masks.attention_mask, generated.masks.position_ids
        P = prompts.shape[1]
        logits = trainer.actor_model(seq, attention_mask=att, position_ids=pos, use_cache=False).logits
        logprobs = trainer._log_probs(logits, seq)[:, P - 1:].float()  # (B, A')
        temperature = trainer.logit_temperature
        scaled = logits[:, P - 1:-1] / temperature if temperature != 1.0 else logits[:, P - 1:-1]
        entropy = token_entropy(scaled)  # (B, A')
        del logits, scaled
        ref_logits = trainer.ref_model(seq, attention_mask=att, position_ids=pos, use_cache=False).logits
        ref_logprobs = trainer._log_probs(ref_logits, seq)[:, P - 1:].float()
        del ref_logits
        proxy = trainer._reward_scores(prompts, mask, seq, att, pos, sources=sources).float()
        answer_mask = att[:, P:].float()  # (B, A'): the actor's tokens (an episode's observations left out)
        if generated.env_reward is not None:  # an episode's return: its turn rewards too
            proxy = proxy + generated.env_reward.to(proxy.device)
            answer_mask = answer_mask * (1 - generated.observation_mask[:, P - 1:].float())
        texts = trainer._decode_for_hook(prompts, mask, seq, att)
        judged = self._judge(prompts, mask, seq, att, texts, sources)
        ended = generated.ended
        keep = [k for k, i in enumerate(index) if i >= 0]
        kl = ((logprobs - ref_logprobs) * answer_mask).sum(-1)
        ent = (entropy * answer_mask).sum(-1)
        for k in keep:
            rows.index.append(index[k])
            rows.proxy.append(float(proxy[k]))
            rows.kl.append(float(kl[k]))
            rows.entropy.append(float(ent[k]))
            rows.tokens.append(int(answer_mask[k].sum()))
            rows.ended.append(bool(ended[k]))
            for name, scores in judged.items():
                rows.judges[name].append(float(scores[k]))

    def _judge(self, prompts: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, att: torch.Tensor,
               texts: tuple[list[str], list[str]], sources: torch.Tensor | None = None) -> dict[str, list[float]]:
        """Every judge's score per answer. A judge's failure on any rank stops every rank with its line."""
        def judged() -> dict[str, list[float]]:
            out: dict[str, list[float]] = {}
            columns = None
            if self._columns is not None and any(j.fn is not None for j in self.judges):
                columns = self._columns.for_batch(prompts, mask, texts[0], sources)
            for judge in self.judges:
                if judge.fn is not None:
                    out[judge.name] = judge.fn(texts[0], texts[1], columns)
                else:
                    out[judge.name] = self._reward_model_scores(judge.name, prompts, mask, seq, att, texts)
            return out

        return raise_together(judged, "a judge", prefix="--eval_judge: ")

    def _reward_model_scores(self, name: str, prompts: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor,
                             att: torch.Tensor, texts: tuple[list[str], list[str]]) -> list[float]:
        """A reward-model judge's end scores, on the generated ids when its vocabulary is the actor's,
        else on the re-tokenised text (:func:`dschat.eval.scoring.reward_scores`)."""
        model, tokenizer = self._judge_models[name]
        P = prompts.shape[1]
        ends = self.trainer.generator.end_ids
        samples = Samples([], [], [], [], [])
        for i in range(seq.shape[0]):
            answer = seq[i, P:][att[i, P:].bool()].tolist()
            samples.prompts.append(texts[0][i])
            samples.prompt_ids.append(prompts[i][mask[i].bool()].tolist())
            samples.response_ids.append(answer)
            samples.texts.append(texts[1][i])
            samples.ended.append(bool(answer) and answer[-1] in ends)
        return reward_scores(model, tokenizer, samples, self.trainer.tokenizer, len(samples.prompts))

    def _gathered(self, rows: _Rows) -> _Rows:
        """Every rank's rows, ordered by prompt index (the same on every rank); collective (gather_json)."""
        parts = [rows]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            parts = [_Rows(**p) for p in gather_json(asdict(rows))]  # type: ignore[arg-type] -- JSON, no pickles
        order = sorted((i, p, k) for p in range(len(parts)) for k, i in enumerate(parts[p].index))
        out = _Rows(judges={j.name: [] for j in self.judges})
        for i, p, k in order:
            part = parts[p]
            out.index.append(i)
            out.proxy.append(part.proxy[k])
            out.kl.append(part.kl[k])
            out.entropy.append(part.entropy[k])
            out.tokens.append(part.tokens[k])
            out.ended.append(part.ended[k])
            for name in out.judges:
                out.judges[name].append(part.judges[name][k])
        return out

    # ------------------------------------------------------------------ best checkpoint
    def _best_series(self) -> str | None:
        if self.save_best_by == "judge":
            return self.judges[0].name
        return "proxy" if self.save_best_by == "proxy" else None

    def _best_where(self) -> str:
        if self.best is None or self.output_dir is None:
            return "nowhere (--save_best_by none)"
        return f"{self.output_dir / BEST_DIR} (step {self.best['step']})"

    def _update_best(self, point: EvalPoint, rows: _Rows) -> bool:
        """Save ``best/`` when ``point`` beats every earlier evaluation. A non-finite mean never does, and a
        best score that is not finite (a checkpoint's) is beaten by any finite one."""
        series = self._best_series()
        if series is None or not point.finite(series):
            return False
        score = point.mean(series)
        if self.best is not None and _finite(self.best["score"]) and not score > self.best["score"]:
            return False
        self.best = {"step": point.step, "by": series, "score": score}
        start = time.time()
        info = {"step": point.step, "by": series, "score": score, "run": self.run_id, "proxy": point.mean("proxy"),
                "judges": {name: point.mean(name) for name in point.judges},
                "kl_to_ref": _ratio(sum(rows.kl), sum(rows.tokens))}
        save_best(self.output_dir, self._best_models(), self.trainer.tokenizer, info, self.rank,
                  save_format=self.config.save_format)
        self.save_seconds += time.time() - start
        return True

    def _best_models(self) -> dict[str, DeepSpeedEngine]:
        engine = self.trainer.rlhf_engine
        models = {"actor": engine.actor, "critic": engine.critic, "actor_ema": engine.actor_ema}
        return {k: v for k, v in models.items() if v is not None}

    # ------------------------------------------------------------------ records and lines
    def _record(self, point: EvalPoint, rows: _Rows, epoch: int, seconds: float, alarm: Alarm | None,
                best_now: bool) -> dict[str, object]:
        n = len(rows.proxy)
        tokens = sum(rows.tokens)
        wall = time.time() - self.started
        record: dict[str, object] = {
            "kind": EVAL_KIND, "global_step": point.step, "epoch": epoch, "prompts": n,
            "proxy": point.mean("proxy"), "proxy_se": _se(rows.proxy),
            "judges": {name: point.mean(name) for name in point.judges},
            "judges_se": {name: _se(values) for name, values in rows.judges.items()},
            "kl_to_ref": _ratio(sum(rows.kl), tokens), "response_length": tokens / n if n else math.nan,
            "eos_rate": sum(rows.ended) / n if n else math.nan, "entropy": _ratio(sum(rows.entropy), tokens),
            "best_step": None if self.best is None else self.best["step"], "new_best": best_now,
            "alarm": None if alarm is None else asdict(alarm),
            "seconds": seconds, "eval_share": (self.eval_seconds + self.save_seconds) / wall if wall > 0 else 0.0,
            "per_prompt": {"proxy": list(rows.proxy), **{k: list(v) for k, v in rows.judges.items()}},
        }
        return record

    def _log(self, record: dict[str, object], alarm: Alarm | None) -> None:
        judges = " | ".join(f"{name} {value:.4f} (SE {record['judges_se'][name]:.4f})"
                            for name, value in record["judges"].items())
        best = f" | new best ({self._best_series()})" if record["new_best"] else ""
        print_rank_0(f"[eval] step {record['global_step']}: proxy {record['proxy']:.4f} (SE {record['proxy_se']:.4f})"
                     + (f" | {judges}" if judges else "")
                     + f" | KL {record['kl_to_ref']:.4f} | length {record['response_length']:.1f} | EOS "
                       f"{record['eos_rate']:.0%} | entropy {record['entropy']:.3f} | {record['seconds']:.1f} s, "
                       f"evaluation {record['eval_share']:.1%} of the wall time so far{best}", self.rank)
        if alarm is not None:
            print_rank_0(alarm.line(self._best_where() if self.best is not None else None), self.rank)
        line = not_finite_line(record["global_step"], {"proxy": record["proxy"], **record["judges"]},
                               self._best_series())
        if line is not None:
            print_rank_0(line, self.rank)
        scalars = {f"eval/{k}": record[k] for k in ("proxy", "kl_to_ref", "response_length", "eos_rate", "entropy")}
        scalars.update({f"eval/judge/{name}": value for name, value in record["judges"].items()})
        self.logged = [record["global_step"], scalars]
        if self.tb is not None:
            self.tb.scalars(record["global_step"], **scalars)
        if self.output_dir is not None and self.rank == 0:
            path = self.output_dir / METRICS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            # The evaluation before a fresh run's first step is the run's first line: it starts the file
            # (a resumed run evaluates after its checkpoint's iterations, global step 1 or more).
            with open_own(path, "w" if record["global_step"] == 0 else "a", encoding="utf-8") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")

    def finish(self) -> str | None:
        """The closing line: evaluation's measured share of the step-3 wall time (and the alarm)."""
        if not self.enabled:
            return None
        wall = time.time() - self.started
        share = (self.eval_seconds + self.save_seconds) / wall if wall > 0 else 0.0
        line = (f"[eval] {len(self.history)} evaluations took {self.eval_seconds:.1f} s and best-checkpoint saves "
                f"{self.save_seconds:.1f} s of {wall:.1f} s of step-3 wall time ({share:.1%})")
        if share > MAX_EVAL_SHARE:
            fix = ("lower --eval_prompts or run more steps" if self.auto
                   else "raise --eval_interval (or give auto) or lower --eval_prompts")
            line += f"; above {MAX_EVAL_SHARE:.0%}: {fix}"
        if self.alarms:
            first = self.alarms[0]
            line += f"; over-optimization alarm first at step {first['step']} (judge {first['judge']})"
        if self.best is not None:
            line += f"; best evaluation: step {self.best['step']} by {self.best['by']} ({self.best['score']:.4f})"
        print_rank_0(line, self.rank)
        return line


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _se(values: Sequence[float]) -> float:
    """Standard error of the mean; NaN for fewer than two values or a non-finite one (``statistics.stdev``
    raises on inf)."""
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return math.nan
    return statistics.stdev(values) / math.sqrt(len(values))


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan
