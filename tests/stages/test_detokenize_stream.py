"""ByteLevelStream (stages/detokenize.py) against tokenizers' DecodeStream, step for step:
the shortcut for a running token must never change a single piece of text."""
import random

import pytest
from tokenizers.decoders import DecodeStream

from gpu.tokenizers.files import load_tokenizer
from stages.detokenize import ByteLevelStream, CleanPieces, byte_level


@pytest.fixture(scope="module")
def hf():
    return load_tokenizer(None).hf     # SmolLM2's tokenizer only, no model


@pytest.fixture(scope="module")
def pools(hf):
    """Ordinary tokens, tokens that are part of a character alone (U+FFFD), added and
    special tokens, and ids past the vocabulary."""
    size = hf.get_vocab_size(with_added_tokens=True)
    alone = hf.decode_batch([[t] for t in range(size)], skip_special_tokens=True)
    partial = [t for t, text in enumerate(alone) if "\ufffd" in text]
    special = [t for t, text in enumerate(alone) if text == ""]
    return [list(range(size)), partial, special, [size, size + 7]]


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_stream_is_decode_stream(hf, pools, skip):
    assert byte_level(hf)
    rng = random.Random(skip)
    assert pools[1] and pools[2]      # the test would be blind without them
    emoji = hf.encode("é 中文 🙂🙂 naïve", add_special_tokens=False).ids
    clean = CleanPieces(hf, skip)
    fast_steps = 0
    for _ in range(2000):
        context = [rng.choice(rng.choice(pools[:3])) for _ in range(rng.randrange(5))]
        ours, theirs = ByteLevelStream(list(context), clean), DecodeStream(ids=list(context),
                                                                           skip_special_tokens=skip)
        ids = []
        for _ in range(rng.randrange(1, 40)):
            r = rng.random()
            pool = pools[0] if r < 0.6 else pools[1] if r < 0.8 else pools[2] if r < 0.95 else pools[3]
            ids.append(rng.choice(pool))
            if rng.random() < 0.1:
                ids += emoji
        for t in ids:
            fast_steps += ours.steady
            assert ours.step(hf, t) == theirs.step(hf, t), (context, ids, t)
    assert fast_steps > 5000          # the shortcut was taken, and agreed
