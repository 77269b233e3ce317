"""TextSync (pdserve.router.run.textsync): a worker that continues an output (D after P's token, a migrated attempt)
is primed with the output so far as its prompt. Its own text, taken once settled, must give the very text one worker
gives, token for token, at every split point, including splits inside a multi-byte character. The continuing
worker's and the one worker's detokenizers are ``tokenizers.DecodeStream`` primed as vLLM primes them
(``FastIncrementalDetokenizer``); the router's is its ``IncrementalDetokenizer``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.router.api.tokenizer import IncrementalDetokenizer
from pdserve.router.run.textsync import TextSync

SMOLLM = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct" / "tokenizer.json"
TEXTS = ["Hello wörld 😀 日本語のテキスト 🎉🎉 naïve café — “quotes” \n\t end", "ünïcödé 😀😀😀 中文字符 한국어",
         "plain ascii text"]


def _worker(tok, prompt: list[int], out: list[int]) -> list[str]:
    """Each token's text as a vLLM worker streams it after ``prompt``."""
    from tokenizers.decoders import DecodeStream

    s = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    texts = []
    for t in out:
        try:
            piece = s.step(tok, t)
        except Exception:  # vLLM restarts the stream on an invalid prefix
            s = DecodeStream(skip_special_tokens=True)
            piece = s.step(tok, t)
        texts.append(piece or "")
    return texts


def _sentencepiece_like():
    """A Llama-style tokenizer: Metaspace-like normalizer, byte fallback, a decoder that strips the leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(["Hello world this is a test of the tokenizer", "café naïve the and of to in"] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False))
    return tok


def _tokenizers():
    from tokenizers import Tokenizer

    out = [("sentencepiece-like", _sentencepiece_like())]
    if SMOLLM.exists():
        out.append(("byte-level BPE (SmolLM2)", Tokenizer.from_file(str(SMOLLM))))
    return out


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("name,tok", _tokenizers())
def test_settled_worker_text_is_one_workers_text_at_every_split(name, tok, interval):
    """``interval``: tokens per event after the first (vLLM --stream-interval); an event's text is its tokens'."""
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    cases = settled = 0
    for text in TEXTS:
        ids = tok.encode(text).ids
        for seq in (ids, [rng.randrange(vocab) for _ in range(30)], ids + [rng.randrange(vocab) for _ in range(6)]):
            for cut in range(1, len(seq) - 2):
                prompt, out = seq[:cut], seq[cut:]
                one = _worker(tok, prompt, out)
                router = IncrementalDetokenizer(tok, prompt)
                got = [router.step(out[0])]  # P's token: the router's text
                cont = _worker(tok, prompt + out[:1], out[1:])  # D, primed with prompt + t1
                sync, own = TextSync(), True
                for k in range(0, len(out) - 1, interval):
                    event = out[1 + k:1 + k + interval]
                    if own:
                        ours = "".join(router.step(t) for t in event)
                        got.append(ours)
                        own = not sync.settled("".join(cont[k:k + interval]), ours, router.emitted)
                    else:
                        got.append("".join(cont[k:k + interval]))
                want = [one[0]] + ["".join(one[1 + k:1 + k + interval]) for k in range(0, len(out) - 1, interval)]
                assert got == want, (name, cut)
                cases += 1
                settled += not own
    assert settled > cases // 3  # the check does let streams go (random ids split characters more often)


def test_settles_only_after_two_agreeing_emitted_events():
    s = TextSync()
    assert not s.settled(" a", " a", True)
    assert s.settled(" b", " b", True)
    s = TextSync()
    assert not s.settled(" a", " a", True) and not s.settled("", "", False)  # nothing emitted: start over
    assert not s.settled(" b", " b", True) and not s.settled(" x", " c", True)  # a disagreement: start over
    assert not s.settled(" d", " d", False)  # the router still holds bytes back
    assert not s.settled(" e", " e", True) and s.settled(" f", " f", True)
