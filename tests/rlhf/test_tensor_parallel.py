"""Inference tensor parallelism (``--inference_tp_size``): the sharding maths by hand, and dschat's
Hybrid Engine over a simulated group of members (threads of this process meeting at a barrier, the
collectives of :class:`dschat.runtime.dist.TensorParallelGroup`) against the unsharded engine, on
every family's tiny random config. Real ranks (gloo, ZeRO-3, LoRA) are in test_tensor_parallel_ranks.py."""
from __future__ import annotations

import threading
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import transformers as T
from test_decoder_model import EOS, FAMILIES, PAD, _model, _prompts, tiny_config

from dschat.errors import UserError
from dschat.models.decoder.layouts import decoder_spec
from dschat.runtime import dist
from dschat.models.decoder.tensor_parallel import (
    ShardedDecodeModel,
    ShardedInferenceWeights,
    combine_greedy_stats,
    greedy_shard_stats,
    padded_vocab,
    shard_columns,
    shard_rows,
    split_blocks,
    tp_unsupported_reason,
    vocab_shard,
)
from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine
from dschat.rlhf.rollout.generator import rollout_summary_line
from dschat.rlhf.rollout.sampling import DecodingSettings
from dschat.rlhf.rollout.tensor_parallel import (
    TensorParallelHybridEngine,
    check_inference_tp,
    group_batch,
    own_answer_length,
)


