"""Multi-turn episodes continue the conversation's KV cache on the dschat loop, dschat's Hybrid Engine
and the graphs path: with greedy decoding they are the episodes that prefilling every turn again plays, token for
token, with the same kept log-probs; each turn after the first feeds the model only the rows' new
tokens (a turn the shared budget stopped goes on from its last sampled token); a path that cannot
continue a cache prefills again and says why once.

The models are real tiny checkpoints (tiny-llama: rotary positions; tiny-opt: learned absolute
positions); a hook makes their turns end (a random tiny model rarely says EOS by itself): the next
token is EOS when the position it follows is 4 mod 5 or the argmax plus that position is 0 mod 3.
On the dschat loop it is a forward hook of the module; on dschat's Hybrid Engine, which decodes with
its own decode model, the same rule wraps that model's prefill and decode step.
"""
from __future__ import annotations

import pytest
import torch

from dschat.envs import load_environment
from dschat.models.decoder.kv_cache import StaticKVCache
from dschat.models.registry import resolve_model_path
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rlhf.episodes import EpisodePlayer
from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision
from dschat.rlhf.rollout.dschat_engine import DschatHybridEngine
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.sampling import DecodingSettings

from helpers.decode_hooks import edit_decode_logits

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_ANSWER = 60
KV_REUSE = "Multi-turn episodes"  # how the generator's notice on KV cache reuse begins
PROMPTS = ["a b c", "the first of the prompts here", "x", "one two three four five six seven"]
# Row 0 ends after one turn, row 1 after two, row 2 after three (a long observation, then a short
# one), row 3 after three with no observation after its first turn (nothing new but the last token).
ROWS = [
    {"results": [(None, 1.0, True)]},
    {"results": [("go on", 0.25, False), (None, 1.0, True)]},
    {"results": [("tell me more about the second part of that, please", 0.0, False), ("ok", 0.0, False),
                 (None, 0.5, True)]},
    {"results": [(None, 0.0, False), ("and then?", 0.0, False), (None, 1.0, True)]},
]


class _PlainEngine:
    """What RolloutGenerator uses of a DeepSpeed engine (``.module``), around a plain module."""

    def __init__(self, module):
        self.module = module


def _end(logits: torch.Tensor, position: torch.Tensor, eos: int) -> None:
    """(B, V) next-token logits after (B,) positions: EOS wins where the rule says so (in place; no
    shape depends on the data, so a compiled decode step traces it too)."""
    end = (position % 5 == 4) | ((logits.argmax(-1) + position) % 3 == 0)
    logits[:, eos] = torch.where(end, logits.max(-1).values + 1.0, logits[:, eos])


def _end_turns(eos: int):
    def hook(module, args, kwargs, out):
        _end(out.logits[:, -1], kwargs["position_ids"][:, -1], eos)
        return out
    return hook


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-opt"])
def model_and_tokenizer(request):
    from transformers import AutoModelForCausalLM

    tok = load_hf_tokenizer(request.param)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(request.param)).eval()
    model.register_forward_hook(_end_turns(tok.eos_token_id), with_kwargs=True)
    return model, tok


@pytest.fixture(params=["dschat", "dschat-he", "graphs"])
def path(request, model_and_tokenizer):
    """The decoding path that continues the cache; on dschat's Hybrid Engine its decode model ends
    turns by the rule and records each prefill's input shape in :data:`_ENGINE_SHAPES`. ``graphs``
    runs on this CPU with Dynamo's ``eager`` backend (the same program, no compiler, no CUDA graphs)."""
    if request.param == "dschat-he":
        eos = model_and_tokenizer[1].eos_token_id
        request.addfinalizer(edit_decode_logits(lambda logits, position: _end(logits, position, eos),
                                                on_prefill=lambda tokens: _ENGINE_SHAPES.append(tuple(tokens.shape))))
    return request.param


_ENGINE_SHAPES: list[tuple[int, int]] = []


