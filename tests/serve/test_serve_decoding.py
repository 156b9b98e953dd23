

def test_the_served_hybrid_engine_keeps_its_cpu_packed_weights_while_the_batch_size_stays(llama):
    decoder = HybridEngineDecoder(llama, 4)
    model = decoder.he.model
    answers = []
    for prompts in (PROMPTS[:2], PROMPTS[1:], PROMPTS[:1]):
        out: list[list] = [[] for _ in prompts]
        decoder.decode([Job(llama.encode(p), 6, (), GREEDY, o.append) for p, o in zip(prompts, out)])
        answers.append([o[-1] for o in out])
        if len(prompts) == 2:
            packed = packed if len(answers) == 2 else model.packed  # noqa: F821 - set at the first batch
            assert model.packed is packed and model.packed_rows == 2  # two batches of 2 rows: packed once
    assert model.packed_rows == 1 and model.packed is not packed  # another batch size: packed again
    decoder.he.refresh(llama.model)
    assert model.packed == {}  # new weights: the copies are dropped
    assert all(isinstance(done, Done) and done.completion_tokens == 6 for batch in answers for done in batch)
