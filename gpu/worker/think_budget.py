"""thinking_token_budget (vLLM's): a sequence reasons for at most `budget` tokens; the token
sampled after the last of them is replaced by </think>, which closes the reasoning (as
vLLM's logits processor forces the end-of-think token). Reasoning starts with the prompt
(when it leaves a <think> open) or at a sampled <think>, and ends at a sampled </think>;
each reasoning span gets the budget anew.

Host-side and per sequence: the runner applies it to each sampled token before the token
is recorded, so the next step's input (and async scheduling's placeholder) is the forced one."""
from __future__ import annotations


class ThinkBudget:
    __slots__ = ("budget", "open_id", "close_id", "thinking", "count")

    def __init__(self, budget: int, think: tuple[int, int], thinking: bool) -> None:
        self.budget = budget
        self.open_id, self.close_id = think
        self.thinking = thinking    # the prompt leaves the reasoning open
        self.count = 0              # reasoning tokens so far in this span

    def next(self, token: int) -> int:
        """The token the sequence gets in place of the sampled `token`."""
        if not self.thinking:
            if token == self.open_id:
                self.thinking, self.count = True, 0
            return token
        if token != self.close_id and self.count >= self.budget:
            token = self.close_id           # the budget is spent: close the reasoning
        if token == self.close_id:
            self.thinking = False
        else:
            self.count += 1
        return token