def _play(model_and_tokenizer, *, reuse: bool, path: str = "dschat", generation_loop: str = "auto",
          max_context: int = 1000, between=None, release_inference_cache: bool = False, device: str = "cpu"):
    """Plays :data:`ROWS` on ``path``; returns the episodes and, per rollout, the (rows, width) of its
    first forward and its kept log-probs. ``between(rollout)`` runs after each rollout of the episodes
    (``rollout``: the generator's own method). On ``device`` "cuda" the paths compile as they do there
    (CUDA graphs); on the CPU graphs runs with Dynamo's eager backend."""
    model, tok = model_and_tokenizer
    gen = RolloutGenerator(_PlainEngine(model), tok,
                           decision=HybridEngineDecision(path == "dschat-he", False, dschat_engine=path == "dschat-he"),
                           decoding=DecodingSettings("greedy"), max_answer_seq_len=MAX_ANSWER, zero_stage=0,
                           generation_loop=generation_loop, release_inference_cache=release_inference_cache)
    if path == "graphs" and device == "cpu":
        from transformers import CompileConfig

        gen.graph_devices = ("cuda", "cpu")
        graphs = next(p for p in gen.paths if p.name == "graphs")
        graphs._compile_config = CompileConfig(backend="eager")
        graphs._compile_config._compile_all_devices = True
    player = EpisodePlayer(gen, tok, load_environment("env_fixtures:scripted"), max_turns=3,
                           max_answer_seq_len=MAX_ANSWER, max_context=max_context)
    player.reuse_kv = reuse
    shapes: list[list[tuple[int, int]]] = []
    logprobs: list[torch.Tensor | None] = []  # each rollout's kept log-probs
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes[-1].append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    rollout = gen.rollout

    def counted(*args, **kwargs):
        shapes.append([])
        del _ENGINE_SHAPES[:]
        out = rollout(*args, **kwargs)
        shapes[-1] += _ENGINE_SHAPES
        assert gen.last_loop == path or generation_loop != "auto", gen.last_loop
        logprobs.append(out.logprobs)
        if between is not None:
            between(rollout)
        return out

    gen.rollout = counted
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(len(r) for r in ids)
    prompts = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in ids], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=device)
    try:
        played = player.play(prompts, mask, [dict(r) for r in ROWS])
    finally:
        handle.remove()
    return played, [s[0] for s in shapes], logprobs


def _segments(played, eos: int) -> list[list[tuple[int, int]]]:
    """Each episode's turns as (actor tokens, observation tokens after them); every turn here ends
    with EOS."""
    P = played.prompt_width
    out = []
    for ids, real, obs in zip(played.sequences[:, P:].tolist(), played.attention_mask[:, P:].tolist(),
                              played.observation_mask[:, P:].tolist()):
        turns: list[list[int]] = []
        closed = True
        for token, r, o in zip(ids, real, obs):
            if not r:
                break
            if o:
                turns[-1][1] += 1
            elif closed:
                turns.append([1, 0])
            else:
                turns[-1][0] += 1
            closed = bool(o) or token == eos
        out.append([tuple(t) for t in turns])
    return out