# ------------------------------------------------------------------------------------ a simulated group
class _Meeting:
    """What the members of one simulated group share: a slot each and a barrier."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=60)


class ThreadGroup:
    """Member ``index`` of a group whose members are threads: each collective posts this member's
    tensor, waits for all, reads theirs, and waits again before the slots are reused."""

    def __init__(self, meeting: _Meeting, index: int) -> None:
        self.meeting, self.size, self.index = meeting, meeting.size, index
        self.ranks = tuple(range(meeting.size))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        m = self.meeting
        m.slots[self.index] = tensor.clone()
        m.barrier.wait()
        out = [t.clone() for t in m.slots]
        m.barrier.wait()
        return out

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        parts = self.all_gather(tensor)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        tensor.copy_(total)

    def broadcast_(self, tensor: torch.Tensor, src_index: int = 0) -> None:
        tensor.copy_(self.all_gather(tensor)[src_index])


def run_members(size: int, work) -> list:
    """``work(group)`` on ``size`` threads, one per member; their results in member order."""
    meeting, results, errors = _Meeting(size), [None] * size, []

    def member(i: int) -> None:
        try:
            results[i] = work(ThreadGroup(meeting, i))
        except BaseException as err:  # noqa: BLE001 -- re-raised in the test's thread
            errors.append(err)
            meeting.barrier.abort()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------------------ slicing, by hand
def test_column_row_and_fused_slices():
    w = torch.arange(24.).reshape(6, 4)  # 6 rows (outputs), 4 columns (inputs)
    assert shard_rows(w, 2, 1).tolist() == w[3:].tolist()
    assert shard_columns(w, 2, 0).tolist() == w[:, :2].tolist()
    q, k, v = torch.zeros(4, 3), torch.ones(2, 3), torch.full((2, 3), 2.)
    # One fused (q; k; v) tensor splits into the same blocks as three separate ones.
    assert [b.tolist() for b in split_blocks([torch.cat([q, k, v])], (4, 2, 2))] == [q.tolist(), k.tolist(), v.tolist()]
    with pytest.raises(ValueError):
        split_blocks([q, k], (4, 2, 2))


def test_vocabulary_is_padded_to_a_multiple_of_the_degree():
    emb = torch.arange(5.)[:, None].expand(5, 3)  # V = 5 rows
    assert padded_vocab(5, 2) == 6 and padded_vocab(6, 2) == 6
    assert vocab_shard(emb, 2, 0)[:, 0].tolist() == [0, 1, 2]
    assert vocab_shard(emb, 2, 1)[:, 0].tolist() == [3, 4, 0]  # row 5 is padding: zeros
    assert vocab_shard(emb, 4, 3)[:, 0].tolist() == [0, 0]  # rows 6, 7: all padding


def test_vocab_parallel_greedy_is_the_argmax_and_log_softmax_of_the_whole_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    logits[0, 2] = logits[0, 7] = 9.0  # a tie across shards: the lower id wins, as torch.argmax
    logits[1, 3] = logits[1, 4] = 9.0  # a tie inside one shard
    unfinished = torch.tensor([True, True, True, False])  # row 3 has ended: pad, its log-prob under the logits
    pad = 8
    shards = [logits[:, 5 * r:5 * (r + 1)] for r in range(2)]
    token, logprob = combine_greedy_stats([greedy_shard_stats(s, s, 5 * r, pad) for r, s in enumerate(shards)],
                                          unfinished, pad)
    expected = torch.where(unfinished, logits.argmax(-1), torch.tensor(pad))
    assert token.tolist() == expected.tolist() and token[:2].tolist() == [2, 3]
    torch.testing.assert_close(logprob, torch.log_softmax(logits, -1).gather(-1, expected[:, None]).squeeze(-1))
    # Scores and logits differ (EOS suppressed for min_new_tokens): the pick follows the scores, the
    # log-prob the raw logits.
    scores = logits.clone()
    scores[:, 2] = -float("inf")
    token, logprob = combine_greedy_stats(
        [greedy_shard_stats(scores[:, 5 * r:5 * (r + 1)], s, 5 * r, pad) for r, s in enumerate(shards)], unfinished, pad)
    assert token[0] == 7
    torch.testing.assert_close(logprob[0], torch.log_softmax(logits, -1)[0, 7])


def test_heads_and_mlp_width_must_divide_and_the_vocabulary_need_not():
    llama = tiny_config("llama")  # 4 heads, 2 KV heads, MLP 128, vocabulary 96
    assert tp_unsupported_reason(llama, 2) is None
    assert tp_unsupported_reason(llama, 4) is None  # 2 KV heads over 4: each member keeps the one it reads
    reason = tp_unsupported_reason(llama, 3)
    assert "4 attention heads, 128 MLP width, 2 key-value heads do not divide by 3" in reason and "use one of 1, 2, 4" in reason
    llama.vocab_size = 95
    assert tp_unsupported_reason(llama, 2) is None
    assert tp_unsupported_reason(tiny_config("gemma"), 2) is None  # 1 KV head: each member keeps a copy
    world = dict(config=tiny_config("opt"), world_size=2, enable_hybrid_engine=True)
    check_inference_tp(1, **{**world, "world_size": 3, "enable_hybrid_engine": False})  # TP 1: nothing to check
    check_inference_tp(2, **world)
    for size, changes, message in [
            (2, {"world_size": 3}, "does not divide the world size 3"),
            (2, {"enable_hybrid_engine": False}, "add --enable_hybrid_engine"),
            (2, {"config": SimpleNamespace(model_type="bloom")}, "does not cover this actor"),
            (3, {"config": tiny_config("phi3"), "world_size": 6},
             "4 attention heads, 128 MLP width, 2 key-value heads do not divide by 3 .* use one of 1, 2, 4")]:
        with pytest.raises(UserError, match=message):
            check_inference_tp(size, **{**world, **changes})


def test_own_answer_length_is_where_a_lone_rank_would_have_stopped():
    eos = 2
    assert own_answer_length(torch.tensor([[5, 2, 0, 0], [5, 6, 2, 0]]), eos) == 3
    assert own_answer_length(torch.tensor([[5, 6, 7, 8]]), eos) == 4  # never ended: every column
    assert own_answer_length(torch.zeros((1, 0), dtype=torch.long), eos) == 0


def test_group_batch_pads_to_a_common_width_and_row_count():
    a = (torch.tensor([[7, 8, 9], [0, 5, 6]]), torch.tensor([[1, 1, 1], [0, 1, 1]]))
    b = (torch.tensor([[4, 3]]), torch.tensor([[1, 1]]))
    batches = run_members(2, lambda g: group_batch(g, *(a if g.index == 0 else b), pad_token_id=0))
    assert all(torch.equal(x.prompts, batches[0].prompts) for x in batches)
    assert batches[0].prompts.tolist() == [[7, 8, 9], [0, 5, 6], [0, 4, 3], [0, 4, 3]]
    assert batches[1].mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert (batches[1].start, batches[1].own, batches[1].own_width, batches[1].width) == (2, 1, 2, 3)


# ------------------------------------------------------------------------------------ the engine, simulated group
def _member_prompts(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Member 0: rows 0-1 of the shared prompts (7 columns); member 1: row 2 cut to 5 columns."""
    ids, mask = _prompts()
    return (ids[:2], mask[:2]) if index == 0 else (ids[2:, 2:], mask[2:, 2:])


