# SPDX-License-Identifier: Apache-2.0
"""The first output token's detokenization primed from the end of the prompt gives the same text as
vLLM's priming from the whole prompt (``qwen36_pcp.prompt_tail``, applied by ``patches``), with vLLM's own
``FastIncrementalDetokenizer`` and the byte-level tokenizer of the tiny checkpoint.

Prompts and outputs are random ids over the whole vocabulary: ids 0-255 are single bytes, so prompts
end inside multi-byte characters, outputs complete them or not, and special tokens come and go. Text
prompts in several scripts come through the tokenizer. Each case is also run with a priming that
ignores an unfinished last character: that one must differ somewhere, or the cases prove nothing.
"""

import random

import pytest


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", config_only=True)
    return AutoTokenizer.from_pretrained(str(path))


def _request(prompt, skip_special_tokens):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id="r", prompt_token_ids=prompt, mm_features=None,
        sampling_params=SamplingParams(skip_special_tokens=skip_special_tokens),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)


def _texts(tokenizer, prompt, outputs, skip_special_tokens, tail_fn):
    """Per output token, the text vLLM's detokenizer emits, with the hook's priming (``tail_fn``
    picks the primed ids) or vLLM's (None)."""
    from unittest import mock

    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from qwen36_pcp import patches

    request = _request(prompt, skip_special_tokens)
    with mock.patch.object(patches, "serves_pcp", lambda: tail_fn is not None), \
            mock.patch.object(patches, "prompt_tail", tail_fn or patches.prompt_tail):
        detok = FastIncrementalDetokenizer(tokenizer, request)
    out = []
    for token in outputs:
        detok.update([token], stop_terminated=False)
        out.append(detok.output_text)
    return out


def _cases(tokenizer, rng):
    vocab = len(tokenizer)
    for _ in range(60):  # random ids: bytes, pieces, special tokens
        n = rng.choice((40, 300, 3000))
        low = rng.random() < 0.5  # mostly single bytes: unfinished characters everywhere
        draw = (lambda: rng.randrange(256)) if low else (lambda: rng.randrange(vocab))
        yield [draw() for _ in range(n)], [draw() for _ in range(12)]
    words = "context parallel 上下文并行 параллельный 🚀🧠 ünïcödé "
    for k in range(10):
        prompt = tokenizer.encode(words * (20 + 37 * k), add_special_tokens=False)
        out = tokenizer.encode(words[k:] + "🚀 done", add_special_tokens=False)[:12]
        yield prompt[: len(prompt) - k], out  # cut inside a character for some k


@pytest.fixture
def detokenizer_patch():
    """The one patch under test, installed in this process for the test and removed after it."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from qwen36_pcp import patches

    patch = next(p for p in patches.PATCHES if p.owner is FastIncrementalDetokenizer)
    patch.install()
    patch.install()  # idempotent
    yield
    patch.uninstall()
    assert not hasattr(FastIncrementalDetokenizer.__init__, patches.ORIGINAL)


def test_prompt_tail_emits_the_same_text(tokenizer, detokenizer_patch):
    from qwen36_pcp.prompt_tail import PROMPT_TAILS, prompt_tail

    rng = random.Random(0)

    def careless(tok, request):  # the shortest tail whatever it decodes to
        ids = request.prompt_token_ids
        return ids[-PROMPT_TAILS[0]:] if len(ids) > PROMPT_TAILS[0] else None

    primed_from_tail, careless_differs = 0, 0
    for prompt, outputs in _cases(tokenizer, rng):
        for skip in (True, False):
            whole = _texts(tokenizer, prompt, outputs, skip, None)
            tailed = _texts(tokenizer, prompt, outputs, skip, prompt_tail)
            assert tailed == whole, (prompt[-8:], outputs, skip)
            primed_from_tail += prompt_tail(tokenizer, _request(prompt, skip)) is not None
            careless_differs += _texts(tokenizer, prompt, outputs, skip, careless) != whole
    print(f"primed from a tail: {primed_from_tail} of 140; a careless tail differs: {careless_differs}")
    assert primed_from_tail >= 60  # most prompts took the short path
    assert careless_differs > 0  # the '\ufffd' rule matters for these cases


def test_other_decoders_keep_vllms_priming():
    """Only a byte-level decoder's text is known to resume at a whole character: with any other
    (here SentencePiece's Metaspace) the prompt primes the detokenizer whole, as in vLLM."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from qwen36_pcp.prompt_tail import prompt_tail

    backend = Tokenizer(models.WordLevel({"\u2581a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert prompt_tail(tokenizer, _request([0, 1] * 100, True)) is None