def test_reused_episodes_are_the_reprefilled_ones_and_feed_only_new_tokens(model_and_tokenizer, path, capsys):
    again, again_shapes, again_lp = _play(model_and_tokenizer, reuse=False, path=path)
    capsys.readouterr()
    reused, reused_shapes, reused_lp = _play(model_and_tokenizer, reuse=True, path=path)
    said = capsys.readouterr().out
    assert said.count(f"{KV_REUSE}: the conversation's KV cache is kept between turns ({path} loop)") == 1
    assert reused.turns.tolist() == again.turns.tolist() == [1, 2, 3, 3]
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "env_reward"):
        assert torch.equal(getattr(reused, name), getattr(again, name)), name
    # Some episode's reward slot has no decoder log-prob here, so neither run keeps them in the
    # episodes (the trainer scores the batch); each turn's log-probs of the actor's tokens agree.
    assert again.logprobs is None and reused.logprobs is None

    # The forwards that start each turn: the whole live contexts when prefilled again; every row
    # (ended ones as holes) and only its tokens not yet in the cache when continued.
    segments = _segments(again, model_and_tokenizer[1].eos_token_id)
    assert [len(s) for s in segments] == [1, 2, 3, 3]
    P = again.prompt_width
    prompt_lengths = again.attention_mask[:, :P].sum(1).tolist()
    assert len(again_shapes) == len(reused_shapes) == 3
    multiple = 64 if path == "graphs" else 1  # graphs left-pads the prompts it prefills to a multiple of 64
    steps = {}
    for t in range(3):
        live = [i for i, s in enumerate(segments) if len(s) > t]
        context = [prompt_lengths[i] + sum(a + o for a, o in segments[i][:t]) for i in live]
        assert again_shapes[t] == (len(live), -(-max(context) // multiple) * multiple)
        for j, i in enumerate(live):
            n = segments[i][t][0]
            assert (reused_lp[t][i, :n] - again_lp[t][j, :n]).abs().max().item() < 1e-5
        if t == 0:
            assert reused_shapes[t] == (len(segments), max(context))
        else:
            decoded = steps[t - 1]
            # A row's new tokens: its observation, and its last token unless it was fed while other
            # rows decoded on (at least that last token: its logits give the next one).
            new = [max(1, segments[i][t - 1][1] + int(segments[i][t - 1][0] == decoded)) for i in live]
            assert reused_shapes[t] == (len(segments), max(new))
            assert max(new) < max(context)
        steps[t] = max(segments[i][t][0] for i in live)


def test_a_path_that_cannot_continue_a_cache_prefills_again_and_says_why_once(model_and_tokenizer, capsys):
    played, shapes, _ = _play(model_and_tokenizer, reuse=True, generation_loop="hf")
    said = capsys.readouterr().out
    assert said.count(f"{KV_REUSE}: each turn prefills the whole conversation again (generation loop 'hf')") == 1
    assert KV_REUSE + ": the conversation's" not in said
    assert played.turns.tolist() == [1, 2, 3, 3]
    assert [rows for rows, _ in shapes] == [4, 3, 2]  # only the live episodes, their whole contexts


def test_a_turn_the_shared_budget_stopped_goes_on_from_the_cache(model_and_tokenizer, path):
    """With no headroom left (``max_context`` below the contexts) each later call decodes one token:
    the turns that have not ended go on, feeding only their last sampled token, and the episodes are
    still the re-prefilled ones."""
    again, again_shapes, _ = _play(model_and_tokenizer, reuse=False, path=path, max_context=20)
    reused, reused_shapes, _ = _play(model_and_tokenizer, reuse=True, path=path, max_context=20)
    assert len(reused_shapes) == len(again_shapes) > 3  # turns stopped by the budget went on
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(reused, name), getattr(again, name)), name
    assert reused_shapes[3:] == [(4, 1)] * (len(reused_shapes) - 3)
    assert all(width > 1 for _, width in again_shapes[3:])


@pytest.mark.parametrize("path", ["dschat", "dschat-he"], indirect=True)  # graphs: the next test
def test_sliding_window_models_prefill_again_and_say_why(model_and_tokenizer, path, capsys):
    """A model whose attention slides over a window is never continued from a kept cache (the cache's
    holes would shorten the window); its episodes are the re-prefilled ones."""
    from transformers import GPTNeoConfig, LlamaConfig, MistralConfig, Qwen2Config

    from dschat.models.packing import attention_window

    assert attention_window(MistralConfig(sliding_window=64)) == 64
    assert attention_window(MistralConfig(sliding_window=None)) is None
    assert attention_window(LlamaConfig()) is None
    assert attention_window(GPTNeoConfig(window_size=256)) == 256  # GPT-Neo's local-attention layers
    assert attention_window(Qwen2Config(use_sliding_window=False)) is None
    assert attention_window(Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=0,
                                         num_hidden_layers=2)) == 32
    model, _ = model_and_tokenizer
    model.config.sliding_window, model.config.use_sliding_window = 8, True
    had_types = hasattr(model.config, "layer_types")
    saved_types = getattr(model.config, "layer_types", None)
    model.config.layer_types = ["sliding_attention"] * 2
    try:
        again, _, _ = _play(model_and_tokenizer, reuse=False, path=path)
        capsys.readouterr()
        played, shapes, _ = _play(model_and_tokenizer, reuse=True, path=path)
    finally:
        del model.config.sliding_window, model.config.use_sliding_window
        if had_types:
            model.config.layer_types = saved_types
        else:
            del model.config.layer_types
    said = capsys.readouterr().out
    assert said.count(f"{KV_REUSE}: each turn prefills the whole conversation again (the model attends over a "
                      "sliding window of 8 tokens") == 1
    assert played.sequences.equal(again.sequences)


