"""The transformers engine's sampling loop does no work it throws away, its batched
post-processing gives exactly the rollouts a row-by-row reading of the samples gives,
top-k / top-p sampling records the log-probs of the truncated distribution it drew from,
and an interrupt ends a generation between two tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.decoding import sample, truncate
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.engines.base import SerialEngine
from streamrft.schemas.errors import SamplingInterrupted

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)

PROMPTS = ["3+5=", "12+30=", "7=", "100+200+3="]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny_model(tokenizer, eos_bias: float) -> torch.nn.Module:
    """A tiny Llama whose output layer is biased towards (or away from) EOS."""
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=48
    )
    model = build_tiny_model(cfg, tokenizer).eval()
    head = torch.nn.Linear(cfg.hidden_size, len(tokenizer), bias=True)
    head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = eos_bias
    model.lm_head = head
    return model


def greedy(model, tokenizer, ids, mask, steps: int):
    """:func:`sample` greedily for ``steps`` tokens."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    return sample(model, ids, mask, max_new_tokens=steps, eos_id=eos, pad_id=pad, greedy=True)


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


def test_one_forward_pass_per_sampled_token_and_logits_of_the_last_position_only(tokenizer):
    model = tiny_model(tokenizer, eos_bias=-1e4)  # never EOS: every row runs to the end
    engine = TransformersEngine(model, tokenizer)
    ids, mask = engine.encode_prompts(prompt_ids(tokenizer))
    head_positions: list[int] = []
    hook = model.lm_head.register_forward_hook(
        lambda _m, inputs, _out: head_positions.append(inputs[0].shape[1])
    )
    try:
        out = sample(
            model,
            ids,
            mask,
            max_new_tokens=6,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        hook.remove()
    assert out.tokens.shape == (len(PROMPTS), 6)
    assert out.lengths.tolist() == [6] * len(PROMPTS)
    # the prompt pass and one pass per later token: none for logits never sampled
    assert len(head_positions) == 6
    # the prompt pass computes the output layer on its last position only
    assert head_positions == [1] * 6


def test_rollouts_are_the_samples_read_row_by_row(tokenizer):
    model = tiny_model(tokenizer, eos_bias=1.5)  # some rows end early, some run to the end
    engine = TransformersEngine(model, tokenizer)
    prompts, n, max_new, seed = prompt_ids(tokenizer), 3, 8, 11
    groups = engine.rollout(prompts, n, 0.9, max_new, seed)

    flat = [p for p in prompts for _ in range(n)]
    ids, mask = engine.encode_prompts(flat)
    out = sample(
        model,
        ids,
        mask,
        max_new_tokens=max_new,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=0.9,
        generator=torch.Generator().manual_seed(seed),
    )
    got = [r for group in groups for r in group]
    assert [len(g) for g in groups] == [n] * len(prompts)
    lengths = out.lengths.tolist()
    assert min(lengths) < max_new and max(lengths) == max_new  # rows that end early, and not
    for i, r in enumerate(got):
        length = int(out.lengths[i])
        assert r.prompt_ids == ids[i][mask[i].bool()].tolist() == flat[i]
        assert r.response_ids == out.tokens[i, :length].tolist()
        assert r.logprobs == out.logprobs[i, :length].tolist()
        assert r.text == tokenizer.decode(r.response_ids, skip_special_tokens=True)


def test_greedy_texts_are_the_argmax_rows_decoded(tokenizer):
    model = tiny_model(tokenizer, eos_bias=1.5)
    engine = TransformersEngine(model, tokenizer)
    prompts = prompt_ids(tokenizer)
    ids, mask = engine.encode_prompts(prompts)
    out = greedy(model, tokenizer, ids, mask, 8)
    expected = [
        tokenizer.decode(out.tokens[i, : int(out.lengths[i])].tolist(), skip_special_tokens=True)
        for i in range(len(prompts))
    ]
    assert engine.greedy(prompts, 8) == expected


def test_the_kv_cache_is_used_under_the_installed_transformers_name(tokenizer):
    """Greedy sampling through the cache equals greedy decoding by full forward passes
    (a cache passed under a name the model ignores would decode one token without its
    context and differ), with no deprecation warning from transformers; a PEFT adapter's
    wrapper names the cache as its base model does."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from streamrft.producers.decoding import cache_keyword

    model = tiny_model(tokenizer, eos_bias=-1e4)
    engine = TransformersEngine(model, tokenizer)
    ids, mask = engine.encode_prompts(prompt_ids(tokenizer))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = greedy(model, tokenizer, ids, mask, 5)
    seq, full_mask = ids, mask
    expected = []
    with torch.no_grad():
        for _ in range(5):
            positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
            logits = model(input_ids=seq, attention_mask=full_mask, position_ids=positions).logits
            tok = logits[:, -1, :].argmax(-1)
            expected.append(tok)
            seq = torch.cat([seq, tok.unsqueeze(-1)], dim=1)
            full_mask = torch.cat([full_mask, torch.ones_like(tok).unsqueeze(-1)], dim=1)
    assert out.tokens.tolist() == torch.stack(expected, dim=1).tolist()
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_keyword(wrapped) == cache_keyword(model)
    assert cache_keyword(model) in ("cache", "past_key_values")


def test_truncation_keeps_the_top_k_then_the_nucleus_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    logp = probs.log()

    def kept(top_p: float = 1.0, top_k: int = 0) -> list[list[float]]:
        return truncate(logp, top_p, top_k).exp().tolist()

    assert kept()[0] == pytest.approx(probs[0].tolist())
    assert kept(top_p=0.7)[0] == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    assert kept(top_p=0.85)[0] == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert kept(top_p=0.01)[0] == pytest.approx([1, 0, 0, 0])  # at least the likeliest
    assert kept(top_k=2)[0] == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    assert kept(top_k=2)[1] == pytest.approx([0.25] * 4)  # tied with the 2nd: all kept
    assert kept(top_k=2, top_p=0.6)[0] == pytest.approx([1, 0, 0, 0])  # the nucleus of the top 2
    assert kept(top_k=9)[0] == pytest.approx(probs[0].tolist())  # more than the vocabulary


def test_truncated_sampling_records_the_log_probs_of_the_distribution_it_drew_from(tokenizer):
    model = tiny_model(tokenizer, eos_bias=-1e4)
    engine = TransformersEngine(model, tokenizer)
    prompts = prompt_ids(tokenizer)
    # top_k=1 is greedy decoding, each token certain under the truncated distribution
    (first, *_), *_ = engine.rollout(prompts, 1, 0.9, 6, 3, top_k=1)
    ids, mask = engine.encode_prompts(prompts[:1])
    assert first.response_ids == greedy(model, tokenizer, ids, mask, 6).tokens[0].tolist()
    assert first.logprobs == [0.0] * 6
    # nucleus: every token inside the nucleus of a full forward pass over the sequence, its
    # log-prob the renormalised one, above the full distribution's
    for group in engine.rollout(prompts, 4, 0.9, 6, 5, top_p=0.6):
        for r in group:
            with torch.no_grad():
                logits = model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0]
            steps = logits[len(r.prompt_ids) - 1 : -1].float() / 0.9
            full = torch.log_softmax(steps, dim=-1)
            drawn = truncate(full, top_p=0.6)
            at = torch.tensor(r.response_ids).unsqueeze(-1)
            assert drawn.gather(-1, at).squeeze(-1).tolist() == pytest.approx(r.logprobs, abs=1e-4)
            assert torch.isfinite(drawn.gather(-1, at)).all()
            assert (full.gather(-1, at).squeeze(-1) <= torch.tensor(r.logprobs) + 1e-6).all()


def test_an_interrupt_from_another_thread_ends_a_long_generation_between_two_tokens(tokenizer):
    """The explorer's stop reaches a generation through ``SerialEngine.interrupt`` while
    the sampling call holds the engine's lock: the call raises after the forward pass
    under way, and every later call raises before its first."""
    model = tiny_model(tokenizer, eos_bias=-1e4)  # never EOS: it would run all 4,000 tokens
    serial = SerialEngine(TransformersEngine(model, tokenizer))
    passes: list[int] = []
    third = threading.Event()

    def count(_m, _inputs, _out):
        passes.append(1)
        if len(passes) == 3:
            third.set()
            assert interrupted.wait(60)  # hold the 3rd pass until the interrupt is in

    interrupted = threading.Event()
    hook = model.lm_head.register_forward_hook(count)
    failure: list[BaseException] = []

    def sampling():
        try:
            serial.rollout(prompt_ids(tokenizer), 2, 1.0, 4_000, seed=0)
        except BaseException as exc:  # handed to the test's thread
            failure.append(exc)

    worker = threading.Thread(target=sampling)
    try:
        worker.start()
        assert third.wait(60)
        serial.interrupt()  # the call holds the lock: the interrupt must not need it
        interrupted.set()
        worker.join(60)
    finally:
        interrupted.set()
        hook.remove()
    assert not worker.is_alive() and len(passes) == 3
    assert [type(e) for e in failure] == [SamplingInterrupted]
    with pytest.raises(SamplingInterrupted):
        serial.greedy(prompt_ids(tokenizer), 8)
    assert len(passes) == 3  # raised before its first forward pass
