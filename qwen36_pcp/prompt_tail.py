# SPDX-License-Identifier: Apache-2.0
"""Detokenize a request's first output token from the end of its prompt, not the whole prompt.

vLLM 0.20.2's ``FastIncrementalDetokenizer`` primes tokenizers' ``DecodeStream`` with every prompt id,
and the stream's first step decodes the whole prompt twice: about a microsecond per prompt token on
the first token's path (``benchmarks/bench_detokenizer.py``), the same at every pcp, so the more ranks
the larger its share of time to first token. The stream emits the decoded primed ids + token minus the
decoded primed ids, and after its first emitted text keeps only the new ids. With a byte-level decoder
(Qwen's) the text is UTF-8 decoded from the ids' bytes, which resumes at the next whole character:
priming with a tail of the prompt whose text is not empty and does not end in an unfinished character
('\ufffd') emits the same text, character for character. A prompt whose text ends in '\ufffd' (then
the stream behaves differently; a longer tail would end the same way), short prompts and other
decoders keep vLLM's priming. Applied by ``patches`` in a front end serving our model at pcp > 1.
"""

from __future__ import annotations

from tokenizers import decoders

PROMPT_TAILS = (32, 256, 2048)  # prompt tokens to prime the detokenizer with: the first whose text is not empty


def prompt_tail(tokenizer, request) -> list[int] | None:
    """The prompt's last ids that prime the detokenizer as the whole prompt does, or None."""
    ids = request.prompt_token_ids
    backend = tokenizer._tokenizer
    if ids is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    for n in PROMPT_TAILS:
        if len(ids) <= n:
            return None
        text = backend.decode(ids[-n:], skip_special_tokens=request.sampling_params.skip_special_tokens)
        if text:  # else only skipped or empty tokens: a longer tail
            return None if text.endswith("\ufffd") else ids[-n:]
    return None