def test_graphs_prefill_a_sliding_window_model_again_and_say_why(capsys):
    """On the graphs path (whose static cache needs a model built with its window, not a patched
    config): a Mistral with a window of 8 tokens plays the re-prefilled episodes and says why."""
    from transformers import MistralConfig, MistralForCausalLM

    path, tok = "graphs", load_hf_tokenizer("tiny-llama")
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=8, max_position_embeddings=256)).eval()
    model.register_forward_hook(_end_turns(tok.eos_token_id), with_kwargs=True)
    again, _, _ = _play((model, tok), reuse=False, path=path)
    capsys.readouterr()
    played, shapes, _ = _play((model, tok), reuse=True, path=path)
    said = capsys.readouterr().out
    assert said.count(f"{KV_REUSE}: each turn prefills the whole conversation again (the model attends over a "
                      "sliding window of 8 tokens") == 1
    assert played.sequences.equal(again.sequences)
    assert [rows for rows, _ in shapes] == [4, 3, 2]  # only the live episodes, their whole contexts


@pytest.mark.parametrize("path", ["graphs"], indirect=True)
def test_graphs_continue_a_conversation_without_compiling_again(model_and_tokenizer, path):
    """The graphs path's turns after the first decode on the same static cache (its capacity fixed
    for the batch, every row kept): Dynamo compiles nothing new for them, where prefilling every turn
    again compiles again (its batch shrinks to the live episodes)."""
    from torch._dynamo.utils import counters

    def compiled_per_rollout(reuse: bool) -> list[int]:
        totals: list[int] = []
        torch._dynamo.reset()
        counters.clear()
        try:
            _play(model_and_tokenizer, reuse=reuse, path=path,
                  between=lambda rollout: totals.append(counters["stats"]["unique_graphs"]))
        finally:
            torch._dynamo.reset()
        return [b - a for a, b in zip([0, *totals], totals)]

    reused, again = compiled_per_rollout(True), compiled_per_rollout(False)
    assert reused[0] > 0 and reused[1:] == [0, 0], reused
    assert sum(again[1:]) > 0, again


def test_compact_moves_each_rows_columns_together_and_keeps_one_of_an_ended_row():
    """``Conversation.compact`` and ``compact_columns`` on hand-made columns: each row's kept columns
    keep their order and move, with their keys, to the right of the first C' columns; a row narrower
    than C' gets holes before its columns; an ended row keeps its first column only."""
    from dschat.rlhf.rollout.conversation import Conversation, compact_columns

    conversation = Conversation()
    conversation.next_turn([[11, 12, 13], [21, 22], [31, 32, 33, 34]], [True, True, False], pad_id=0)
    conversation.mask = torch.tensor([[0, 1, 0, 1, 1, 0],
                                      [1, 0, 0, 0, 1, 0],
                                      [0, 1, 1, 0, 1, 1]])
    conversation.cached = [3, 2, 4]
    keys = torch.arange(3 * 6, dtype=torch.float32).view(3, 1, 6, 1).repeat(1, 2, 1, 3)  # (B, H, S, D): the column
    before = keys.clone()
    source = conversation.compact()
    compact_columns(keys, source)
    assert conversation.mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    assert conversation.cached == [3, 2, 1]
    assert source[0].tolist() == [1, 3, 4] and source[1, 1:].tolist() == [0, 4] and source[2, -1].item() == 1
    for b in range(3):
        for c in range(3):
            assert torch.equal(keys[b, :, c], before[b, :, int(source[b, c])])
    assert torch.equal(keys[:, :, 3:], before[:, :, 3:])  # the columns after C' are left as they were
    assert conversation.past_ids(torch.device("cpu")).tolist() == [[11, 12, 13], [0, 21, 22], [0, 0, 31]]


