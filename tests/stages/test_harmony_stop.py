"""Stop strings over Harmony (gpt-oss) output: they match in a message's content, never in
its header words (stop "final" must not stop at <|channel|>final), one token a step."""
import pytest

from gpu.tokenizers.harmony import harmony_encoding, harmony_tokenizer
from tests.support.rendered import rendered
from stages.delta import Delta, FinishReason
from stages.detokenize import Detokenizer, HarmonyMarks
from stages.messages import Step


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


def ids(tok, text):
    """Text with Harmony's special tokens in it -> ids (the special tokens as themselves)."""
    enc = harmony_encoding()
    return enc.encode(text, allowed_special="all")


PROMPT = "<|start|>user<|message|>Say it<|end|><|start|>assistant"


def run(tok, output: str, stop, skip_special_tokens=True):
    """Feed the output one token a step; (the text shown, finish reason, stop reason)."""
    det = Detokenizer(tok)
    req = rendered("r", ids(tok, PROMPT), stop=stop, skip_special_tokens=skip_special_tokens, max_tokens=200)
    out_ids = ids(tok, output)
    text, finish, reason = "", None, None
    for i, t in enumerate(out_ids):
        last = i == len(out_ids) - 1
        step = Step(i + 1, (req,) if i == 0 else (), (Delta("r", (t,), FinishReason.LENGTH if last else None),))
        out, _ = det.process(step)
        if not out.deltas:
            break
        d = out.deltas[0]
        text += d.text
        if d.finish_reason is not None:
            finish, reason = d.finish_reason, d.stop_reason
            break
    return text, finish, reason


ANSWER = ("<|channel|>analysis<|message|>The user wants it.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Here it is, final answer.<|return|>")


@pytest.mark.parametrize("skip", [True, False])
def test_stop_string_skips_the_header_word_and_matches_in_content(tok, skip):
    text, finish, reason = run(tok, ANSWER, ["final"], skip)
    assert finish == FinishReason.STOP and reason == "final"
    shown = ("analysisThe user wants it.assistantfinalHere it is, " if skip else
             "<|channel|>analysis<|message|>The user wants it.<|end|><|start|>assistant<|channel|>final"
             "<|message|>Here it is, ")
    assert text == shown                                     # cut at the content's "final"


def test_header_words_alone_never_stop(tok):
    for stop in (["final"], ["analysis"], ["assistant"], ["finalHere"], ["analysisThe"]):
        text, finish, _ = run(tok, ANSWER, stop)
        if stop == ["final"]:
            continue                                           # matched in the content
        assert finish == FinishReason.LENGTH, stop
        assert text.endswith("final answer.")


def test_content_stop_still_matches_across_tokens(tok):
    _, finish, reason = run(tok, ANSWER, ["wants it"])
    assert finish == FinishReason.STOP and reason == "wants it"


def test_other_vocabularies_have_no_marks(tok):
    assert HarmonyMarks.of(tok.hf) is not None and HarmonyMarks.of(None) is None
    marks = HarmonyMarks.of(tok.hf)
    assert marks.in_header(ids(tok, PROMPT)) and not marks.in_header(ids(tok, "plain text"))