def _tp_rollouts(model, settings: DecodingSettings, size: int = 2, n: int = 12, seed: int = 0, **kwargs):
    def work(group):
        engine = TensorParallelHybridEngine(model.config, group, layers_per_gather=1, decoding=settings,
                                            max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD, **kwargs)
        if group.index == 0:
            torch.manual_seed(seed)
        out = engine.rollout(model, *_member_prompts(group.index), min_new_tokens=2)
        return engine, out

    return run_members(size, work)


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_greedy_tokens_and_log_probs_equal_tp1(name):
    model = _model(name)
    members = _tp_rollouts(model, DecodingSettings("greedy"), cpu_decode_linear="off")
    for index, (engine, out) in enumerate(members):
        alone = DschatHybridEngine(model.config, decoding=DecodingSettings("greedy"), max_new_tokens=12, eos_token_id=EOS,
                                   pad_token_id=PAD, cpu_decode_linear="off").rollout(model, *_member_prompts(index),
                                                                                        min_new_tokens=2)
        assert torch.equal(out.sequences, alone.sequences), (name, index)
        torch.testing.assert_close(out.logprobs, alone.logprobs, rtol=0, atol=2e-5)
        assert engine.model.spec.num_heads == 2 and engine.tp_size == 2
        assert engine.cache.keys[0].shape[1] == max(1, engine.model.full_spec.num_kv_heads // 2)


def test_tp4_replicates_key_value_heads_and_still_equals_tp1():
    model = _model("llama")  # 4 query heads, 2 KV heads: one query head and one KV head copy per member
    for index, (engine, out) in enumerate(_tp_rollouts(model, DecodingSettings("greedy"), size=4)):
        alone = DschatHybridEngine(model.config, decoding=DecodingSettings("greedy"), max_new_tokens=12, eos_token_id=EOS,
                                   pad_token_id=PAD).rollout(model, *_member_prompts(index), min_new_tokens=2)
        assert torch.equal(out.sequences, alone.sequences)
        torch.testing.assert_close(out.logprobs, alone.logprobs, rtol=0, atol=2e-5)
        assert (engine.model.spec.num_heads, engine.model.spec.num_kv_heads) == (1, 1)


def test_tp2_sampling_draws_member_0s_tokens_and_keeps_their_log_probs():
    """Sampling: member 0 draws from the gathered row as one engine decoding the group's batch would
    with the same seed; both members get the tokens."""
    model = _model("llama")
    settings = DecodingSettings("sample", temperature=0.7, top_k=20, top_p=0.9)
    members = _tp_rollouts(model, settings, seed=3)
    ids, mask = _prompts()
    widened = (torch.cat([ids[:2], ids[2:]]), torch.cat([mask[:2], mask[2:].masked_fill(torch.arange(7) < 2, 0)]))
    batch = (torch.cat([widened[0], widened[0][2:]]), torch.cat([widened[1], widened[1][2:]]))  # row 2 repeated
    torch.manual_seed(3)
    alone = DschatHybridEngine(model.config, decoding=settings, max_new_tokens=12, eos_token_id=EOS,
                               pad_token_id=PAD).rollout(model, batch[0].masked_fill(batch[1] == 0, PAD), batch[1],
                                                         min_new_tokens=2)
    (_, first), (_, second) = members
    A = first.sequences.shape[1] - 7
    assert torch.equal(first.sequences[:, 7:], alone.sequences[:2, 7:7 + A])
    torch.testing.assert_close(first.logprobs, alone.logprobs[:2, :A], rtol=0, atol=2e-5)
    assert torch.equal(second.sequences[:, 5:], alone.sequences[2:3, 7:7 + second.sequences.shape[1] - 5])


def test_non_finite_logits_stop_every_member_at_once():
    """Sampling with non-finite logits: every member raises the same error (the gathered scores are the
    same everywhere); none is left in member 0's broadcast until the collective times out."""
    model = _model("llama")
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    meeting, outcome = _Meeting(2), {}
    meeting.barrier = threading.Barrier(2, timeout=20)  # a real group is never aborted for the others

    def member(i: int) -> None:
        engine = TensorParallelHybridEngine(model.config, ThreadGroup(meeting, i), decoding=DecodingSettings("sample"),
                                            max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
        try:
            engine.rollout(model, *_member_prompts(i))
            outcome[i] = "returned"
        except BaseException as err:  # noqa: BLE001 -- what each member ended with
            outcome[i] = type(err).__name__

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcome == {0: "ValueError", 1: "ValueError"}


def test_an_odd_vocabulary_is_padded_and_never_sampled():
    config = tiny_config("llama")
    config.vocab_size = 95  # rows 95 (padding, logit -inf) on member 1
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    members = _tp_rollouts(model, DecodingSettings("sample"), seed=1)
    assert all(int(out.sequences.max()) < 95 for _, out in members)
    engine = members[1][0]
    assert (engine.model.weights.vocab, engine.model.weights.vocab_rows, engine.model.weights.vocab_start) == (95, 48, 48)
    greedy = _tp_rollouts(model, DecodingSettings("greedy"))
    for index, (_, out) in enumerate(greedy):
        alone = DschatHybridEngine(config, decoding=DecodingSettings("greedy"), max_new_tokens=12, eos_token_id=EOS,
                                   pad_token_id=PAD).rollout(model, *_member_prompts(index), min_new_tokens=2)
        assert torch.equal(out.sequences, alone.sequences)


def test_shards_hold_half_the_weights_are_refreshed_in_place_and_released():
    model = _model("llama")
    whole = DschatHybridEngine(model.config, decoding=DecodingSettings("greedy"), max_new_tokens=4, eos_token_id=EOS,
                               pad_token_id=PAD)
    whole.refresh(model)

    def work(group):
        engine = TensorParallelHybridEngine(model.config, group, decoding=DecodingSettings("greedy"), max_new_tokens=4,
                                            eos_token_id=EOS, pad_token_id=PAD)
        engine.rollout(model, *_member_prompts(group.index))
        first = [t.data_ptr() for t in engine.model.weights.tensors()]
        engine.rollout(model, *_member_prompts(group.index))
        same = first == [t.data_ptr() for t in engine.model.weights.tensors()]
        nbytes = engine.model.weights.nbytes()
        engine.release_cache = True
        engine.rollout(model, *_member_prompts(group.index))
        return same, nbytes, engine.model.weights.allocated, engine.cache, engine.weight_allocations

    norms = sum(t.numel() * 4 for lw in whole.model.weights.layers for t in (lw.attn_norm_w, lw.mlp_norm_w))
    norms += whole.model.weights.final_norm_w.numel() * 4
    for same, nbytes, allocated, cache, allocations in run_members(2, work):
        assert same and allocations == 1  # refreshed in place, never allocated again
        assert nbytes == (whole.model.weights.nbytes() - norms) // 2 + norms  # norms whole, the rest halved
        assert not allocated and cache is None


def test_summary_line_names_the_tp_degree():
    model = _model("llama")
    members = _tp_rollouts(model, DecodingSettings("greedy"))
    line = rollout_summary_line("dschat-he", members[0][0], model)
    assert line.endswith("inference TP degree 2") and "tensor-parallel over ranks 0-1" in line
    assert "layout llama (fused qkv, gate_up; GQA 4/2)" in line
    assert rollout_summary_line("dschat", None, model).endswith("inference TP degree 1")


def test_a_sharded_model_refuses_heads_that_do_not_split():
    with pytest.raises(ValueError, match="do not divide by 3"):
        ShardedDecodeModel(tiny_config("llama"), ThreadGroup(_Meeting(3), 0))


def test_groups_are_contiguous_ranks_on_one_host(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist.torch.distributed, "new_group", lambda ranks, **kwargs: made.append(ranks) or f"pg{ranks}")
    monkeypatch.setattr(dist, "gather_hosts", lambda: ["a", "a", "b", "b"])
    group = dist.tensor_parallel_group(2)
    assert made == [[0, 1], [2, 3]]  # every rank makes every group, in the same order
    assert (group.size, group.index, group.ranks, group.group) == (2, 1, (2, 3), "pg[2, 3]")
    monkeypatch.setattr(dist, "gather_hosts", lambda: ["a", "b", "b", "b"])
    with pytest.raises(UserError, match=r"ranks 0-1 span hosts \['a', 'b'\].*a multiple of 2 ranks"):
        dist.tensor_parallel_group(2)
    with pytest.raises(UserError, match="does not divide the world size 4"):
        dist.tensor_parallel_group(3)


def test_tp_gather_partition_size_sets_the_layers_gathered_at_a_time():
    """--tp_gather_partition_size: the refresh asks for the top weights, then that many layers at once."""
    config = tiny_config("opt")
    config.num_hidden_layers = 5
    model = T.AutoModelForCausalLM.from_config(config)
    asked: list[int] = []

    def gather(modules):
        asked.append(len(modules))
        return nullcontext()

    weights = ShardedInferenceWeights(decoder_spec(config), 2, 0)
    weights.refresh(model, torch.float32, torch.device("cpu"), gather, layers_per_gather=2)
    assert asked[1:] == [2, 2, 1] and len(weights.layers) == 5  # after the embeddings, norms and head