def test_make_room_decides_before_anything_moves():
    """``Conversation.make_room`` on the hand-made columns above (6 kept, 3 once compact; the decoding
    rows' conversations are 3 and 2 tokens): each answer at the bound between two of its cases."""
    from dschat.rlhf.rollout.conversation import Conversation

    conversation = Conversation()
    conversation.next_turn([[11, 12, 13], [21, 22], [31, 32, 33, 34]], [True, True, False], pad_id=0)
    assert conversation.make_room(new=2, room=4, bound=5) == "fits"  # nothing kept yet
    conversation.mask = torch.tensor([[0, 1, 0, 1, 1, 0],
                                      [1, 0, 0, 0, 1, 0],
                                      [0, 1, 1, 0, 1, 1]])
    conversation.cached = [3, 2, 4]
    mask = conversation.mask.clone()
    assert conversation.compact_width() == 3
    assert conversation.make_room(new=2, room=4, bound=12) == "fits"  # 6 + 2 + 4
    assert conversation.make_room(new=2, room=4, bound=11) == "compact"  # 3 + 2 + 4 <= 11
    assert conversation.make_room(new=2, room=4, bound=9) == "compact"
    assert conversation.make_room(new=3, room=4, bound=9) == "prefill"  # 3 + 3 + 4 > 9, 3 + 4 <= 9
    assert conversation.make_room(new=2, room=4, bound=9, movable=False) == "prefill"
    assert conversation.make_room(new=2, room=7, bound=9) == "past"  # 3 + 7 > 9
    assert torch.equal(conversation.mask, mask) and conversation.cached == [3, 2, 4]  # nothing moved


# ------------------------------------------------------------------ dschat's Hybrid Engine only
def _engine_of(model_and_tokenizer, **play):
    """Plays with dschat's Hybrid Engine and returns (episodes, shapes, the engine)."""
    engines = []
    played, shapes, logprobs = _play(model_and_tokenizer, reuse=True, path="dschat-he",
                                     between=lambda rollout: engines.append(rollout.__self__.engine), **play)
    _engine_of.logprobs = logprobs  # the last play's kept log-probs, for the tests that compare them
    return played, shapes, engines[-1]


@pytest.mark.parametrize("path", ["dschat-he"], indirect=True)
def test_a_conversation_that_outgrows_the_engines_cache_moves_to_a_larger_one(model_and_tokenizer, path,
                                                                              monkeypatch):
    """A cache sized exactly (no rounding up) is outgrown by a later turn: the kept columns move to a
    larger cache, and the episodes are still the re-prefilled ones."""
    again, _, _ = _play(model_and_tokenizer, reuse=False, path=path)
    _, rounded_shapes, rounded = _engine_of(model_and_tokenizer)
    monkeypatch.setattr(StaticKVCache, "capacity_for", staticmethod(lambda length, multiple=64: length))
    reused, shapes, engine = _engine_of(model_and_tokenizer)
    assert rounded.cache_allocations == 1 and engine.cache_allocations > 1
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(reused, name), getattr(again, name)), name
    assert shapes == rounded_shapes  # the same new tokens fed at each turn (their widths: the first test)


def _same_turn_logprobs(again, again_lp, reused_lp, eos: int) -> None:
    """Each turn's kept log-probs of the actor's tokens agree (re-prefilled rollouts have a row per
    live episode, continued ones a row per episode)."""
    segments = _segments(again, eos)
    assert len(reused_lp) == len(again_lp) == max(len(s) for s in segments)  # one rollout a turn
    for t in range(max(len(s) for s in segments)):
        live = [i for i, s in enumerate(segments) if len(s) > t]
        for j, i in enumerate(live):
            n = segments[i][t][0]
            assert (reused_lp[t][i, :n] - again_lp[t][j, :n]).abs().max().item() < 1e-5, (t, i)


# A max_context per model at which closing the kept columns' holes is enough for the turn that would
# pass it (their caches sized exactly); at 80 it is not, and the conversations are prefilled again.
# Found by playing these tiny checkpoints' greedy episodes at 70-100 and counting the compactions
# and restarts; should the checkpoints change, the exact counts asserted below fail, not pass.
COMPACT_ENOUGH = {"llama": 90, "opt": 91}


@pytest.mark.parametrize("path", ["dschat-he"], indirect=True)
@pytest.mark.parametrize("enough", [True, False], ids=["compacted", "prefilled-again"])
def test_the_engines_cache_stays_within_what_a_prompt_and_answer_take(model_and_tokenizer, path, enough,
                                                                      monkeypatch):
    """The engine keeps its cache after the episodes, so a conversation may not grow it past the size
    of ``max_context`` (the prompt and answer lengths of the run): before a turn would, the kept
    columns' holes are closed in place, and where the rows' columns still do not line up the
    conversations are prefilled again compact. Either way the episodes are the re-prefilled ones.
    Caches sized exactly here, so the bound shows."""
    limit = COMPACT_ENOUGH[model_and_tokenizer[0].config.model_type] if enough else 80
    monkeypatch.setattr(StaticKVCache, "capacity_for", staticmethod(lambda length, multiple=64: length))
    again, _, again_lp = _play(model_and_tokenizer, reuse=False, path=path, max_context=limit)
    unbounded = _engine_of(model_and_tokenizer)[2]
    reused, _, engine = _engine_of(model_and_tokenizer, max_context=limit)
    _same_turn_logprobs(again, again_lp, _engine_of.logprobs, model_and_tokenizer[1].eos_token_id)
    assert unbounded.cache.capacity > limit >= engine.cache.capacity
    # Decided before anything moves: where closing the holes is not enough, none are closed.
    assert unbounded.compactions == 0 and (engine.compactions, engine.restarts) == ((1, 0) if enough else (0, 1))
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(reused, name), getattr(again, name)), name


def _graphs_of(model_and_tokenizer, monkeypatch, **play):
    """Plays on the graphs path (caches sized exactly: ``graph_prompt_multiple`` 1), spying on its
    ``generate`` calls; returns (episodes, the path, the calls: (ids, mask shown, ended rows, answers))."""
    import dschat.rlhf.rollout.graphs as graphs_module

    calls, paths = [], []
    generate = graphs_module.hf_generate

    def spied(gen, module, ids, mask, **kwargs):
        out = generate(gen, module, ids, mask, **kwargs)
        ended = kwargs["logits_processor"][-1].ended if "past_key_values" in kwargs else None
        calls.append((ids.cpu(), mask.cpu(), ended, out.sequences[:, ids.shape[1]:].cpu()))
        return out

    monkeypatch.setattr(graphs_module, "hf_generate", spied)
    turn = graphs_module.GraphsPath._continue

    def exact(self, conversation, device):
        self.gen.graph_prompt_multiple = 1
        return turn(self, conversation, device)

    monkeypatch.setattr(graphs_module.GraphsPath, "_continue", exact)
    played, _, logprobs = _play(model_and_tokenizer, reuse=True, path="graphs",
                                between=lambda rollout: paths.append(rollout.__self__.paths), **play)
    _graphs_of.logprobs = logprobs  # the kept log-probs, for the tests that compare them
    return played, next(p for p in paths[-1] if p.name == "graphs"), calls


@pytest.mark.parametrize("path", ["graphs"], indirect=True)
def test_graphs_feed_the_kept_columns_ids_and_end_ended_rows_at_once(model_and_tokenizer, path, monkeypatch):
    """What ``generate`` is given on a continued turn: each row's real columns (kept and new) are the
    start of its conversation as played (holes as padding ids); a row whose episode has ended says EOS
    at once."""
    played, _, calls = _graphs_of(model_and_tokenizer, monkeypatch)
    eos = model_and_tokenizer[1].eos_token_id
    conversations = [row[m.bool()].tolist() for row, m in zip(played.sequences, played.attention_mask)]
    assert len(calls) == 3 and all(ended is not None for _, _, ended, _ in calls)  # each a conversation's turn
    ended_seen = 0
    for ids, mask, ended, answers in calls:
        for i, conversation in enumerate(conversations):
            real = ids[i][mask[i].bool()].tolist()
            if ended[i]:
                ended_seen += 1
                assert answers[i, 0].item() == eos
            else:
                assert conversation[:len(real)] == real
    assert ended_seen == 1 + 2  # row 0 from turn 2, rows 0 and 1 in turn 3


@pytest.mark.parametrize("path", ["graphs"], indirect=True)
@pytest.mark.parametrize("enough", [True, False], ids=["compacted", "prefilled-again"])
def test_graphs_close_the_holes_before_the_cache_would_overflow(model_and_tokenizer, path, enough, monkeypatch):
    """With the static cache sized for ``max_context`` exactly, the kept columns' holes are closed in
    place before a turn would overflow it (or, where that is not enough, the conversations are
    prefilled again into the same cache): the episodes are still the re-prefilled ones."""
    limit = COMPACT_ENOUGH[model_and_tokenizer[0].config.model_type] if enough else 80
    again, _, again_lp = _play(model_and_tokenizer, reuse=False, path=path, max_context=limit)
    played, graphs, calls = _graphs_of(model_and_tokenizer, monkeypatch, max_context=limit)
    _same_turn_logprobs(again, again_lp, _graphs_of.logprobs, model_and_tokenizer[1].eos_token_id)
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(played, name), getattr(again, name)), name
    assert (graphs.compactions, graphs.restarts) == ((1, 0) if enough else (0, 1))


@pytest.mark.parametrize("path", ["dschat-he"], indirect=True)
def test_a_rollout_between_turns_makes_the_next_turn_prefill_every_conversation(model_and_tokenizer, path):
    """Another rollout on the engine (the same batch size: it writes over the cache in place) leaves
    the conversation nothing to continue: the next turn feeds every row's whole conversation."""
    model, tok = model_and_tokenizer
    again, again_shapes, _ = _play(model_and_tokenizer, reuse=False, path=path)
    ids = [tok(p, add_special_tokens=False)["input_ids"][:1] for p in PROMPTS]
    other = torch.tensor(ids), torch.ones((len(ids), 1), dtype=torch.long)
    played, shapes, _ = _play(model_and_tokenizer, reuse=True, path=path,
                              between=lambda rollout: rollout(*other))
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(played, name), getattr(again, name)), name
    # Every row at each turn (an ended one its first token only), as wide as the longest live conversation.
    assert shapes == [(4, width) for _, width in again_shapes]


@pytest.mark.parametrize("path", ["dschat-he"], indirect=True)
def test_release_inference_cache_prefills_every_turn_and_says_why(model_and_tokenizer, path, capsys):
    again, _, _ = _play(model_and_tokenizer, reuse=False, path=path)
    capsys.readouterr()
    played, shapes, _ = _play(model_and_tokenizer, reuse=True, path=path, release_inference_cache=True)
    said = capsys.readouterr().out
    assert said.count(f"{KV_REUSE}: each turn prefills the whole conversation again (--release_inference_cache "
                      "frees the KV cache after each turn)") == 1
    assert played.sequences.equal(again.sequences)
    assert [rows for rows, _ in shapes] == [4, 3, 2]


@pytest.mark.parametrize("path", ["dschat-he"], indirect=True)
def test_the_compiled_decode_step_continues_a_conversation_without_compiling_again(model_and_tokenizer, path,
                                                                                   monkeypatch):
    """What CUDA graphs need, checked on a CPU with Dynamo (``aot_eager``: tracing without a compiler):
    the compiled decode step plays the eager episodes, and the later turns, which write after the
    kept columns of the same cache, compile nothing new."""
    again, _, _ = _play(model_and_tokenizer, reuse=False, path=path)
    init = DschatHybridEngine.__init__

    def compiled(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.compile_step, self.compile_options = True, {"backend": "aot_eager", "dynamic": False}

    monkeypatch.setattr(DschatHybridEngine, "__init__", compiled)
    torch._dynamo.reset()
    try:
        reused, _, engine = _engine_of(model_and_tokenizer)
    finally:
        torch._dynamo.reset()
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(reused, name), getattr(again, name)), name
    assert engine.compiles_per_rollout == [1, 0, 0] and engine.cache_allocations == 1


# ------------------------------------------------------------------ GPU tier
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["dschat-he", "graphs"], indirect=True)
def test_on_cuda_the_continued_turns_are_the_reprefilled_ones_and_compile_once(model_and_tokenizer, path):
    """GPU tier: with the decode step compiled and captured in CUDA graphs (dschat's Hybrid Engine, or
    generate's static cache), fp32 greedy episodes continued from the kept cache are the re-prefilled
    ones, and the turns after the first compile nothing new."""
    import copy

    from torch._dynamo.utils import counters

    model, tok = model_and_tokenizer
    on_cuda = (copy.deepcopy(model).cuda(), tok)  # the hook that ends turns comes along
    again, _, _ = _play(on_cuda, reuse=False, path=path, device="cuda")
    totals: list[int] = []
    torch._dynamo.reset()
    counters.clear()
    try:
        reused, _, _ = _play(on_cuda, reuse=True, path=path, device="cuda",
                             between=lambda rollout: totals.append(counters["stats"]["unique_graphs"]))
    finally:
        torch._dynamo.reset()
    for name in ("sequences", "attention_mask", "observation_mask", "ended", "cut", "turns", "env_reward"):
        assert torch.equal(getattr(reused, name).cpu(), getattr(again, name).cpu()), name
    assert totals[0] > 0 and totals[1:] == [totals[0]] * (len(totals) - 1), totals
